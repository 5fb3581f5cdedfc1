"""The target model: compact Llama / Mistral / Qwen2 / Qwen3 / DeepSeek-V3 decoder over a paged KV cache.

One ``forward`` serves prefill and verification: a padded batch of new tokens of several
sequences in, logits at the requested positions and the fused-layer hidden states out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark.config import DecoderConfig
from dspark.decoding.kv_cache import AttentionMetadata, PagedKVCache
from dspark.model.layers import DecoderLayer, Linear, RMSNorm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, P, V] at the requested positions
    features: torch.Tensor | None  # [B, Q, K * hidden] hidden states after the feature layers


class TargetModel(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, index) for index in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def make_cache(self, num_tokens: int, block_size: int) -> PagedKVCache:
        """GQA: keys and values per KV head. MLA: the compressed latent only (kv_lora_rank + rope dims)."""
        cfg = self.config
        return PagedKVCache(cfg.num_layers, num_tokens, block_size, *cfg.cache_geometry, self.dtype,
                            self.embed_tokens.weight.device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, Q] new tokens (padded)
        positions: torch.Tensor,  # [B, Q] their absolute positions
        cache: PagedKVCache,
        meta: AttentionMetadata,
        logits_at: torch.Tensor | None = None,  # [B, P] indices into Q; None: every position
        feature_layers: tuple[int, ...] = (),
    ) -> TargetOutput:
        x = self.embed_tokens(input_ids)
        features: dict[int, torch.Tensor] = {}
        wanted = set(feature_layers)
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.project_q(h, positions)
            cache.write(index, meta.write_slots, *attn.cache_kv(h, positions))
            keys, values = attn.expand_cached(*cache.gather(index, meta.read_slots))
            x = x + attn.attend(q, keys, values, meta.mask)
            x = layer.feed_forward(x)
            if index in wanted:
                features[index] = x
        if logits_at is not None:
            x = torch.gather(x, 1, logits_at[:, :, None].expand(-1, -1, x.shape[-1]))
        logits = self.lm_head(self.norm(x)).float()
        fused = torch.cat([features[i] for i in feature_layers], dim=-1) if feature_layers else None  # ids' order
        return TargetOutput(logits=logits, features=fused)
