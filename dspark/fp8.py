"""FP8 (e4m3) weights with block scales, the layout DeepSeek-V3 and Kimi checkpoints publish.

A quantised linear weight ``W`` [out, in] is stored as ``W_q`` (float8_e4m3fn) plus
``weight_scale_inv`` [ceil(out / bo), ceil(in / bi)] (float32), one scale per ``bo x bi`` block:
``W = W_q * scale_inv`` blockwise. CPUs have no FP8 matmul, so this project dequantises at load
time into the compute dtype (bf16 / fp32); GPU kernels that multiply FP8 directly are the
vLLM path's business.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _expand(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int],
            offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    # scale: [rows, cols] of blocks -> [out, in], starting ``offset`` elements into the first block
    rows = scale.repeat_interleave(block[0], 0)[offset[0]: offset[0] + shape[0]]
    return rows.repeat_interleave(block[1], 1)[:, offset[1]: offset[1] + shape[1]]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.float32, offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``weight`` [out, in] float8_e4m3fn, ``scale_inv`` [ceil(out/bo), ceil(in/bi)] -> [out, in] in ``dtype``.

    For a slice of a larger weight, ``scale_inv`` holds the blocks covering the slice and ``offset`` is
    where the slice starts inside the first of them (a slice need not be block-aligned).
    """
    if weight.dim() != 2:
        raise ValueError(f"block-quantised weights are 2-D, got shape {tuple(weight.shape)}")
    return (weight.float() * _expand(scale_inv.float(), weight.shape, block, offset)).to(dtype)


def scale_blocks(start: int, end: int, block: int) -> tuple[int, int, int]:
    """Scale rows (or columns) [first, last) covering elements [start, end), and the offset into the first."""
    return start // block, -(-end // block), start % block


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for tests and tools: [out, in] -> (float8_e4m3fn weight, float32 scale_inv)."""
    out_dim, in_dim = weight.shape
    rows, cols = -(-out_dim // block[0]), -(-in_dim // block[1])
    padded = weight.float().new_zeros(rows * block[0], cols * block[1])
    padded[:out_dim, :in_dim] = weight.float()
    blocks = padded.view(rows, block[0], cols, block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX  # [rows, cols]
    q = (weight.float() / _expand(scale, weight.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale
