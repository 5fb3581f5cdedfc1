"""The acceptance-length autoscaling policy on synthetic Serve contexts."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from deploy.autoscaling import METRICS, AcceptanceLengthPolicy, ReplicaStats, desired_replicas


def context(per_replica: list[dict], current: int, state: dict | None = None, lo: int = 1, hi: int = 4):
    metrics = {m: {f"r{i}": stats[m] for i, stats in enumerate(per_replica)} for m in METRICS}
    return SimpleNamespace(current_num_replicas=current, aggregated_metrics=metrics, policy_state=state or {},
                           capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi)


def replica(tau: float, token_rate: float, outstanding: float = 0.0) -> dict:
    # 8 slots, 100 ms steps: capacity = tau * 80 tokens/s
    return {"acceptance_length": tau, "step_seconds": 0.1, "batch_slots": 8, "outstanding_tokens": outstanding,
            "token_rate": token_rate}


def test_capacity_model():
    assert ReplicaStats(3.0, 0.1, 8, 0, 0).capacity == pytest.approx(240.0)
    # demand 150 tok/s at 70% utilisation: tau 3 -> capacity 240 -> 1 replica; tau 1.2 -> 96 -> 3 replicas
    assert desired_replicas([ReplicaStats(3.0, 0.1, 8, 0, 150)], 1, 0.7, 10, 0.2)[0] == 1
    assert desired_replicas([ReplicaStats(1.2, 0.1, 8, 0, 150)], 1, 0.7, 10, 0.2)[0] == 3
    # outstanding work counts even when the observed rate is low (a queue building up)
    assert desired_replicas([ReplicaStats(2.0, 0.1, 8, 3000, 10)], 1, 0.7, 10, 0.2)[0] == 3


def test_falling_acceptance_at_constant_load_scales_up():
    policy = AcceptanceLengthPolicy(target_utilisation=0.7)
    n, state = policy(context([replica(3.0, 150)], 1))
    assert n == 1
    n, state = policy(context([replica(1.3, 150)], 1, state))
    assert n == 3  # capacity 104 tok/s per replica at tau 1.3: 150 / (0.7 * 104) -> 3


def test_rising_acceptance_scales_down_after_the_hysteresis_cycles():
    policy = AcceptanceLengthPolicy(target_utilisation=0.7, downscale_cycles=3)
    state, decisions, current = {}, [], 3
    for _ in range(4):  # 150 tok/s served at tau 3.5 (capacity 280 tok/s per replica) by 3 replicas
        n, state = policy(context([replica(3.5, 50)] * current, current, state))
        decisions.append(n)
        current = n
    assert decisions == [3, 3, 1, 1]  # two cycles of patience, then down to what the load needs


def test_the_down_decision_is_sustained_while_serve_waits_out_its_delay():
    """Serve applies a lower decision only after it has stood for downscale_delay_s: while the replica count
    has not changed yet, the policy must keep asking for fewer, not fall back to the current count."""
    policy = AcceptanceLengthPolicy(target_utilisation=0.7, downscale_cycles=3)
    state, decisions = {}, []
    for _ in range(8):  # Serve has not acted yet: still 3 replicas
        n, state = policy(context([replica(3.5, 50)] * 3, 3, state))
        decisions.append(n)
    assert decisions == [3, 3, 1, 1, 1, 1, 1, 1]
    n, state = policy(context([replica(3.5, 150)] * 3, 3, state))  # demand is back: the count holds again
    assert n == 3 and state["below"] == 0


def test_noisy_acceptance_does_not_flap():
    policy = AcceptanceLengthPolicy(target_utilisation=0.7, hysteresis=0.2, downscale_cycles=3)
    rng = random.Random(0)
    current, state, changes = 2, {}, 0
    for _ in range(200):  # demand sits at ~55% of two replicas' capacity at tau ~2.5 (+-10% noise)
        tau = 2.5 * (1 + rng.uniform(-0.1, 0.1))
        rate = 0.55 * 2 * 2.5 * 80 / 2 * (1 + rng.uniform(-0.1, 0.1))
        n, state = policy(context([replica(tau, rate), replica(tau, rate)], current, state))
        changes += n != current
        current = n
    assert changes == 0 and current == 2


def test_bounds_and_missing_telemetry():
    policy = AcceptanceLengthPolicy()
    n, _ = policy(context([replica(1.0, 10_000)], 1, hi=2))
    assert n == 2  # clamped to the maximum
    empty = SimpleNamespace(current_num_replicas=2, aggregated_metrics={}, policy_state={},
                            capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4)
    assert policy(empty)[0] == 2  # no telemetry yet: hold
    with pytest.raises(ValueError):
        AcceptanceLengthPolicy(target_utilisation=0)
