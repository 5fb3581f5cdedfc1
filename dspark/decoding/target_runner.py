"""The target side of one verify pass: inputs in, verification result and features out.

A ``VerifyBatch`` holds only tensors and plain values, so the in-process engine hands it to a
local ``TargetRunner`` and the Ray router ships the very same object to the target shard
actors: both paths run identical code, which is what makes their greedy outputs identical.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dspark.decoding.kv_cache import AttentionMetadata, PagedKVCache
from dspark.decoding.sampling import SamplingTensors, logits_to_probs
from dspark.decoding.verification import VerifyResult, verify
from dspark.model.target_model import TargetModel


@dataclass
class VerifyBatch:
    """Everything the target needs for one verify pass over B sequences (G = drafted block width)."""

    input_ids: torch.Tensor  # [B, Q] uncached committed tokens then the verified draft tokens (padded)
    positions: torch.Tensor  # [B, Q] absolute positions
    meta: AttentionMetadata  # cache slots and masks, computed by whoever owns the block tables
    logits_at: torch.Tensor  # [B, G + 1] query index of the anchor and of each draft token
    num_uncached: torch.Tensor  # [B] committed tokens entering the cache this pass
    draft_tokens: torch.Tensor  # [B, G]
    num_draft: torch.Tensor  # [B] draft tokens verified per row (the scheduled prefix)
    draft_probs: torch.Tensor | None  # [B, G, V] (dense or sparse COO); None when every row is greedy
    sampling: SamplingTensors  # B rows, generators not needed (uniforms are drawn by the request owner)
    uniforms: torch.Tensor  # [B, G + 2]
    want_features: torch.Tensor  # [B] bool: rows whose committed hidden states go to the drafter
    all_greedy: bool  # decided where the batch is built, so the device never has to answer it

    @property
    def block(self) -> int:
        return self.draft_tokens.shape[1]

    def to(self, device: torch.device | str) -> VerifyBatch:
        """The batch with every tensor on ``device`` (a GPU shard receives it on the CPU)."""
        return to_device(self, torch.device(device))


def to_device(value, device: torch.device):
    """Every tensor inside ``value`` (a tensor or a dataclass of them) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value):
        return type(value)(**{f.name: to_device(getattr(value, f.name), device) for f in dataclasses.fields(value)})
    return value


@dataclass
class VerifyOutput:
    result: VerifyResult
    kept: torch.Tensor  # [B] cache entries that stay (num_uncached + accepted)
    features: torch.Tensor | None  # [B, Q, K * hidden] fused hidden states, None without feature layers

    def packed_features(self, want: torch.Tensor) -> torch.Tensor | None:
        """The committed rows' features of the wanted sequences, concatenated: [sum kept, K * hidden]."""
        if self.features is None:
            return None
        rows = [self.features[b, :k] for b, (k, w) in enumerate(zip(self.kept.tolist(), want.tolist())) if w]
        if not rows:
            return self.features.new_zeros(0, self.features.shape[-1])
        return torch.cat(rows)


class TargetRunner:
    """A target model (whole or one tensor-parallel shard) with its KV cache storage."""

    def __init__(self, model: TargetModel, cache: PagedKVCache, feature_layers: tuple[int, ...], verification: str):
        self.model, self.cache = model, cache
        self.feature_layers, self.verification = feature_layers, verification
        self.config = model.config
        self.allocator = cache.allocator  # block tables; a remote owner keeps its own with the same geometry

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """A bare forward pass (the cost profile of the confidence scheduler)."""
        # input_ids, positions: [B, Q]
        self.model(input_ids, positions, self.cache, meta, None, self.feature_layers)

    @torch.inference_mode()
    def run(self, batch: VerifyBatch) -> VerifyOutput:
        block = batch.block
        out = self.model(batch.input_ids, batch.positions, self.cache, batch.meta, batch.logits_at,
                         self.feature_layers)
        target_logits = out.logits  # [B, G + 1, V]
        if batch.all_greedy:
            target_probs = target_logits
        else:
            flat = logits_to_probs(target_logits.flatten(0, 1), batch.sampling.repeat(block + 1))
            target_probs = flat.view_as(target_logits)
        draft_probs = batch.draft_probs
        if draft_probs is None:
            draft_probs = target_logits.new_zeros(len(batch.draft_tokens), block, target_logits.shape[-1])
        elif draft_probs.is_sparse:
            draft_probs = draft_probs.to_dense()
        result = verify(self.verification, batch.draft_tokens, batch.num_draft, draft_probs, target_logits,
                        target_probs, batch.sampling.greedy, batch.uniforms, batch.all_greedy)
        return VerifyOutput(result, batch.num_uncached + result.num_accepted, out.features)
