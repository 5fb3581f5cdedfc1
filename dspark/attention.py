"""Scaled dot-product attention over cached keys, and its batch-invariant form.

Speculative decoding is lossless only if the target gives a position the same logits whether it
is decoded alone (plain decoding: 1 query, L keys) or verified inside a block (1 + k queries,
L + k keys, the extra keys masked). ``F.scaled_dot_product_attention`` on the CPU does not: its
flash kernel tiles the keys by the key length, so the same row rounds differently once the key
length changes (measured: bf16 rows differ in 3 of 5 context lengths).

``chunked_attend`` is built so that a row depends only on its own query and the keys it may see:
- keys are cut into fixed chunks of ``CHUNK`` in absolute order; masked keys get weight exactly 0,
  so a chunk that holds only masked keys adds an exact 0;
- scores and weighted values are bf16 matmuls whose reduction length is fixed (head dim, chunk),
  with fp32 accumulation (oneDNN's bf16 GEMM gives row results that do not depend on the number of
  rows or columns, which CPU fp32 GEMMs do not);
- the softmax max is exact, and the sums over chunks run sequentially (``cumsum``), so trailing
  zero chunks change nothing.
It is used for bf16/fp16 on the CPU, where it makes speculative greedy output equal plain greedy
output bit for bit; fp32 and GPUs keep the fused kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def attend(
    q: torch.Tensor,  # [B, Q, H, Dqk]
    k: torch.Tensor,  # [B, L, Hkv, Dqk]
    v: torch.Tensor,  # [B, L, Hkv, Dv]
    mask: torch.Tensor,  # [B, Q, L] bool, True = may attend
    scale: float,
) -> torch.Tensor:  # [B, Q, H * Dv]
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        return chunked_attend(q, k, v, mask, scale)
    batch, q_len, heads, _ = q.shape
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None, :, :],
        scale=scale,
        enable_gqa=heads != k.shape[2],
    )
    return out.transpose(1, 2).reshape(batch, q_len, -1)


def chunked_attend(
    q: torch.Tensor,  # [B, Q, H, Dqk]
    k: torch.Tensor,  # [B, L, Hkv, Dqk]
    v: torch.Tensor,  # [B, L, Hkv, Dv]
    mask: torch.Tensor,  # [B, Q, L] bool
    scale: float,
) -> torch.Tensor:  # [B, Q, H * Dv]
    """Batch-invariant attention: each row's result depends only on its query and visible keys."""
    batch, q_len, heads, _ = q.shape
    keys_len, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = heads // kv_heads
    pad = -keys_len % CHUNK
    chunks = (keys_len + pad) // CHUNK
    if pad:
        k, v = F.pad(k, (0, 0, 0, 0, 0, pad)), F.pad(v, (0, 0, 0, 0, 0, pad))
        mask = F.pad(mask, (0, pad))
    # queries of one kv head's group become rows: [B, Hkv, group * Q, D]
    rows = q.unflatten(2, (kv_heads, group)).permute(0, 2, 3, 1, 4).flatten(2, 3)
    single = rows.shape[2] == 1  # one row would take the GEMV kernel, which rounds differently
    if single:
        rows, mask = rows.repeat(1, 1, 2, 1), mask.repeat(1, 2, 1)
    scores = torch.matmul(rows, k.permute(0, 2, 3, 1)).float() * scale  # [B, Hkv, group * Q, Lp]
    visible = mask[:, None, None].expand(-1, kv_heads, group, -1, -1).flatten(2, 3)[:, :, :rows.shape[2]]
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows that see nothing
    weights = torch.exp(scores - top).unflatten(-1, (chunks, CHUNK))  # [B, Hkv, GQ, n, C]
    total = weights.sum(-1).cumsum(-1)[..., -1:]  # [B, Hkv, GQ, 1]
    values = v.permute(0, 2, 1, 3).unflatten(2, (chunks, CHUNK))  # [B, Hkv, n, C, Dv]
    partial = torch.matmul(weights.transpose(2, 3).to(v.dtype), values)  # [B, Hkv, n, GQ, Dv]
    out = partial.float().cumsum(2)[:, :, -1] / total.clamp_min(1e-30)  # [B, Hkv, GQ, Dv]
    if single:
        out = out[:, :, :1]
    out = out.unflatten(2, (group, q_len)).permute(0, 3, 1, 2, 4)  # [B, Q, Hkv, group, Dv]
    return out.reshape(batch, q_len, heads * dv).to(q.dtype)
