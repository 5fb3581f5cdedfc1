"""Turning logits into the distributions tokens are sampled from.

Temperature, top-k and top-p are applied identically to target and draft logits, row by row
with per-row parameters. Greedy rows (temperature 0) become one-hot distributions on the
argmax, so one code path carries mixed batches. Randomness always comes from per-request
``torch.Generator`` objects, one per row, never from global state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.config import GREEDY_BELOW, SamplingParams


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of a batch, ready for vectorised use."""

    temperature: torch.Tensor  # [B] float (0 = greedy)
    top_p: torch.Tensor  # [B] float in (0, 1]
    top_k: torch.Tensor  # [B] int64 (0 = off)
    generators: list[torch.Generator]  # one per row

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator]) -> SamplingTensors:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
            generators=generators,
        )

    @property
    def greedy(self) -> torch.Tensor:  # [B] bool
        return self.temperature < GREEDY_BELOW

    def to(self, device: torch.device) -> SamplingTensors:
        """The parameter tensors on ``device`` (the generators stay on the CPU: draws are the same everywhere)."""
        if self.temperature.device == device:
            return self
        return SamplingTensors(self.temperature.to(device), self.top_p.to(device), self.top_k.to(device),
                               self.generators)

    def repeat(self, n: int) -> SamplingTensors:
        """Each row repeated n times (row b -> rows b*n .. b*n+n-1), for per-position processing."""
        return SamplingTensors(
            self.temperature.repeat_interleave(n),
            self.top_p.repeat_interleave(n),
            self.top_k.repeat_interleave(n),
            [g for g in self.generators for _ in range(n)],
        )

    def uniforms(self, n: int, plain: list[bool] | None = None) -> torch.Tensor:  # [B, n] in [0, 1)
        """``n`` draws per row from its request's generator. A ``plain`` row (one verifying no draft in a
        round of blocks) draws only the 2 a plain round draws, put first and last, where the verifiers
        read them: its stream then does not depend on the rows it is batched with."""
        if not self.generators:
            return torch.empty(0, n)
        rows = []
        for b, g in enumerate(self.generators):
            if plain is not None and plain[b] and n > 2:
                first, last = torch.rand(2, generator=g)
                rows.append(torch.cat((first[None], torch.ones(n - 2), last[None])))
            else:
                rows.append(torch.rand(n, generator=g))
        return torch.stack(rows)


def _truncate_sorted(
    sorted_logits: torch.Tensor,  # [N, K] descending, already divided by temperature
    top_p: torch.Tensor,  # [N]
    top_k: torch.Tensor,  # [N]
    full_lse: torch.Tensor | None = None,  # [N] logsumexp over the whole vocabulary when K < V
) -> torch.Tensor:  # [N, K] probabilities over the sorted candidates
    """top-k, then top-p on the top-k-renormalised distribution (vLLM's order).

    Without ``full_lse`` the candidates are the whole support (a draft prefilter renormalises over
    them); with it, rows without top-k are normalised over the full vocabulary, so a top-p cut
    that falls inside the candidates is exactly the full-vocabulary cut.
    """
    rank = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)[None, :]
    keep_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    masked = sorted_logits.masked_fill(~keep_k, float("-inf"))
    lse = torch.logsumexp(masked, dim=-1)
    if full_lse is not None:
        lse = torch.where(top_k > 0, lse, full_lse)
    probs = torch.exp(masked - lse[:, None])
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    mass_before = probs.cumsum(-1) - probs
    keep = keep_k & ((mass_before < top_p[:, None]) | (rank == 0))
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum(-1, keepdim=True)


NUCLEUS_CANDIDATES = 1024  # top-p is cut among the top 1024 when they provably hold the nucleus


def _candidates(scaled: torch.Tensor, params: SamplingTensors):
    """Sorted candidates for exact top-k/top-p: a partial top-k when it provably suffices, else a full sort."""
    vocab = scaled.shape[-1]
    k = min(NUCLEUS_CANDIDATES, vocab)
    if k < vocab:
        values, index = scaled.topk(k, dim=-1)
        full_lse = torch.logsumexp(scaled, dim=-1)
        mass = torch.exp(values - full_lse[:, None]).sum(-1)
        ok = (params.greedy | ((params.top_k > 0) & (params.top_k <= k))
              | ((params.top_k <= 0) & (params.top_p < 1) & (mass > params.top_p + 1e-6)))
        if bool(ok.all()):
            return values, index, full_lse
    values, index = scaled.sort(dim=-1, descending=True)
    return values, index, None


TRUNCATION_WIDTHS = (64, 1024)  # candidate widths tried, row by row, before a row's full sort


