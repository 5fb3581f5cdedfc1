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
    batch, q_len, heads, dqk = q.shape
    keys_len, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = heads // kv_heads
    if group * q_len == 1:  # one row per matmul would take the GEMV kernel, which rounds differently
        return chunked_attend(q.expand(-1, 2, -1, -1), k, v, mask.expand(-1, 2, -1), scale)[:, :1]
    chunks = -(-keys_len // CHUNK)
    # keys and values in chunk layout, zero past the end: [B, Hkv, n, C, D]
    k_chunks = k.new_zeros(batch, kv_heads, chunks * CHUNK, dqk)
    k_chunks[:, :, :keys_len] = k.transpose(1, 2)
    v_chunks = v.new_zeros(batch, kv_heads, chunks * CHUNK, dv)
    v_chunks[:, :, :keys_len] = v.transpose(1, 2)
    k_chunks, v_chunks = k_chunks.unflatten(2, (chunks, CHUNK)), v_chunks.unflatten(2, (chunks, CHUNK))
    # the queries of one kv head's group are the rows of its matmuls: [B, Hkv, 1, group * Q, D]
    rows = q.unflatten(2, (kv_heads, group)).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, 1, group * q_len, dqk)
    scores = torch.matmul(rows, k_chunks.transpose(-1, -2)).float()  # [B, Hkv, n, group * Q, C]
    bias = torch.full((batch, q_len, chunks * CHUNK), float("-inf"), device=q.device)
    bias[:, :, :keys_len].masked_fill_(mask, 0.0)
    bias = bias.unflatten(2, (chunks, CHUNK)).transpose(1, 2)[:, None, :, None]  # [B, 1, n, 1, Q, C]
    scores = scores.unflatten(3, (group, q_len)) * scale + bias  # [B, Hkv, n, group, Q, C]
    top = scores.amax(dim=(2, 5), keepdim=True).clamp_min(-1e30)  # rows that see nothing: weights 0
    weights = torch.exp(scores - top)
    total = weights.sum(-1).cumsum(2)[:, :, -1]  # [B, Hkv, group, Q], chunks summed in order
    partial = torch.matmul(weights.flatten(3, 4).to(v.dtype), v_chunks)  # [B, Hkv, n, group * Q, Dv]
    out = partial.float().cumsum(2)[:, :, -1].unflatten(2, (group, q_len))  # [B, Hkv, group, Q, Dv]
    out = out / total[..., None].clamp_min(1e-30)
    return out.permute(0, 3, 1, 2, 4).reshape(batch, q_len, heads * dv).to(q.dtype)
