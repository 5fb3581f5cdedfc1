"""DSpark draft checkpoints in the speculators layout (``speculators_model_type: "dspark"``).

``config.json`` carries the backbone as a full Hugging Face decoder config in
``transformer_layer_config`` plus the DSpark fields; ``model.safetensors`` carries ``fc``,
``hidden_norm``, ``layers.*``, ``norm``, ``markov_head.*`` and ``confidence_head.*`` only:
the embedding and LM head belong to the target and are never stored here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dspark.config import ConfigError, DecoderConfig, DraftConfig
from dspark.draft_model import DSparkDraft

SPECULATORS_VERSION = "0.9.0"
SHARED_TENSORS = ("embed_tokens.weight", "lm_head.weight")


def draft_config_to_json(cfg: DraftConfig) -> dict[str, Any]:
    layer_cfg = cfg.backbone.to_hf()
    layer_cfg["architectures"] = ["DSparkDraftModel"]
    return {
        "architectures": ["DSparkSpeculator"],
        "speculators_model_type": "dspark",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": cfg.backbone.vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "transformer_layer_config": layer_cfg,
        "speculators_config": {
            "algorithm": "dspark",
            "default_proposal_method": "dspark",
            "proposal_methods": [
                {
                    "proposal_type": "dspark",
                    "speculative_tokens": cfg.block_size,
                    "draft_sample_method": "probabilistic",
                    "rejection_sample_method": "block",
                }
            ],
            "verifier": {
                "name_or_path": cfg.verifier_name_or_path,
                "architectures": list(cfg.verifier_architectures),
            },
        },
        "block_size": cfg.block_size,
        "aux_hidden_state_layer_ids": list(cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "markov_rank": cfg.markov_rank if cfg.enable_markov_head else 0,
        "markov_head_type": "markov" if cfg.enable_markov_head else "none",
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.enable_markov_head,
        "confidence_temperatures": list(cfg.confidence_temperatures) or None,
        "sample_from_anchor": False,
    }


def _require(data: dict[str, Any], key: str, where: str = "") -> Any:
    if key not in data:
        raise ConfigError(f"{where}{key}", "missing from the draft config.json")
    return data[key]


def draft_config_from_json(data: dict[str, Any]) -> DraftConfig:
    model_type = data.get("speculators_model_type")
    if model_type != "dspark":
        raise ConfigError("speculators_model_type", f"expected 'dspark', got {model_type!r}")
    layer_cfg = dict(_require(data, "transformer_layer_config"))
    backbone = DecoderConfig.from_hf(layer_cfg)
    verifier = data.get("speculators_config", {}).get("verifier", {})
    markov_type = data.get("markov_head_type", "markov")
    if markov_type not in ("markov", "none"):
        raise ConfigError("markov_head_type", f"only 'markov' or 'none' are supported, got {markov_type!r}")
    temps = data.get("confidence_temperatures") or ()
    return DraftConfig(
        backbone=backbone,
        target_hidden_size=int(_require(data, "target_hidden_size")),
        target_layer_ids=tuple(int(i) for i in _require(data, "aux_hidden_state_layer_ids")),
        block_size=int(_require(data, "block_size")),
        mask_token_id=int(_require(data, "mask_token_id")),
        markov_rank=int(data.get("markov_rank", 256)) if markov_type == "markov" else 1,
        enable_markov_head=markov_type == "markov",
        enable_confidence_head=bool(data.get("enable_confidence_head", True)),
        confidence_temperatures=tuple(float(t) for t in temps),
        verifier_name_or_path=verifier.get("name_or_path", ""),
        verifier_architectures=tuple(verifier.get("architectures", ())),
    )


def save_draft(model: DSparkDraft, path: str | Path, dtype: torch.dtype | None = None) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(draft_config_to_json(model.config), indent=2) + "\n")
    state = {k: v.detach().to(dtype or v.dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def load_draft(
    path: str | Path,
    target_config: DecoderConfig | None = None,
    dtype: torch.dtype = torch.float32,
) -> DSparkDraft:
    """Load and validate a draft; with ``target_config``, also check it fits that target."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError("draft_path", f"{path} has no config.json")
    cfg = draft_config_from_json(json.loads(config_file.read_text()))
    if target_config is not None:
        check_compatible(cfg, target_config)
    model = DSparkDraft(cfg)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise ConfigError("draft_path", f"{path} has no model.safetensors")
    state = {k: v for k, v in load_file(str(weights)).items() if k not in SHARED_TENSORS}
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ConfigError(missing[0], f"tensor missing from the draft checkpoint ({len(missing)} missing)")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ConfigError(unexpected[0], "unexpected tensor in the draft checkpoint")
    for name, tensor in expected.items():
        if state[name].shape != tensor.shape:
            raise ConfigError(name, f"shape {tuple(state[name].shape)} does not match the config's "
                                    f"{tuple(tensor.shape)}")
    model.load_state_dict(state)
    return model.to(dtype).eval()


def check_compatible(cfg: DraftConfig, target: DecoderConfig) -> None:
    if cfg.backbone.vocab_size != target.vocab_size:
        raise ConfigError("draft_vocab_size", f"draft vocabulary {cfg.backbone.vocab_size} != target's "
                                              f"{target.vocab_size}")
    if cfg.target_hidden_size != target.hidden_size:
        raise ConfigError("target_hidden_size", f"{cfg.target_hidden_size} != target hidden size "
                                                f"{target.hidden_size}")
    if cfg.backbone.hidden_size != target.hidden_size:
        raise ConfigError("transformer_layer_config.hidden_size",
                          f"{cfg.backbone.hidden_size} must equal the target's {target.hidden_size} "
                          "(embedding and LM head are shared)")
    bad = [i for i in cfg.target_layer_ids if i >= target.num_layers]
    if bad:
        raise ConfigError("aux_hidden_state_layer_ids", f"{bad} beyond the target's {target.num_layers} layers")
