"""Hybrid drafting's choice (``engine.draft_sources``): per request and per step, prompt lookup's draft or the DSpark
head's turn, by expected accepted tokens per second of step. Written once for both engines that draft: the native
engine (``dspark.decoding.engine``, its head behind the drafter actor) and our proposer inside vLLM
(``dspark.integrations.step_drafter``).

Lookup's expected accepted tokens come from the survival of its past drafts by position (``LookupRecord``): pooled
over every request of the server by match length and row kind (``LookupStats``), or for a seeded sampled row, whose
draws must not depend on other traffic, from its own drafts and the prior only. The head's come from the request's
own verified head drafts (the draft gate's moving average where the gate runs). Step costs come from the measured
cost table (``StepCostProfile``); sampled rows choose without it, so their choices never follow the server's timings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark.decoding.lookup import PINNED_MIN_NGRAM, LookupRecord, LookupStats, PromptLookup
from dspark.decoding.scheduler import StepCostProfile

SOURCES = ("head", "lookup")  # where a row's draft comes from: the DSpark head, or prompt lookup
HEAD_PRIOR = 1.0  # expected accepted head tokens before a request's first verified head draft (the gate's prior)
HEAD_SMOOTHING = 0.3  # as the gate's moving average


@dataclass
class SourceStats:
    """One draft source's counters (per engine, exported by source in ``/metrics``)."""

    drafts: int = 0  # request-steps that verified a draft of this source
    drafted_tokens: int = 0  # its tokens sent to verification
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j] drafts that kept at least j + 1 tokens

    def record(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        while len(self.accepted_per_pos) < accepted:
            self.accepted_per_pos.append(0)
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    def as_dict(self) -> dict:
        return {"drafts": self.drafts, "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos),
                "acceptance_length": 1 + self.accepted_tokens / self.drafts if self.drafts else None}


@dataclass
class LookupChoice:
    """A lookup draft taken for this step."""

    tokens: list[int]
    conditionals: list[float]  # [j] P(token j accepted | every token before it accepted)
    match: int  # length of the n-gram matched


@dataclass
class RowSources:
    """One request's part of the choice: its tokens' n-gram index, its verified drafts of each source, and where
    the draft it has in verification came from."""

    lookup: PromptLookup | None  # None: lookup is not among the sources
    record: LookupRecord = field(default_factory=LookupRecord)  # its verified lookup drafts
    match: int = 0  # the n-gram length its lookup draft in verification matched
    drafted: int = 0  # the tokens of its lookup draft in verification
    head_accepted: float = HEAD_PRIOR  # its head drafts' accepted tokens, moving average (without the gate)
    source: str | None = None  # the source of its draft in verification


class DraftSources:
    """``sources``: 'head' (the DSpark head only), 'lookup' (prompt lookup only) or 'hybrid'."""

    def __init__(self, sources: str = "head", block_size: int = 1):
        if sources not in ("head", "lookup", "hybrid"):
            raise ValueError(f"sources must be 'head', 'lookup' or 'hybrid', got {sources!r}")
        self.sources, self.block_size = sources, block_size
        self.lookup_stats = LookupStats()  # every request's verified lookup drafts, by match length and row kind
        self.stats = {s: SourceStats() for s in SOURCES}

    @property
    def head_only(self) -> bool:
        return self.sources == "head"

    def new_row(self, prompt: list[int] | None) -> RowSources:
        """A new request's part (``prompt`` None: its tokens are not known here, so it drafts with the head)."""
        return RowSources(None if self.head_only or prompt is None else PromptLookup(prompt))

    def choose(self, row: RowSources, k: int, greedy: bool, pinned: bool, head_expected: float,
               profile: StepCostProfile | None, draft_seconds: float, rows: int = 1) -> LookupChoice | None:
        """The request's lookup draft if lookup is this step's source for it, else None (the head's turn, or
        nothing). Hybrid: lookup when the step's expected tokens per second with it are at least with the head's
        block — ``(R + E) / t(R + k)`` for lookup (no draft pass) against ``(R + E_head) / (t(R + G) + d)``, ``R``
        the ``rows`` decoding together (the others counted plain), ``t`` from ``profile`` and ``d`` the draft pass
        (``draft_seconds``) — and at least plain decoding's ``R / t(R)`` (a lookup below break-even is no better
        than the head the draft gate would skip: the head's turn then, which the gate decides). On a CPU, where
        the target's step grows with its tokens, the bar rises with the batch. Without a profile (none measured
        yet; pinned rows, whose draws must not depend on the server's timings or batch, pass none): lookup when
        ``E >= E_head``. ``k``: tokens the request may still verify."""
        if self.head_only or row.lookup is None or k <= 0:
            return None
        draft = row.lookup.propose(min(k, self.block_size), PINNED_MIN_NGRAM if pinned else None)
        if not draft.tokens:
            return None
        record = row.record if pinned else self.lookup_stats.of(draft.match, greedy)
        survival = record.survival(len(draft.tokens))
        conditionals = [survival[0]] + [b / max(a, 1e-12) for a, b in zip(survival, survival[1:])]
        choice = LookupChoice(draft.tokens, conditionals, draft.match)
        if self.sources == "lookup":
            return choice
        expected = sum(survival)
        if profile is None:
            take = expected >= head_expected
        else:
            plain, with_lookup, with_head = (profile.seconds_at(n) - profile.draft_seconds
                                             for n in (rows, rows + len(draft.tokens), rows + self.block_size))
            rate = (rows + expected) / with_lookup  # tokens per second of step with the lookup draft
            take = rate >= (rows + head_expected) / (with_head + draft_seconds) and rate >= rows / plain
        return choice if take else None

    def taken(self, row: RowSources, choice: LookupChoice | None) -> None:
        """The row verifies ``choice`` next (None: a head draft)."""
        row.source = "lookup" if choice is not None else "head"
        if choice is not None:
            row.match, row.drafted = choice.match, len(choice.tokens)

    def record(self, row: RowSources, drafted: int, accepted: int, greedy: bool) -> str:
        """A draft of the row was verified: ``accepted`` of its ``drafted`` tokens kept. Returns its source; a
        head draft's gate record is the caller's."""
        source = row.source or "head"
        self.stats[source].record(drafted, accepted)
        if source == "lookup":
            row.record.record(drafted, accepted)
            self.lookup_stats.record(row.match, greedy, drafted, accepted)
        else:
            row.head_accepted = (1 - HEAD_SMOOTHING) * row.head_accepted + HEAD_SMOOTHING * accepted
        return source

    def extend(self, row: RowSources, tokens: list[int]) -> None:
        """Committed tokens of the row (its n-gram index follows its text)."""
        if row.lookup is not None:
            row.lookup.extend(tokens)

    def as_dict(self) -> dict[str, dict]:
        return {source: stats.as_dict() for source, stats in self.stats.items()}
