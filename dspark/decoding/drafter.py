"""Drafters: what proposes a block for a batch of running requests.

``DSparkDrafter`` runs the DSpark head over its own paged cache of context keys/values; any
object with the methods of ``Drafter`` can stand in for it
(the tests use an oracle that proposes the target's own continuation).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from dspark.decoding.request import Request
from dspark.decoding.sampling import SamplingTensors
from dspark.model.draft_model import DraftProposal, DSparkDraft


@dataclass
class DraftInputs:
    """Which sequences to draft for, and where each block starts."""

    request_ids: list[int]
    anchors: torch.Tensor  # [B] last committed token of each sequence
    anchor_positions: torch.Tensor  # [B] its position (= tokens of context before it)

    @classmethod
    def from_requests(cls, requests: list[Request]) -> DraftInputs:
        return cls([r.request_id for r in requests], torch.tensor([r.anchor for r in requests]),
                   torch.tensor([len(r.tokens) - 1 for r in requests]))


class DrafterUnavailable(RuntimeError):
    """A remote drafter died, timed out or lost its channel: the step goes on without drafts (plain decoding, the
    same output), the sequences it held lose their context, and it is being replaced."""


class Drafter(Protocol):
    block_size: int
    available: bool  # False while a remote drafter is down: new requests then decode without drafts

    def can_start(self, request: Request) -> bool: ...

    def start(self, request: Request) -> None: ...

    def commit(self, request_ids: list[int], kept: list[int], features: torch.Tensor | None) -> None:
        """Context rows committed by a verify pass: ``kept[i]`` rows for ``request_ids[i]``, packed in
        ``features`` [sum kept, K * hidden] (None when they travel to the drafter another way)."""

    def submit(self, requests: list[Request], sampling: SamplingTensors) -> object:
        """Start drafting a block per request; returns a handle for ``result`` (an in-process drafter drafts
        here and hands the proposal back as the handle; a remote one returns at once)."""

    def result(self, handle: object) -> DraftProposal | None:
        """The blocks of a ``submit``; None if the drafter failed (those requests go on without it)."""

    def release(self, request: Request) -> None: ...


class DSparkDrafter:
    """The DSpark head plus a per-sequence cache of its context keys and values."""

    available = True

    def __init__(self, model: DSparkDraft, cache_tokens: int, kv_block_size: int, prefilter_k: int,
                 block_size: int | None = None):
        self.model = model.eval()
        self.block_size = block_size or model.config.block_size
        if self.block_size > model.config.block_size:
            raise ValueError(f"block_size {self.block_size} exceeds the draft's trained {model.config.block_size}")
        self.cache = model.make_cache(cache_tokens, kv_block_size)
        self.prefilter_k = prefilter_k
        self.mask_token_id = model.config.mask_token_id
        self.pending: dict[int, list[torch.Tensor]] = {}  # request id -> context rows not yet in the cache

    def can_start(self, request: Request) -> bool:
        return self.can_start_sequence(request.reservation)

    def can_start_sequence(self, reservation: int) -> bool:
        return self.cache.allocator.can_reserve(reservation)

    def start(self, request: Request) -> None:
        self.start_sequence(request.request_id, request.reservation)

    def start_sequence(self, request_id: int, reservation: int) -> None:
        self.cache.allocator.reserve(request_id, reservation)
        self.pending[request_id] = []

    def release(self, request: Request) -> None:
        self.release_sequence(request.request_id)

    def release_sequence(self, request_id: int) -> None:
        self.cache.allocator.free(request_id)
        self.pending.pop(request_id, None)

    def commit(self, request_ids: list[int], kept: list[int], features: torch.Tensor | None) -> None:
        if features is None:
            raise ValueError("the in-process drafter needs the committed features")
        for rid, rows in zip(request_ids, features.split(kept)):
            if rid in self.pending and len(rows):
                self.pending[rid].append(rows)

    def submit(self, requests: list[Request], sampling: SamplingTensors) -> DraftProposal:
        return self.draft(DraftInputs.from_requests(requests), sampling)

    def result(self, handle: DraftProposal) -> DraftProposal:
        return handle

    @torch.inference_mode()
    def draft(self, inputs: DraftInputs, sampling: SamplingTensors) -> DraftProposal:
        alloc = self.cache.allocator
        ids = inputs.request_ids
        starts = [alloc.lengths[i] for i in ids]
        pending = [self.pending.pop(i, []) for i in ids]
        for i in ids:
            self.pending[i] = []
        new = [sum(f.shape[0] for f in rows) for rows in pending]
        for rid, start, n, anchor_pos in zip(ids, starts, new, inputs.anchor_positions.tolist()):
            if start + n != anchor_pos:
                raise RuntimeError(f"request {rid}: draft context out of step ({start} + {n} rows != {anchor_pos})")
        device = self.model.fc.weight.device
        meta = alloc.metadata(ids, starts, new, causal=False, device=device)
        width, c_max = self.model.fc.in_features, max(max(new), 0)
        features = torch.zeros(len(ids), c_max, width, dtype=self.model.fc.weight.dtype, device=device)
        for b, rows in enumerate(pending):
            if rows:
                features[b, : new[b]] = torch.cat(rows).to(features)
        positions = torch.tensor(starts, device=device)[:, None] + torch.arange(c_max, device=device)[None, :]
        anchors = inputs.anchors.to(device)
        block_ids, block_positions = self.model.block_inputs(anchors, inputs.anchor_positions.to(device),
                                                             self.block_size)
        hidden = self.model.backbone(block_ids, block_positions, self.model.fuse(features), positions,
                                     self.cache, meta)
        return self.model.propose(self.model.predicting(hidden), anchors, sampling, self.prefilter_k)

    @torch.inference_mode()
    def round_seconds(self, context: int = 64, repeats: int = 3) -> float:
        """Cost of one drafting pass for a single sequence (for the scheduler's cost table)."""
        m = self.model
        dtype, device = m.fc.weight.dtype, m.fc.weight.device
        features = torch.zeros(1, context, m.fc.in_features, dtype=dtype, device=device)
        pos = torch.arange(context, device=device)[None]
        anchor = torch.full((1,), self.mask_token_id, device=device)
        block, block_pos = m.block_inputs(anchor, torch.full((1,), context, device=device), self.block_size)
        sampling = SamplingTensors(torch.ones(1), torch.ones(1), torch.zeros(1, dtype=torch.long),
                                   [torch.Generator().manual_seed(0)])
        best = float("inf")
        for _ in range(repeats + 1):
            start = time.perf_counter()
            hidden = m.backbone(block, block_pos, m.fuse(features), pos, None, None)
            m.propose(m.predicting(hidden), anchor, sampling, self.prefilter_k)
            best = min(best, time.perf_counter() - start)
        return best
