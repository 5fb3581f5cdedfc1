"""Megatron-style tensor parallelism (and expert parallelism) for the target, applied in this one place.

``shard_target`` turns a whole ``TargetModel`` into rank ``r`` of ``world``: query/key/value
and gate/up projections keep their rank's heads or columns (column parallel), the output and
down projections keep the matching input rows and are followed by an all-reduce (row
parallel). MLA keeps its low-rank ``q_a``/``kv_a`` projections (and so the latent KV cache)
whole on every rank and splits the per-head ``q_b``/``kv_b``/``o`` projections. A mixture of
experts is split either by slicing every expert like an MLP (tensor parallel) or, with
``expert_parallel``, by giving each rank whole experts (expert ``e`` lives on rank
``e % world``); either way each rank adds its partial output and one all-reduce combines
them (tokens are already on every rank, so dispatch needs no all-to-all). The model code
never knows it is sharded: swapped modules keep their call signatures. Embedding, norms,
router and LM head stay replicated, so every rank ends a forward with the full hidden states
and logits, and rank 0 can verify and send features.

Sharding works on a model built on the meta device too: every sliced linear records its
``TensorSlice`` and ``checkpoint_source`` maps a sharded parameter back to its checkpoint
tensor, so ``dspark.formats.target_checkpoint`` reads only this rank's slice of each tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dspark.config import ConfigError
from dspark.model.layers import MLP, GQAAttention, Linear, MLAAttention, MoE
from dspark.model.target_model import TargetModel

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the ranks, returns it


@dataclass(frozen=True)
class TensorSlice:
    """The ``index``-th of ``parts`` equal slices of a weight along ``dim`` (0: output, 1: input features)."""

    dim: int
    index: int
    parts: int

    def bounds(self, size: int) -> tuple[int, int]:
        """[start, end) along ``dim`` of a tensor ``size`` long there (``check_divisible`` ran before)."""
        step = size // self.parts
        return self.index * step, (self.index + 1) * step


class RowParallelLinear(nn.Module):
    """A linear layer holding a slice of the input features; partial outputs are summed over ranks."""

    def __init__(self, local: nn.Linear, all_reduce: AllReduce):
        super().__init__()
        self.local, self.all_reduce = local, all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.local(x))


def _slice_linear(linear: nn.Linear, dim: int, index: int, parts: int) -> nn.Linear:
    """The ``index``-th of ``parts`` equal slices of a linear layer along output (0) or input (1) features.

    On the meta device this only fixes shapes; the returned layer remembers its ``tp_slice``.
    """
    part = TensorSlice(dim, index, parts)
    start, end = part.bounds(linear.weight.shape[dim])
    weight = linear.weight.detach().narrow(dim, start, end - start).clone()
    bias = linear.bias
    if bias is not None and dim == 0:
        bias = bias.detach()[start:end].clone()
    out = Linear(weight.shape[1], weight.shape[0], bias=bias is not None and dim == 0,
                 dtype=weight.dtype, device=weight.device)
    out.weight = nn.Parameter(weight, requires_grad=False)
    if out.bias is not None:
        out.bias = nn.Parameter(bias, requires_grad=False)
    out.tp_slice = part
    return out


def checkpoint_source(model: nn.Module, name: str) -> tuple[str, TensorSlice | None]:
    """The checkpoint tensor behind parameter (or buffer) ``name`` of a sharded model, and this rank's slice.

    The parallel wrappers add one level (``o_proj.local``, ``mlp.moe``) that checkpoints do not have.
    """
    *path, leaf = name.split(".")
    kept, module = [], model
    for part in path:
        if not isinstance(module, (RowParallelLinear, ParallelMoE)):
            kept.append(part)
        module = getattr(module, part)
    part_slice = getattr(module, "tp_slice", None)
    if leaf == "bias" and part_slice is not None and part_slice.dim != 0:
        part_slice = None
    return ".".join([*kept, leaf]), part_slice


def check_divisible(cfg, world: int, expert_parallel: bool = False) -> None:
    """Every split dimension of ``cfg`` (a DecoderConfig) divides by ``world``; errors name the field."""
    sizes = [("num_attention_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size)]
    if cfg.attention == "gqa":
        sizes.append(("num_key_value_heads", cfg.num_kv_heads))
    if cfg.n_routed_experts:
        sizes.append(("n_routed_experts", cfg.n_routed_experts) if expert_parallel
                     else ("moe_intermediate_size", cfg.moe_intermediate_size))
        if cfg.n_shared_experts:
            sizes.append(("moe_intermediate_size x n_shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts))
    for field, value in sizes:
        if value % world:
            raise ConfigError("tp_size", f"{world} does not divide the target's {field} ({value})")


def _shard_mlp(mlp: MLP, rank: int, world: int) -> None:
    """Column-slice gate/up and row-slice down, without the reduce (the caller reduces once)."""
    mlp.gate_proj = _slice_linear(mlp.gate_proj, 0, rank, world)
    mlp.up_proj = _slice_linear(mlp.up_proj, 0, rank, world)
    mlp.down_proj = _slice_linear(mlp.down_proj, 1, rank, world)


class ParallelMoE(nn.Module):
    """A mixture of experts whose rank-local partial output is summed over the ranks."""

    def __init__(self, moe: MoE, rank: int, world: int, expert_parallel: bool, all_reduce: AllReduce):
        super().__init__()
        if expert_parallel:
            moe.local_experts = {e for e in range(len(moe.experts)) if e % world == rank}
            for e in set(range(len(moe.experts))) - moe.local_experts:
                moe.experts[e] = nn.Identity()  # weights of other ranks' experts are dropped
        else:
            for expert in moe.experts:
                _shard_mlp(expert, rank, world)
        if moe.shared_experts is not None:
            _shard_mlp(moe.shared_experts, rank, world)
        self.moe, self.all_reduce = moe, all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.moe(x))


def _shard_attention(attn: nn.Module, rank: int, world: int, all_reduce: AllReduce) -> None:
    if isinstance(attn, GQAAttention):
        attn.q_proj = _slice_linear(attn.q_proj, 0, rank, world)
        attn.k_proj = _slice_linear(attn.k_proj, 0, rank, world)
        attn.v_proj = _slice_linear(attn.v_proj, 0, rank, world)
        attn.num_kv_heads //= world
    elif isinstance(attn, MLAAttention):  # the latent path stays whole; per-head projections split by head
        if hasattr(attn, "q_b_proj"):
            attn.q_b_proj = _slice_linear(attn.q_b_proj, 0, rank, world)
        else:
            attn.q_proj = _slice_linear(attn.q_proj, 0, rank, world)
        attn.kv_b_proj = _slice_linear(attn.kv_b_proj, 0, rank, world)
    if attn.o_proj.bias is not None:  # the bias is added once, after the reduce
        raise ConfigError("tp_size", "row-parallel output projections with a bias are not supported")
    attn.o_proj = RowParallelLinear(_slice_linear(attn.o_proj, 1, rank, world), all_reduce)
    attn.num_heads //= world


def shard_target(model: TargetModel, rank: int, world: int, all_reduce: AllReduce,
                 expert_parallel: bool = False) -> TargetModel:
    """Shard ``model`` in place for ``rank`` of ``world`` ranks; returns it."""
    cfg = model.config
    if world == 1:
        return model
    check_divisible(cfg, world, expert_parallel)
    for layer in model.layers:
        _shard_attention(layer.self_attn, rank, world, all_reduce)
        if isinstance(layer.mlp, MoE):
            layer.mlp = ParallelMoE(layer.mlp, rank, world, expert_parallel, all_reduce)
        else:
            _shard_mlp(layer.mlp, rank, world)
            layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, all_reduce)
    model.config = dataclasses.replace(
        cfg, num_heads=cfg.num_heads // world,
        num_kv_heads=cfg.num_kv_heads // world if cfg.attention == "gqa" else cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size // world)
    return model
