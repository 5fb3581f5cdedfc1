"""The teacher's pass: the target reads a batch of training rows once, teacher forced, and hands every head trained
beside it what it needs: the fused layers' hidden states (the head's context), the normed final hidden state and
the log-sum-exp of the full-vocabulary logits (the target's probabilities of any token at any position).

Rows all have the same length (the corpus packs them so), so the pass is one dense causal batch with no cache and
no padding; its rows never meet a decode, so it runs the fastest kernels rather than the batch-invariant ones
serving needs (``shape_variant_kernels``, ``F.scaled_dot_product_attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.model.layers import shape_variant_kernels
from dspark.model.target_model import TargetModel
from dspark.training.target_cache import ShardRows, TargetCache


@torch.inference_mode()
def teacher_pass(target: TargetModel, ids: torch.Tensor, layer_ids: tuple[int, ...]) -> TargetCache:
    """``ids`` [B, L] -> a :class:`TargetCache` of the B rows (sequence i spans rows i*L .. (i+1)*L; every token
    counts as a reply token: the caller picks anchors)."""
    batch, length = ids.shape
    positions = torch.arange(length)[None].expand(batch, length)
    last = target.config.num_layers - 1
    wanted = set(layer_ids)
    features: dict[int, torch.Tensor] = {}
    with shape_variant_kernels():
        x = target.embed_tokens(ids)
        for index, layer in enumerate(target.layers[: last + 1]):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.project_q(h, positions).transpose(1, 2)  # [B, H, L, D]
            k, v = (t.transpose(1, 2) for t in attn.project_kv(h, positions))  # [B, Hkv, L, D]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
            x = layer.feed_forward(x + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1)))
            if index in wanted:
                features[index] = x
        final = target.norm(x)  # [B, L, H]
        lse = torch.logsumexp(F.linear(final, target.lm_head.weight).float(), dim=-1)  # [B, L]
    rows = batch * length
    fused = torch.cat([features[i] for i in layer_ids], dim=-1).reshape(rows, -1).to(torch.bfloat16)
    offsets = [i * length for i in range(batch + 1)]
    return TargetCache(tokens=ids.reshape(-1).long(), features=ShardRows([fused]),
                       final_hidden=ShardRows([final.reshape(rows, -1).to(torch.bfloat16)]),
                       offsets=offsets, response_starts=offsets[:-1], layer_ids=tuple(layer_ids),
                       logsumexp=ShardRows([lse.reshape(rows)]))
