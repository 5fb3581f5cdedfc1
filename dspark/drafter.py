"""Drafters: what proposes a block for a batch of running requests.

``DSparkDrafter`` runs the DSpark head over its own paged cache of context keys/values; any
object with the same three methods (``start``, ``propose``, ``release``) can stand in for it
(the tests use an oracle that proposes the target's own continuation).
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from dspark.draft_model import DraftProposal, DSparkDraft
from dspark.request import Request
from dspark.sampling import SamplingTensors


class Drafter(Protocol):
    block_size: int

    def can_start(self, request: Request) -> bool: ...

    def start(self, request: Request) -> None: ...

    def propose(self, requests: list[Request], sampling: SamplingTensors) -> DraftProposal: ...

    def release(self, request: Request) -> None: ...


class DSparkDrafter:
    """The DSpark head plus a per-sequence cache of its context keys and values."""

    def __init__(self, model: DSparkDraft, cache_tokens: int, kv_block_size: int, prefilter_k: int,
                 block_size: int | None = None):
        self.model = model.eval()
        self.block_size = block_size or model.config.block_size
        if self.block_size > model.config.block_size:
            raise ValueError(f"block_size {self.block_size} exceeds the draft's trained {model.config.block_size}")
        self.cache = model.make_cache(cache_tokens, kv_block_size)
        self.prefilter_k = prefilter_k
        self.mask_token_id = model.config.mask_token_id

    def can_start(self, request: Request) -> bool:
        return self.cache.allocator.can_reserve(request.reservation)

    def start(self, request: Request) -> None:
        self.cache.allocator.reserve(request.request_id, request.reservation)

    def release(self, request: Request) -> None:
        self.cache.allocator.free(request.request_id)

    @torch.inference_mode()
    def propose(self, requests: list[Request], sampling: SamplingTensors) -> DraftProposal:
        alloc = self.cache.allocator
        ids = [r.request_id for r in requests]
        starts = [alloc.lengths[i] for i in ids]
        new = [sum(f.shape[0] for f in r.pending_features) for r in requests]
        for r, start in zip(requests, starts):
            if r.pending_features and r.pending_start != start:
                raise RuntimeError(f"request {r.request_id}: draft context out of step ({r.pending_start} != {start})")
        meta = alloc.metadata(ids, starts, new, causal=False, device=self.model.fc.weight.device)
        width, c_max = self.model.fc.in_features, max(max(new), 0)
        features = torch.zeros(len(requests), c_max, width, dtype=self.model.fc.weight.dtype)
        for b, r in enumerate(requests):
            if r.pending_features:
                features[b, : new[b]] = torch.cat(r.pending_features).to(features.dtype)
            r.pending_features = []
        positions = torch.tensor(starts)[:, None] + torch.arange(c_max)[None, :]
        anchor_pos = torch.tensor([len(r.tokens) - 1 for r in requests])
        block_positions = anchor_pos[:, None] + torch.arange(self.block_size)[None, :]
        anchors = torch.tensor([r.anchor for r in requests])
        block_ids = torch.full((len(requests), self.block_size), self.mask_token_id)
        block_ids[:, 0] = anchors
        hidden = self.model.backbone(block_ids, block_positions, self.model.fuse(features), positions,
                                     self.cache, meta)
        return self.model.propose(hidden, anchors, sampling, self.prefilter_k)

    @torch.inference_mode()
    def round_seconds(self, context: int = 64, repeats: int = 3) -> float:
        """Cost of one drafting pass for a single sequence (for the scheduler's cost table)."""
        m = self.model
        dtype, device = m.fc.weight.dtype, m.fc.weight.device
        features = torch.zeros(1, context, m.fc.in_features, dtype=dtype, device=device)
        pos = torch.arange(context)[None]
        block = torch.full((1, self.block_size), self.mask_token_id)
        block_pos = context + torch.arange(self.block_size)[None]
        sampling = SamplingTensors(torch.ones(1), torch.ones(1), torch.zeros(1, dtype=torch.long),
                                   [torch.Generator().manual_seed(0)])
        best = float("inf")
        for _ in range(repeats + 1):
            start = time.perf_counter()
            hidden = m.backbone(block, block_pos, m.fuse(features), pos, None, None)
            m.propose(hidden, block[:, 0], sampling, self.prefilter_k)
            best = min(best, time.perf_counter() - start)
        return best
