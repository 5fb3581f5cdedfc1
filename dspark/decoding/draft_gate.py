"""The draft gate: per request, skip drafting while its recent blocks do not pay for themselves.

A drafted round costs the draft pass plus a longer verify; it pays when the tokens it accepts
on average exceed ``break_even = cost(drafted round) / cost(plain round) - 1``, read from the
engine's profiled cost table. The gate keeps, per request, an exponential moving average of the
draft tokens accepted in its drafted rounds. Below break-even the request decodes plainly and
probes again after 2, 4, 8 ... (at most ``max_backoff``) plain rounds, so a request whose text
becomes predictable (a code block, a list, a quotation) gets its drafts back.

The decision depends only on rounds already verified, never on the tokens being decided, so
it changes how fast a request is decoded and never what is decoded (greedy output stays the
target's, sampled output keeps the target's distribution).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.config import ConfigError
from dspark.decoding.scheduler import StepCostProfile


@dataclass(frozen=True)
class DraftGateConfig:
    smoothing: float = 0.3  # weight of the newest drafted round in the moving average
    initial_accepted: float = 1.0  # the average a new request starts from (optimistic: it drafts first)
    max_backoff: int = 16  # longest run of plain rounds between two probes

    def __post_init__(self) -> None:
        if not 0 < self.smoothing <= 1:
            raise ConfigError("draft_gate.smoothing", f"must be in (0, 1], got {self.smoothing}")
        if self.initial_accepted < 0:
            raise ConfigError("draft_gate.initial_accepted", f"must be >= 0, got {self.initial_accepted}")
        if self.max_backoff < 1:
            raise ConfigError("draft_gate.max_backoff", f"must be >= 1, got {self.max_backoff}")


@dataclass
class GateState:
    """One request's record: its moving average and how long it waits before the next probe."""

    accepted: float
    wait: int = 0  # plain rounds left before the next probe
    backoff: int = 1  # the next wait, doubled after every probe that stays below break-even


class DraftGate:
    def __init__(self, break_even: float, config: DraftGateConfig = DraftGateConfig()):
        self.break_even, self.config = break_even, config

    @classmethod
    def from_profile(cls, profile: StepCostProfile, block_size: int,
                     config: DraftGateConfig = DraftGateConfig()) -> DraftGate:
        """Break-even at batch 1 for a fully verified block (the dearest drafted round)."""
        drafted = float(profile.round_seconds(torch.tensor([1 + block_size]))[0])
        plain = float(profile.round_seconds(torch.tensor([1]))[0]) - profile.draft_seconds
        return cls(max(drafted / max(plain, 1e-9) - 1.0, 0.0), config)

    def new_state(self) -> GateState:
        return GateState(self.config.initial_accepted)

    def wants_draft(self, state: GateState) -> bool:
        """Whether the request drafts this round (call once per round)."""
        if state.accepted >= self.break_even:
            return True
        if state.wait > 0:
            state.wait -= 1
            return False
        return True  # a probe

    def record(self, state: GateState, accepted: int) -> None:
        """A drafted round of the request was verified with ``accepted`` draft tokens kept."""
        alpha = self.config.smoothing
        state.accepted = (1 - alpha) * state.accepted + alpha * accepted
        if state.accepted >= self.break_even:
            state.backoff, state.wait = 1, 0
        else:
            state.wait = state.backoff
            state.backoff = min(2 * state.backoff, self.config.max_backoff)
