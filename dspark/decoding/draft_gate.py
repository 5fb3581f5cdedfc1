"""The draft gate: per request, skip drafting while its recent blocks do not pay for themselves.

A drafted round costs the draft pass plus a longer verify; it pays when the tokens it accepts
on average exceed ``break_even = cost(drafted round) / cost(plain round) - 1``, read from the
engine's profiled cost table for the round's batch: with R requests decoding together, a round
where each drafts and verifies its whole block of gamma costs ``t(R (1 + gamma)) + d(R)``
against ``t(R)`` plain (``t``: the target's time by tokens verified, ``d``: the draft pass by
rows). Where the target's cost grows with tokens (a CPU, a large batch) the bar rises with R and
the gate stops drafts that would slow the batch down, for greedy and unseeded sampled rows alike.
A pinned row (seeded and sampled) never weighs its batch: whether it drafts decides its random
draws, which must not depend on what else runs.

The gate keeps, per request, an exponential moving average of the draft tokens accepted in its
drafted rounds. Below break-even the request decodes plainly and probes again after 2, 4, 8 ...
(at most ``max_backoff``) plain rounds, so a request whose text becomes predictable (a code
block, a list, a quotation) gets its drafts back. Unpinned rows probe in step: a row waiting
``w`` rounds (a power of two) probes on the rounds of the engine's clock that are multiples of
``w``, so the probes of a batch's held-back rows fall on the same rounds and share one draft
pass (eight rows drafting together cost about 2.4 times one row on a CPU, not 8 times). A
pinned row counts its own rounds, so its draws do not depend on when it joined the batch, and
weighs its own record against a fixed configured bar (``pinned_break_even``) instead of the
measured costs. A probe that could not lift a record over the round's bar even if it kept its
whole block is skipped.

The decision depends only on rounds already verified, never on the tokens being decided, so
it changes how fast a request is decoded and never what is decoded (greedy output stays the
target's, sampled output keeps the target's distribution).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dspark.config import ConfigError
from dspark.decoding.scheduler import StepCostProfile


@dataclass(frozen=True)
class DraftGateConfig:
    smoothing: float = 0.3  # weight of the newest drafted round in the moving average
    initial_accepted: float = 1.0  # the average a new request starts from (optimistic: it drafts first)
    max_backoff: int = 16  # longest run of plain rounds between two probes
    # the probe period of a greedy request that starts below break-even from the server's pooled record (its head
    # is known not to pay on this traffic, and a probe costs a draft pass that first catches up the request's
    # context: on a 2-core CPU in fp32 ~60 ms, a target step, for ~0.6 accepted tokens)
    pooled_backoff: int = 64
    # a pinned row's bar (a seeded sampled request, ``RowParams.pinned``): its draws follow what it drafts, so its
    # gate weighs its own record against this fixed number, never the server's measured costs (0: it always drafts)
    pinned_break_even: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.smoothing <= 1:
            raise ConfigError("draft_gate.smoothing", f"must be in (0, 1], got {self.smoothing}")
        if self.initial_accepted < 0:
            raise ConfigError("draft_gate.initial_accepted", f"must be >= 0, got {self.initial_accepted}")
        if self.max_backoff < 1:
            raise ConfigError("draft_gate.max_backoff", f"must be >= 1, got {self.max_backoff}")
        if self.pooled_backoff < 1:
            raise ConfigError("draft_gate.pooled_backoff", f"must be >= 1, got {self.pooled_backoff}")
        if self.pinned_break_even < 0:
            raise ConfigError("pinned_break_even", f"must be >= 0, got {self.pinned_break_even}")


@dataclass
class GateState:
    """One request's record: its moving average and how long it waits before the next probe."""

    accepted: float
    wait: int = 0  # plain rounds left before the next probe
    backoff: int = 1  # the next wait, doubled after every probe that stays below break-even
    period: int = 1  # the current wait: a greedy row probes on the clock's multiples of it


