"""FP8 (e4m3) weights with block scales, the layout DeepSeek-V3 and Kimi checkpoints publish.

A quantised linear weight ``W`` [out, in] is stored as ``W_q`` (float8_e4m3fn) plus
``weight_scale_inv`` [ceil(out / bo), ceil(in / bi)] (float32), one scale per ``bo x bi`` block:
``W = W_q * scale_inv`` blockwise. Two ways to run it (``target.fp8_weights``): dequantise once
at load into the compute dtype (CPUs have no FP8 matmul, and there it is the fast way), or keep
the weight in FP8 and dequantise per matmul (``FP8Linear``: half the resident memory of bf16, the
default on GPUs, where a 1T-parameter target only fits at one byte per weight). Kernels that
multiply FP8 directly are the vLLM path's business.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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


class FP8Linear(nn.Module):
    """A linear layer whose weight stays FP8 e4m3 in memory, dequantised blockwise for each matmul.

    This keeps an FP8 checkpoint at one byte per weight on the accelerator (what the B300 sizing
    assumes); the transient full-precision copy lives for one matmul. ``offset`` is where this
    (tensor-parallel) slice starts inside its first scale block. Moving the module changes its
    device only: a ``.to(dtype)`` leaves the FP8 weight and its float32 scales as they are.
    """

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                 offset: tuple[int, int] = (0, 0), bias: nn.Parameter | None = None):
        super().__init__()
        self.register_buffer("weight", weight)  # [out, in] float8_e4m3fn
        self.register_buffer("weight_scale_inv", scale_inv)  # [blocks covering out, blocks covering in] float32
        self.block, self.offset = tuple(block), tuple(offset)
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        weight = dequantize(self.weight, self.weight_scale_inv, self.block, x.dtype, self.offset)
        return F.linear(x, weight, self.bias)

    def _apply(self, fn, recurse: bool = True):
        stored = {"weight": self.weight, "weight_scale_inv": self.weight_scale_inv}
        super()._apply(fn, recurse)
        for name, original in stored.items():
            moved = getattr(self, name)
            if moved.dtype != original.dtype:  # a dtype conversion: keep the stored format, take the device
                setattr(self, name, original.to(moved.device))
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks={self.block}"
