"""The hardware-aware prefix scheduler (DSpark Algorithm 1) and its profiled cost table.

Survival ``a[r, j] = prod_{i<=j} c[r, i]``; candidates (r, j) are admitted greedily in
descending order of ``a``; the expected throughput ``theta = (R + sum a) * SPS(R + admitted)``
is tracked and the search stops at the first candidate that does not improve it. Stopping
there (not searching past it) keeps the admission of token j independent of token j's own
value, which is what keeps verification lossless (paper, Appendix A).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepCostProfile:
    """Seconds per decoding round as a function of the verify batch size in tokens."""

    token_counts: tuple[int, ...]  # increasing
    seconds: tuple[float, ...]  # target verify time at each count
    draft_seconds: float = 0.0  # drafting cost per round (independent of the verified length)

    def __post_init__(self) -> None:
        if len(self.token_counts) != len(self.seconds) or not self.token_counts:
            raise ValueError("token_counts and seconds must be non-empty and of equal length")
        if any(b <= a for a, b in zip(self.token_counts, self.token_counts[1:])):
            raise ValueError("token_counts must be strictly increasing")

    def round_seconds(self, tokens: torch.Tensor) -> torch.Tensor:
        """Piecewise-linear in tokens, extrapolated linearly past the last measured point."""
        xs = torch.tensor(self.token_counts, dtype=torch.float64)
        ys = torch.tensor(self.seconds, dtype=torch.float64)
        t = tokens.to(torch.float64)
        if len(xs) == 1:
            return ys[0] * t / xs[0] + self.draft_seconds
        i = torch.searchsorted(xs, t).clamp(1, len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (t - x0) / (x1 - x0) + self.draft_seconds

    def seconds_at(self, tokens: int) -> float:
        """:meth:`round_seconds` of one token count, in plain Python (the per-row choices of a step call it: a
        tensor round trip per call cost ~85 us, more than the arithmetic)."""
        xs, ys = self.token_counts, self.seconds
        if len(xs) == 1:
            return ys[0] * tokens / xs[0] + self.draft_seconds
        i = min(max(bisect.bisect_left(xs, tokens), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0) + self.draft_seconds

    def sps(self, tokens: torch.Tensor) -> torch.Tensor:
        return 1.0 / self.round_seconds(tokens).clamp_min(1e-9)

    @classmethod
    def measure(
        cls,
        verify: Callable[[int], None],
        token_counts: list[int],
        draft: Callable[[], None] | None = None,
        repeats: int = 3,
    ) -> StepCostProfile:
        """Time ``verify(n)`` for each n (best of ``repeats``) on this machine."""

        def best(fn: Callable[[], None]) -> float:
            fn()  # warm-up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return min(times)

        seconds = [best(lambda n=n: verify(n)) for n in token_counts]
        # enforce monotonicity: noise must not make a larger batch look cheaper
        for i in range(1, len(seconds)):
            seconds[i] = max(seconds[i], seconds[i - 1])
        return cls(tuple(token_counts), tuple(seconds), best(draft) if draft else 0.0)


def survival(confidences: torch.Tensor) -> torch.Tensor:
    # confidences: [B, G] -> [B, G] cumulative products a[r, j]
    return confidences.clamp(0, 1).cumprod(dim=1)


def schedule_prefix(
    confidences: torch.Tensor,  # [B, G] conditional acceptance estimates c[r, j]
    profile: StepCostProfile,
    max_lengths: torch.Tensor,  # [B] hard cap per request (remaining budget), >= 0
) -> torch.Tensor:  # [B] number of draft tokens to verify per request
    """Algorithm 1: greedy global admission with early stopping."""
    batch, block = confidences.shape
    a = survival(confidences.double())
    allowed = torch.arange(block)[None, :] < max_lengths[:, None]
    a = torch.where(allowed, a, torch.zeros_like(a))
    order = torch.sort(a.flatten(), descending=True, stable=True).indices
    gains = a.flatten()[order]
    admitted_tokens = batch + torch.arange(1, order.numel() + 1)
    theta = (batch + gains.cumsum(0)) * profile.sps(admitted_tokens)
    base = batch * profile.sps(torch.tensor([batch]))
    previous = torch.cat((base, theta[:-1]))
    improves = (theta > previous) & (gains > 0)
    stop = int(torch.cumprod(improves.long(), 0).sum())
    return torch.bincount(order[:stop] // block, minlength=batch)


def schedule_alone(
    confidences: torch.Tensor,  # [B, G] conditional acceptance estimates c[r, j]
    token_cost: float,  # a verified draft token's cost, as a share of a plain round
    max_lengths: torch.Tensor,  # [B] hard cap per request, >= 0
) -> torch.Tensor:  # [B] number of draft tokens to verify per request
    """Algorithm 1 for each row on its own, over a fixed linear cost model instead of the measured table: a row
    verifying L tokens expects ``1 + a[r, 0] + ... + a[r, L-1]`` tokens for ``1 + token_cost * L`` plain rounds,
    and admits its tokens in order while that ratio improves (stopping at the first that does not, as Algorithm 1
    does). What a row verifies then depends on its own confidences only, never on the server's costs or on the
    rows beside it (seeded sampled rows: ``RowParams.pinned``). ``token_cost`` 0: the whole block."""
    block = confidences.shape[1]
    caps = max_lengths.clamp(min=0, max=block)
    if token_cost <= 0:
        return caps
    a = survival(confidences.double())  # [B, G]
    lengths = torch.arange(block + 1, dtype=torch.float64)  # L = 0 .. G
    expected = torch.cat((torch.ones_like(a[:, :1]), 1 + a.cumsum(1)), dim=1)  # [B, G + 1] tokens at L
    theta = expected / (1 + token_cost * lengths)[None, :]  # [B, G + 1]
    improves = theta[:, 1:] > theta[:, :-1]  # [B, G] adding token j improves on stopping before it
    admitted = torch.cumprod(improves.long(), dim=1).sum(1)  # [B] leading improvements
    return torch.minimum(admitted, caps)


def schedule_full(
    block: int,
    max_lengths: torch.Tensor,  # [B]
) -> torch.Tensor:  # [B]
    return max_lengths.clamp(max=block)
