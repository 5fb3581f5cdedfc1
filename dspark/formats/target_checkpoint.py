"""Loading a target checkpoint: a Hugging Face directory of config.json plus (sharded) safetensors.

``load_target`` builds the model on the meta device, shards it there when it is one rank of a
tensor- or expert-parallel group, checks every tensor name and shape against the checkpoint's
headers, and only then reads data: for each parameter this rank keeps, only its slice of the
checkpoint tensor (safetensors maps the file, so a slice costs its own bytes, not the whole
tensor's). Experts that live on other ranks are never read. FP8 (e4m3) weights with block
scales (``weight_scale_inv``) are read slice by slice with only the scale blocks that cover the
slice, then either dequantised into the compute dtype at load (CPUs have no FP8 matmul) or kept
in FP8 and dequantised per matmul (``FP8Linear``: one byte per weight stays resident, which is
what lets a 1T-parameter target fit 8 GPUs); ``target.fp8_weights`` chooses, ``auto`` keeps FP8
on GPUs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from dspark.config import ConfigError, DecoderConfig
from dspark.model.fp8 import FP8Linear, dequantize, scale_blocks
from dspark.model.layers import Linear
from dspark.model.target_model import DTYPES, TargetModel
from dspark.model.tensor_parallel import AllReduce, TensorSlice, checkpoint_source, shard_target

SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class ShardSpec:
    """Which part of the target one process holds."""

    rank: int = 0
    world: int = 1
    expert_parallel: bool = False


class CheckpointReader:
    """Tensor names, shapes and (sliced) data of a safetensors checkpoint directory, counting bytes read.

    Names are normalised without the ``model.`` prefix, as ``TargetModel`` names its parameters.
    """

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        path = Path(path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ConfigError("target.path", f"no *.safetensors files in {path}")
        self._handles = {file.name: safe_open(str(file), "pt") for file in files}
        self._where: dict[str, tuple[str, str]] = {}  # normalised name -> (file name, stored name)
        for file_name, handle in self._handles.items():
            for stored in handle.keys():
                self._where[stored.removeprefix("model.")] = (file_name, stored)
        self.bytes_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> set[str]:
        return set(self._where)

    def _slice(self, name: str):
        file_name, stored = self._where[name]
        return self._handles[file_name].get_slice(stored)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read_raw(self, name: str, dim: int = 0, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Elements [start, end) along ``dim`` (0 or 1) of a stored tensor, in its stored dtype."""
        view = self._slice(name)
        if end is None:
            tensor = view[:]
        elif dim == 0:
            tensor = view[start:end]
        else:
            tensor = view[:, start:end]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read_part(self, name: str, part: TensorSlice | None) -> torch.Tensor:
        """This rank's ``part`` of a stored tensor (all of it when None), in its stored dtype."""
        if part is None:
            return self.read_raw(name)
        start, end = part.bounds(self.shape(name)[part.dim])
        return self.read_raw(name, part.dim, start, end)

    def is_quantised(self, name: str) -> bool:
        return name + SCALE_SUFFIX in self

    def read_fp8(self, name: str, part: TensorSlice | None,
                 block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """This rank's ``part`` of FP8 weight ``name``: (e4m3 weight, the scale blocks covering it, the
        offset of the slice inside its first block); only those bytes are read."""
        weight = self.read_part(name, part)
        if part is None:
            return weight, self.read_raw(name + SCALE_SUFFIX), (0, 0)
        start, end = part.bounds(self.shape(name)[part.dim])
        first, last, into = scale_blocks(start, end, block[part.dim])
        scale = self.read_raw(name + SCALE_SUFFIX, part.dim, first, last)
        return weight, scale, (into, 0) if part.dim == 0 else (0, into)

    def read(self, name: str, part: TensorSlice | None, dtype: torch.dtype,
             block: tuple[int, int] | None) -> torch.Tensor:
        """This rank's ``part`` of tensor ``name`` (all of it when None) in ``dtype``, FP8 dequantised."""
        if block is not None and self.is_quantised(name):
            weight, scale, offset = self.read_fp8(name, part, block)
            return dequantize(weight, scale, block, dtype, offset)
        tensor = self.read_part(name, part)
        if tensor.dtype == torch.float8_e4m3fn:
            raise ConfigError(name, "FP8 tensor without a weight_scale_inv (or no quantization_config)")
        return tensor.to(dtype)


def read_target_config(path: str | Path) -> DecoderConfig:
    return DecoderConfig.from_hf(_read_hf_config(Path(path)))


def _read_hf_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError("target.path", f"{path} has no config.json")
    return json.loads(config_file.read_text())


def _quant_block(hf: dict) -> tuple[int, int] | None:
    quant = hf.get("quantization_config") or {}
    if not quant:
        return None
    if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        raise ConfigError("quantization_config", f"only fp8 e4m3 block quantisation is supported, got {quant}")
    return tuple(quant.get("weight_block_size") or (128, 128))


def _check_against(reader: CheckpointReader, model: TargetModel) -> None:
    """Names and shapes of the whole (unsharded, meta) model against the checkpoint headers: no data read."""
    cfg = model.config
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    stored = {name for name in reader.names()
              if not name.endswith(SCALE_SUFFIX) and "rotary_emb" not in name
              and not (cfg.tie_word_embeddings and name == "lm_head.weight")
              # DeepSeek-style checkpoints carry multi-token-prediction layers past the stack: unused here
              and not (name.startswith("layers.") and int(name.split(".")[1]) >= cfg.num_layers)}
    missing, unexpected = sorted(set(expected) - stored), sorted(stored - set(expected))
    if missing:
        raise ConfigError("checkpoint", f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise ConfigError("checkpoint", f"unexpected tensors {unexpected[:5]}")
    for name, shape in expected.items():
        if reader.shape(name) != shape:
            raise ConfigError(name, f"shape {reader.shape(name)} != expected {shape}")


def load_target(path: str | Path, dtype: str = "float32", shard: ShardSpec = ShardSpec(),
                all_reduce: AllReduce | None = None, reader: CheckpointReader | None = None,
                fp8_weights: Literal["load", "matmul"] = "load", device: torch.device | str = "cpu") -> TargetModel:
    """The target (or this rank's shard of it, reading only its slices) from a checkpoint directory.

    ``all_reduce`` sums partial outputs over the shard group; it may bind late (the group forms
    after loading). Pass a ``reader`` to see how many bytes were read. FP8 weights are dequantised
    at load (``"load"``) or kept in FP8 and dequantised per matmul (``"matmul"``, ``FP8Linear``).
    Each tensor goes to ``device`` as it is read: host memory never holds the whole shard.
    """
    path = Path(path)
    hf = _read_hf_config(path)
    cfg = DecoderConfig.from_hf(hf)
    block = _quant_block(hf)
    reader = reader or CheckpointReader(path)
    with torch.device("meta"):
        model = TargetModel(cfg)
    _check_against(reader, model)
    if shard.world > 1:
        if all_reduce is None:
            raise ValueError("a sharded target needs an all_reduce")
        shard_target(model, shard.rank, shard.world, all_reduce, shard.expert_parallel)
    torch_dtype = DTYPES[dtype]
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        source, part = checkpoint_source(model, name)
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if fp8_weights == "matmul" and block is not None and leaf == "weight" and isinstance(owner, nn.Linear) \
                and reader.is_quantised(source):
            weight, scale, offset = reader.read_fp8(source, part, block)
            parent_name, _, child = owner_name.rpartition(".")
            setattr(model.get_submodule(parent_name), child,
                    FP8Linear(weight.to(device), scale.to(device), block, offset, owner.bias))
            continue
        state[name] = reader.read(source, part, torch_dtype if tensor.is_floating_point() else tensor.dtype,
                                  block).to(device)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ConfigError("checkpoint", f"tensors not loaded: {left[:5]}")
    for param in model.parameters():
        param.requires_grad_(False)
    return model.to(device=device, dtype=torch_dtype).eval()


def load_target_head(path: str | Path, dtype: str = "float32") -> tuple[DecoderConfig, nn.Embedding, nn.Linear]:
    """Only the target's embedding and LM head (what a drafter process needs)."""
    path = Path(path)
    cfg = read_target_config(path)
    reader = CheckpointReader(path)
    head_name = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    for name in ("embed_tokens.weight", head_name):
        if name not in reader:
            raise ConfigError("checkpoint", f"{path} has no {name}")
    torch_dtype = DTYPES[dtype]
    embed_weight = reader.read("embed_tokens.weight", None, torch_dtype, None)
    head_weight = embed_weight if cfg.tie_word_embeddings else reader.read(head_name, None, torch_dtype, None)
    embed = nn.Embedding.from_pretrained(embed_weight, freeze=True)
    lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=torch_dtype)
    lm_head.weight = nn.Parameter(head_weight, requires_grad=False)
    return cfg, embed, lm_head
