"""The target model: compact Llama / Mistral / Qwen2 / Qwen3 decoder over a paged KV cache.

One ``forward`` serves prefill and verification: a padded batch of new tokens of several
sequences in, logits at the requested positions and the fused-layer hidden states out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from dspark.config import ConfigError, DecoderConfig
from dspark.fp8 import dequantize_state
from dspark.kv_cache import AttentionMetadata, PagedKVCache
from dspark.layers import DecoderLayer, RMSNorm

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
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
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
        features = []
        wanted = {layer: i for i, layer in enumerate(feature_layers)}
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.project_q(h, positions)
            cache.write(index, meta.write_slots, *attn.cache_kv(h, positions))
            keys, values = attn.expand_cached(*cache.gather(index, meta.read_slots))
            x = x + attn.attend(q, keys, values, meta.mask)
            x = layer.feed_forward(x)
            if index in wanted:
                features.append(x)
        if logits_at is not None:
            x = torch.gather(x, 1, logits_at[:, :, None].expand(-1, -1, x.shape[-1]))
        logits = self.lm_head(self.norm(x)).float()
        fused = torch.cat([features[wanted[i]] for i in feature_layers], dim=-1) if feature_layers else None
        return TargetOutput(logits=logits, features=fused)


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint directory."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError("model_path", f"no *.safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def read_target_config(path: str | Path) -> DecoderConfig:
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError("model_path", f"{path} has no config.json")
    return DecoderConfig.from_hf(json.loads(config_file.read_text()))


def load_target_head(path: str | Path, dtype: str = "float32") -> tuple[DecoderConfig, nn.Embedding, nn.Linear]:
    """Only the target's embedding and LM head (what a drafter process needs), read tensor by tensor."""
    from safetensors import safe_open

    path = Path(path)
    cfg = read_target_config(path)
    wanted = {"model.embed_tokens.weight": None, "lm_head.weight": None}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in wanted.keys() & set(handle.keys()):
                wanted[name] = handle.get_tensor(name)
    embed_weight = wanted["model.embed_tokens.weight"]
    if embed_weight is None:
        raise ConfigError("checkpoint", f"{path} has no model.embed_tokens.weight")
    head_weight = embed_weight if cfg.tie_word_embeddings else wanted["lm_head.weight"]
    if head_weight is None:
        raise ConfigError("checkpoint", f"{path} has no lm_head.weight")
    embed = nn.Embedding.from_pretrained(embed_weight.to(DTYPES[dtype]), freeze=True)
    lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=DTYPES[dtype])
    lm_head.weight = nn.Parameter(head_weight.to(DTYPES[dtype]), requires_grad=False)
    return cfg, embed, lm_head


def load_target(path: str | Path, dtype: str = "float32") -> TargetModel:
    """Load a Hugging Face checkpoint directory (config.json + safetensors) as a TargetModel."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError("model_path", f"{path} has no config.json")
    hf = json.loads(config_file.read_text())
    cfg = DecoderConfig.from_hf(hf)
    model = TargetModel(cfg)
    state = {k.removeprefix("model."): v for k, v in read_state_dict(path).items()}
    quant = hf.get("quantization_config") or {}
    if quant:
        if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
            raise ConfigError("quantization_config", f"only fp8 e4m3 block quantisation is supported, got {quant}")
        block = tuple(quant.get("weight_block_size") or (128, 128))
        try:
            state = dequantize_state(state, block, DTYPES[dtype])  # CPU has no FP8 matmul: dequantise at load
        except ValueError as exc:
            raise ConfigError("checkpoint", str(exc)) from None
    # DeepSeek-style checkpoints carry multi-token-prediction layers past the decoder stack: not used here
    state = {k: v for k, v in state.items()
             if not (k.startswith("layers.") and int(k.split(".")[1]) >= cfg.num_layers)}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(k for k in set(state) - set(expected) if "rotary_emb" not in k)
    if missing:
        raise ConfigError("checkpoint", f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise ConfigError("checkpoint", f"unexpected tensors {unexpected[:5]}")
    for name, tensor in expected.items():
        if state[name].shape != tensor.shape:
            raise ConfigError(name, f"shape {tuple(state[name].shape)} != expected {tuple(tensor.shape)}")
    model.load_state_dict(state, strict=False)
    return model.to(DTYPES[dtype]).eval()
