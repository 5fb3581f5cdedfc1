"""Speculative-decoding counters, with vLLM's names and the seeds' two acceptance lengths."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecMetrics:
    num_drafts: int = 0  # request-rounds that verified at least one draft token
    num_draft_tokens: int = 0  # draft tokens sent to verification (after the scheduler)
    num_drafted_tokens: int = 0  # draft tokens produced by the drafter (before the scheduler)
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    acceptance_histogram: list[int] = field(default_factory=list)  # drafted rounds by tokens accepted (0..G)
    verify_steps: int = 0  # request-rounds through the target (prefill included)
    completion_tokens: int = 0
    num_requests: int = 0  # finished requests folded into the per-request average
    sum_request_acceptance: float = 0.0  # sum over finished requests of completion/verify steps
    drafter_fallbacks: int = 0  # request-rounds decoded without a draft because the drafter failed
    drafter_failures: int = 0  # drafter failures (remote drafter died or timed out)
    draft_skips: int = 0  # request-rounds the draft gate decoded plainly (recent drafts below break-even)
    feature_bytes: int = 0  # target hidden-state bytes sent to a drafter actor over the collective channel
    lookup_drafts: int = 0  # of num_drafts, rounds whose draft came from prompt lookup (engine.draft_sources)
    lookup_draft_tokens: int = 0  # of num_draft_tokens, lookup's
    lookup_accepted_tokens: int = 0  # of num_accepted_tokens, lookup's

    def record_round(self, drafted: int, scheduled: int, accepted: int, source: str = "head") -> None:
        """One verify round; ``source``: where its draft came from ('head' or 'lookup')."""
        self.verify_steps += 1
        self.num_drafted_tokens += drafted
        if scheduled > 0 and source == "lookup":
            self.lookup_drafts += 1
            self.lookup_draft_tokens += scheduled
            self.lookup_accepted_tokens += accepted
        if scheduled > 0:
            self.num_drafts += 1
            self.num_draft_tokens += scheduled
            self.num_accepted_tokens += accepted
            if len(self.accepted_per_pos) < scheduled:
                self.accepted_per_pos.extend([0] * (scheduled - len(self.accepted_per_pos)))
            for i in range(accepted):
                self.accepted_per_pos[i] += 1
            if len(self.acceptance_histogram) <= accepted:
                self.acceptance_histogram.extend([0] * (accepted + 1 - len(self.acceptance_histogram)))
            self.acceptance_histogram[accepted] += 1

    def record_finished(self, completion_tokens: int, verify_steps: int) -> None:
        self.num_requests += 1
        self.sum_request_acceptance += completion_tokens / max(verify_steps, 1)

    def merge(self, other: SpecMetrics) -> SpecMetrics:
        out = SpecMetrics()
        for name in (
            "num_drafts", "num_draft_tokens", "num_drafted_tokens", "num_accepted_tokens", "verify_steps",
            "completion_tokens", "num_requests", "sum_request_acceptance", "drafter_fallbacks", "drafter_failures",
            "draft_skips", "feature_bytes", "lookup_drafts", "lookup_draft_tokens", "lookup_accepted_tokens",
        ):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.accepted_per_pos = _add_lists(self.accepted_per_pos, other.accepted_per_pos)
        out.acceptance_histogram = _add_lists(self.acceptance_histogram, other.acceptance_histogram)
        return out

    @property
    def acceptance_length(self) -> float:
        """Pooled: 1 + accepted / drafts (vLLM's definition, counts the bonus token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_length_per_request(self) -> float:
        """Completion tokens / verify steps per request, averaged over requests (the release's)."""
        if self.num_requests:
            return self.sum_request_acceptance / self.num_requests
        return self.completion_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [a / self.num_drafts for a in self.accepted_per_pos] if self.num_drafts else []

    def request_summary(self) -> dict:
        """One request's statistics, as returned with its response (``spec``) and listed by ``dspark bench``."""
        return {"acceptance_length": self.completion_tokens / max(self.verify_steps, 1),
                "verify_steps": self.verify_steps, "draft_tokens": self.num_draft_tokens,
                "accepted_tokens": self.num_accepted_tokens, "accepted_per_position": list(self.accepted_per_pos),
                "lookup_drafts": self.lookup_drafts, "lookup_draft_tokens": self.lookup_draft_tokens,
                "lookup_accepted_tokens": self.lookup_accepted_tokens}

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            acceptance_length=self.acceptance_length,
            acceptance_length_per_request=self.acceptance_length_per_request,
            acceptance_rate_per_pos=self.acceptance_rate_per_pos,
        )
        return out


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    size = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (size - len(a)), b + [0] * (size - len(b)))]