def _truncate_within(
    logits: torch.Tensor,  # [n, V] (temperature applied); the rows decided are cut in place
    top_k: torch.Tensor,  # [n] long, 0 or >= V: off
    top_p: torch.Tensor,  # [n] float, 1: off
    width: int,
) -> torch.Tensor:  # [n] bool: the row is decided (cut)
    """Top-k then top-p among each row's ``width`` largest logits; a row is decided (and cut) where its kept set
    provably lies among them."""
    vocab = logits.shape[-1]
    # [n, width] descending; equal logits rank by token id (the lower first), so a cut through a tie keeps the same
    # tokens every time
    if width >= vocab:
        values, index = logits.sort(dim=-1, descending=True, stable=True)
    else:
        values, index = logits.topk(width, dim=-1)
        by_index = index.argsort(dim=-1)
        values, index = values.gather(1, by_index), index.gather(1, by_index)
        by_value = values.sort(dim=-1, descending=True, stable=True).indices
        values, index = values.gather(1, by_value), index.gather(1, by_value)
    k_on = (top_k > 0) & (top_k < vocab)
    kth = values.gather(1, (torch.where(k_on, top_k, vocab).clamp(max=width) - 1)[:, None])  # [n, 1]
    keep = ~k_on[:, None] | (values >= kth)
    # top-p on the top-k-renormalised mass (float64 over the candidates): the cut lies where the mass before a
    # token crosses p
    top = values[:, :1]
    weights = (values.masked_fill(~keep, float("-inf")) - top).double().exp()  # [n, width]
    total = torch.where(k_on, weights.sum(-1), (logits - top).exp_().sum(-1).double())
    probs = weights / total[:, None]
    mass_before = probs.cumsum(-1) - probs  # [n, width] mass of the tokens ranked above each candidate
    keep &= (top_p >= 1)[:, None] | (mass_before < top_p[:, None])
    # decided when every kept logit is above the last candidate (whatever lies outside ranks below the cut) and
    # so is the whole top-k set (its mass renormalises top-p)
    lowest = values.masked_fill(~keep, float("inf")).amin(-1)  # [n] the smallest logit kept
    decided = ((lowest > values[:, -1]) & (~k_on | (kth[:, 0] > values[:, -1]))) | (width >= vocab)
    # cut: everything below the smallest kept logit, and the candidates tied with it that rank after the cut
    cut = torch.where(decided, lowest, torch.full_like(lowest, float("-inf")))
    logits.masked_fill_(logits < cut[:, None], float("-inf"))
    logits.scatter_(1, index, values.masked_fill(~keep & decided[:, None], float("-inf")))
    return decided


def truncate_logits(
    logits: torch.Tensor,  # [N, V] (temperature applied); changed in place
    top_k: torch.Tensor,  # [N] long, 0 or >= V: off
    top_p: torch.Tensor,  # [N] float in (0, 1], 1: off
) -> torch.Tensor:  # [N, V] -inf outside each row's top-k / top-p set
    """vLLM's top-k then top-p mask (``apply_top_k_top_p``: ties at the k-th logit kept, top-p keeps the tokens
    whose higher-ranked mass is below p, the first always) without sorting the vocabulary: each row is cut among
    its 64, then 1024 largest logits where its kept set provably lies there, and only the rest are sorted. On a CPU
    a sort of 49,152 logits costs ~2 ms a row, so a speculative step verifying 8 rows x 7 positions spent ~100 ms
    in it (``python -m benchmarks.top_k_top_p``). The cut is the same set up to float rounding of the cumulative
    mass at the boundary (tests/test_vllm_dspark.py holds it to vLLM's row by row)."""
    rows, vocab = logits.shape
    pending = torch.nonzero(((top_k > 0) & (top_k < vocab)) | (top_p < 1)).flatten()
    for width in TRUNCATION_WIDTHS + (vocab,):
        if pending.numel() == 0:
            break
        if pending.numel() == rows:  # every row: in place, no copy
            decided = _truncate_within(logits, top_k, top_p, min(width, vocab))
        else:
            part = logits.index_select(0, pending)
            decided = _truncate_within(part, top_k.index_select(0, pending), top_p.index_select(0, pending),
                                       min(width, vocab))
            logits.index_copy_(0, pending[decided], part[decided])
        pending = pending[~decided]
    return logits


def logits_to_probs(
    logits: torch.Tensor,  # [N, V]
    params: SamplingTensors,  # N rows
    prefilter_k: int = 0,  # > 0: only the top prefilter_k logits can be sampled (draft side)
) -> torch.Tensor:  # [N, V] float32, rows sum to 1
    """The exact distribution a row's token is sampled from."""
    logits = logits.float()
    # greedy rows: decided on the host when the parameters are there (no one-hot work for sampled batches); on a
    # device the one-hot is applied without asking it
    any_greedy = bool(params.greedy.any()) if params.temperature.device.type == "cpu" else True
    params = params.to(logits.device)
    greedy = params.greedy
    temperature = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    scaled = logits / temperature[:, None]
    vocab = logits.shape[-1]
    if 0 < prefilter_k < vocab:
        values, index = scaled.topk(prefilter_k, dim=-1)
        full_lse = None
    else:
        values, index, full_lse = _candidates(scaled, params)
    truncated = _truncate_sorted(values, params.top_p, params.top_k, full_lse)
    probs = torch.zeros_like(scaled).scatter_(-1, index, truncated)
    if not any_greedy:
        return probs
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def sample_from(
    probs: torch.Tensor,  # [N, V] (need not be normalised; non-negative)
    uniforms: torch.Tensor,  # [N] in [0, 1)
) -> torch.Tensor:  # [N] int64 token ids
    """Inverse-CDF sampling: one uniform per row, only tokens with positive mass can come out."""
    cdf = probs.cumsum(-1)
    target = uniforms.to(cdf) * cdf[:, -1]
    index = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    # rounding can push the draw past the last positive-mass token: fall back to that token
    last_positive = (probs > 0).long().cumsum(-1).argmax(-1)
    return torch.minimum(index, last_positive)
