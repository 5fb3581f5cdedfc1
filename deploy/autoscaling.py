"""Autoscaling serving replicas by acceptance-length telemetry (a Ray Serve custom policy).

Every replica reports, through ``record_autoscaling_stats`` (Serve averages them over
``look_back_period_s``):

    acceptance_length   tau: tokens committed per request-round (verify pass of one request)
    step_seconds        mean duration of one engine step (one verify pass of the whole batch)
    batch_slots         max_num_seqs: request-rounds one step can carry
    outstanding_tokens  tokens still owed to running and waiting requests (max_tokens - generated)
    token_rate          tokens generated per second

The model. One replica, at a full batch, generates
    capacity = tau * batch_slots / step_seconds        tokens/s
so a falling acceptance length lowers every replica's capacity. The offered demand is
    demand = max(sum token_rate, sum outstanding_tokens / drain_horizon_s)     tokens/s
(what is being served now, or what is owed, to be cleared within the horizon). The policy wants
    desired = ceil(demand / (target_utilisation * mean capacity))
replicas. It scales up as soon as ``desired`` exceeds the current count; it scales down only
after ``downscale_cycles`` consecutive decisions in which even ``current - 1`` replicas would
stay below ``(1 - hysteresis) * target_utilisation``, so a noisy metric does not flap, and then
keeps asking for fewer for as long as that holds (Serve scales down only after the lower
decision has stood for ``downscale_delay_s``). Serve
then clamps to ``min_replicas``/``max_replicas`` and applies its up/down delays.

One deployment = one replica kind: each Serve replica owns its router, target shard actors and
drafter (its placement group), so target and drafter always scale together and no
application-level policy is needed.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

log = logging.getLogger("ray.serve")

METRICS = ("acceptance_length", "step_seconds", "batch_slots", "outstanding_tokens", "token_rate")


@dataclass
class ReplicaStats:
    acceptance_length: float
    step_seconds: float
    batch_slots: float
    outstanding_tokens: float
    token_rate: float

    @property
    def capacity(self) -> float:
        """Tokens/s this replica generates at a full batch at its current acceptance length."""
        return max(self.acceptance_length, 1.0) * self.batch_slots / max(self.step_seconds, 1e-3)


def desired_replicas(stats: list[ReplicaStats], current: int, target_utilisation: float, drain_horizon_s: float,
                     hysteresis: float) -> tuple[int, int]:
    """(replicas wanted to scale up to, replicas that suffice to scale down to); pure, for tests."""
    capacity = sum(s.capacity for s in stats) / len(stats)
    demand = max(sum(s.token_rate for s in stats), sum(s.outstanding_tokens for s in stats) / drain_horizon_s)
    up = max(math.ceil(demand / (target_utilisation * capacity) - 1e-9), 1)
    down_target = (1.0 - hysteresis) * target_utilisation * capacity
    down = current
    while down > 1 and demand < down_target * (down - 1):
        down -= 1
    return up, down


class AcceptanceLengthPolicy:
    """The Serve policy: ``AutoscalingPolicy(policy_function="deploy.autoscaling:AcceptanceLengthPolicy",
    policy_kwargs={...})``; called with an ``AutoscalingContext``, returns (replicas, state)."""

    def __init__(self, target_utilisation: float = 0.7, drain_horizon_s: float = 10.0, hysteresis: float = 0.2,
                 downscale_cycles: int = 3):
        if not 0 < target_utilisation <= 1:
            raise ValueError("target_utilisation must be in (0, 1]")
        self.target_utilisation, self.drain_horizon_s = target_utilisation, drain_horizon_s
        self.hysteresis, self.downscale_cycles = hysteresis, downscale_cycles

    def __call__(self, ctx) -> tuple[int, dict]:
        state = dict(ctx.policy_state or {})
        current = ctx.current_num_replicas
        metrics = ctx.aggregated_metrics or {}
        replicas = set.intersection(*(set(metrics.get(m, {})) for m in METRICS)) if metrics else set()
        if not replicas:  # no telemetry yet (starting): hold
            return max(current, ctx.capacity_adjusted_min_replicas), state
        stats = [ReplicaStats(*(float(metrics[m][r]) for m in METRICS)) for r in replicas]
        up, down = desired_replicas(stats, current, self.target_utilisation, self.drain_horizon_s,
                                    self.hysteresis)
        capacity = sum(s.capacity for s in stats) / len(stats)
        if (up, down) != (state.get("up"), state.get("down")):
            demand = max(sum(s.token_rate for s in stats), sum(s.outstanding_tokens for s in stats) /
                         self.drain_horizon_s)
            log.info("dspark autoscaling: %d replicas, capacity %.1f tok/s per replica, demand %.1f tok/s -> up %d / "
                     "down %d; per replica %s", current, capacity, demand, up, down,
                     [tuple(round(v, 2) for v in vars(s).values()) for s in stats])
        state["up"], state["down"], state["capacity"] = up, down, capacity
        if up > current:
            state["below"] = 0
            decision = up
        elif down < current:  # once patient enough, keep asking while it holds: Serve's downscale_delay_s
            state["below"] = state.get("below", 0) + 1  # needs a sustained lower decision, not one in three
            decision = down if state["below"] >= self.downscale_cycles else current
        else:
            state["below"] = 0
            decision = current
        lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        return min(max(decision, lo), hi), state
