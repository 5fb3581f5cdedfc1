"""Megatron-style tensor parallelism for the target, applied in this one place.

``shard_target`` turns a whole ``TargetModel`` into rank ``r`` of ``world``: query/key/value
and gate/up projections keep their rank's heads or columns (column parallel), the output and
down projections keep the matching input rows and are followed by an all-reduce (row
parallel). The model code itself never knows it is sharded: the swapped modules have the
same call signature. Embedding, norms and LM head stay replicated, so every rank ends a
forward with the full hidden states and logits, and rank 0 can verify and send features.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from dspark.config import ConfigError
from dspark.layers import GQAAttention
from dspark.target_model import TargetModel

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the ranks, returns it


class RowParallelLinear(nn.Module):
    """A linear layer holding a slice of the input features; partial outputs are summed over ranks."""

    def __init__(self, local: nn.Linear, all_reduce: AllReduce):
        super().__init__()
        self.local, self.all_reduce = local, all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.local(x))


def _slice_linear(linear: nn.Linear, dim: int, index: int, parts: int) -> nn.Linear:
    """The ``index``-th of ``parts`` equal slices of a linear layer along output (0) or input (1) features."""
    weight = linear.weight.detach().chunk(parts, dim=dim)[index].clone()
    bias = linear.bias
    if bias is not None and dim == 0:
        bias = bias.detach().chunk(parts)[index].clone()
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None and dim == 0,
                    dtype=weight.dtype, device=weight.device)
    out.weight = nn.Parameter(weight, requires_grad=False)
    if out.bias is not None:
        out.bias = nn.Parameter(bias, requires_grad=False)
    return out


def check_divisible(num_heads: int, num_kv_heads: int, intermediate: int, world: int) -> None:
    for field, value in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads),
                         ("intermediate_size", intermediate)):
        if value % world:
            raise ConfigError("tp_size", f"{world} does not divide the target's {field} ({value})")


def shard_target(model: TargetModel, rank: int, world: int, all_reduce: AllReduce) -> TargetModel:
    """Shard ``model`` in place for ``rank`` of ``world`` tensor-parallel ranks; returns it."""
    cfg = model.config
    if world == 1:
        return model
    if cfg.attention != "gqa":
        raise ConfigError("tp_size", "tensor parallelism of MLA targets is not supported yet; use tp_size 1")
    check_divisible(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, world)
    for layer in model.layers:
        attn: GQAAttention = layer.self_attn
        attn.q_proj = _slice_linear(attn.q_proj, 0, rank, world)
        attn.k_proj = _slice_linear(attn.k_proj, 0, rank, world)
        attn.v_proj = _slice_linear(attn.v_proj, 0, rank, world)
        attn.o_proj = RowParallelLinear(_slice_linear(attn.o_proj, 1, rank, world), all_reduce)
        attn.num_heads //= world
        attn.num_kv_heads //= world
        mlp = layer.mlp
        mlp.gate_proj = _slice_linear(mlp.gate_proj, 0, rank, world)
        mlp.up_proj = _slice_linear(mlp.up_proj, 0, rank, world)
        mlp.down_proj = RowParallelLinear(_slice_linear(mlp.down_proj, 1, rank, world), all_reduce)
    model.config = dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                                       intermediate_size=cfg.intermediate_size // world)
    return model