class DraftGate:
    def __init__(self, break_even: float, config: DraftGateConfig = DraftGateConfig(),
                 by_rows: Callable[[int], float] | None = None, block_size: int | None = None):
        """``break_even``: at one request per round; ``by_rows(R)``: at R requests per round (None: the same);
        ``block_size``: the most a drafted round can accept (a probe that could not lift the record over the
        round's bar even so is skipped; None: every probe runs)."""
        self.break_even, self.config = break_even, config
        self._by_rows, self.block_size = by_rows, block_size
        self._at: dict[int, float] = {}

    @classmethod
    def from_profile(cls, profile: StepCostProfile, block_size: int, config: DraftGateConfig = DraftGateConfig(),
                     draft_seconds: Callable[[int], float] | None = None) -> DraftGate:
        """Break-even of a fully verified block (the dearest drafted round) from the cost table, at every batch:
        ``(t(R (1 + block_size)) + d(R)) / t(R) - 1``. ``draft_seconds(R)``: the draft pass for R rows where it is
        measured by rows, for R > 1 (default, and at one row: the profile's one draft cost)."""

        def at(rows: int) -> float:
            target = profile.round_seconds(torch.tensor([rows, rows * (1 + block_size)])) - profile.draft_seconds
            plain, full = float(target[0]), float(target[1])
            # one row: the profile's draft cost, as ever (a sampled row's bar must not follow the batches drafted)
            draft = draft_seconds(rows) if draft_seconds is not None and rows > 1 else profile.draft_seconds
            return max((full + draft) / max(plain, 1e-9) - 1.0, 0.0)

        return cls(at(1), config, at, block_size)

    @staticmethod
    def batch_of(rows: int, pinned: bool) -> int:
        """The batch a request's gate weighs: the ``rows`` decoding with it (a greedy row's tokens are the target's
        argmax whatever it drafts; an unseeded sampled row's keep the target's distribution whatever it drafts,
        and repeat nothing). A pinned row's draws depend on whether it drafts, so its gate reads its own history
        only (at one row): a seeded request then gives the same tokens alone and in any batch."""
        return 1 if pinned else rows

    @staticmethod
    def clock_of(clock: int, pinned: bool) -> int | None:
        """The clock a request's probes keep: the engine's round count (held-back rows of a batch probe on the same
        rounds and share one draft pass), none for a pinned row (its own rounds: whether it drafts, and with it its
        draws, must not depend on when it joined the batch)."""
        return None if pinned else clock

    def at(self, rows: int, pinned: bool = False) -> float:
        """The break-even of a round with ``rows`` requests decoding together; a pinned row's: the configured fixed
        bar (``DraftGateConfig.pinned_break_even``)."""
        if pinned:
            return self.config.pinned_break_even
        if rows <= 1 or self._by_rows is None:
            return self.break_even
        if rows not in self._at:
            self._at[rows] = self._by_rows(rows)
        return self._at[rows]

    def new_state(self, accepted: float | None = None) -> GateState:
        """A new request's record. ``accepted``: what the server's earlier requests' drafts accepted (greedy rows;
        None: the configured optimistic start). Below break-even the request drafts its first round (a probe of
        its own text: the server's average need not hold for it) and then, while its probes stay below
        break-even, one round in ``pooled_backoff``: a head that does not pay on this traffic costs a new request
        a probe now and then, not its first drafted rounds."""
        if accepted is None:
            return GateState(self.config.initial_accepted)
        if accepted >= self.break_even:
            return GateState(accepted)
        return GateState(accepted, wait=0, backoff=self.config.pooled_backoff, period=1)

    def wants_draft(self, state: GateState, rows: int = 1, clock: int | None = None, pinned: bool = False) -> bool:
        """Whether the request drafts this round (call once per round), in a round of ``rows`` requests;
        ``clock``: the engine's round count, for probes on its multiples of the request's wait (``clock_of``);
        ``pinned``: a seeded sampled row (its fixed bar, its own rounds)."""
        bar = self.at(rows, pinned)
        if state.accepted >= bar:
            return True
        alpha = self.config.smoothing
        if self.block_size is not None and (1 - alpha) * state.accepted + alpha * self.block_size < bar:
            return False  # even a fully accepted probe would leave the record below this round's bar
        if clock is not None:
            return clock % state.period == 0
        if state.wait > 0:
            state.wait -= 1
            return False
        return True  # a probe

    def record(self, state: GateState, accepted: int, rows: int = 1, pinned: bool = False) -> None:
        """A drafted round of the request (``rows`` requests in it) was verified with ``accepted`` draft tokens
        kept."""
        alpha = self.config.smoothing
        state.accepted = (1 - alpha) * state.accepted + alpha * accepted
        if state.accepted >= self.at(rows, pinned):
            state.backoff, state.wait, state.period = 1, 0, 1
        else:
            state.wait = state.period = state.backoff
            state.backoff = min(2 * state.backoff, max(self.config.max_backoff, state.backoff))  # pooled: stays


class PooledAcceptance:
    """The draft tokens accepted per drafted round, pooled over a server's greedy requests (a slow moving
    average, known after ``min_rounds`` rounds): what a new greedy request's gate starts from
    (:meth:`DraftGate.new_state`), so that on traffic where the head does not pay each new request does not first
    draft its way down from the optimistic start. Greedy rows only: a greedy row's tokens are the target's argmax
    whatever it drafts, while a sampled row's draws must not depend on other requests."""

    def __init__(self, smoothing: float = 0.05, min_rounds: int = 16):
        self.smoothing, self.min_rounds = smoothing, min_rounds
        self.rounds, self._average = 0, 0.0

    def observe(self, accepted: int) -> None:
        self.rounds += 1
        weight = max(self.smoothing, 1.0 / self.rounds)  # a plain mean over the first rounds
        self._average += weight * (accepted - self._average)

    @property
    def value(self) -> float | None:
        return self._average if self.rounds >= self.min_rounds else None
