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
from dspark.model.draft_model import DSparkDraft

SPECULATORS_VERSION = "0.9.0"
SHARED_TENSORS = ("embed_tokens.weight", "lm_head.weight")  # the target's, unless the checkpoint ships its own
IGNORED_TENSORS = ("mask_embedding",)  # vLLM 0.32 qwen3_dspark.py: "an unused placeholder param; DSpark masks via
# the vocab row" -- the mask slots are embedded as embed_tokens[mask_token_id] there and here
MARKOV_TYPES = ("vanilla", "gated", "rnn")  # speculators' (and SGLang's); vLLM 0.32 runs vanilla only
LEGACY_MARKOV_TYPES = {"markov": "vanilla", "none": "vanilla"}  # written by this project before it matched
# speculators (see draft_config_from_json); "none" went with markov_rank 0, speculators' way of saying "no head"


# Layer ids, converted here and nowhere else. speculators and vLLM name the residual stream *entering* target layer i
# (vLLM 0.32 transformers_utils/configs/speculators/algos.py, update_dspark: "target_layer_ids = [i - 1 for i in
# aux_hidden_state_layer_ids]"; LlamaForCausalLM's aux capture appends the state before layer i runs). This library's
# ``target_layer_ids`` are the *outputs* of layer i (TargetModel.forward), i.e. vLLM's target_layer_ids.
def aux_ids_from_target_layers(layer_ids: tuple[int, ...]) -> list[int]:
    return [i + 1 for i in layer_ids]


def target_layers_from_aux_ids(aux_ids: list[int]) -> tuple[int, ...]:
    if any(int(i) < 1 for i in aux_ids):
        raise ConfigError("aux_hidden_state_layer_ids", f"{list(aux_ids)}: id 0 is the embedding output (the state "
                                                        "entering layer 0), which is not a supported feature")
    return tuple(int(i) - 1 for i in aux_ids)


# vLLM's native MLA layout for the Kimi-K3 drafts (vllm/transformers_utils/configs/k3_dspark.py, K3DSparkConfig, and
# vllm/models/kimi_k3/nvidia/dspark_mla.py): a flat DeepseekV3Config with model_type "k3_dspark", target_layer_ids in
# vLLM's (= our) output-of-layer meaning, anchor-as-first blocks only, a shared (full) vocabulary, vanilla Markov head.
K3_DSPARK = "k3_dspark"
K3_TENSOR_NAMES = {"context_proj.": "fc.", "context_norm.": "hidden_norm.", "final_norm.": "norm."}  # theirs: ours


def draft_layout(cfg: DraftConfig) -> str:
    """Where vLLM runs a draft of this shape: MLA backbones through ``k3_dspark``, the rest as speculators."""
    return K3_DSPARK if cfg.backbone.attention == "mla" else "speculators"


def k3_dspark_config_to_json(cfg: DraftConfig) -> dict[str, Any]:
    if cfg.backbone.attention != "mla" or not cfg.backbone.q_lora_rank:
        raise ConfigError("transformer_layer_config", "k3_dspark is an MLA layout with a q LoRA rank")
    if not cfg.sample_from_anchor or cfg.reduced_vocab or cfg.markov_head_type != "vanilla" or \
            not cfg.enable_markov_head:
        raise ConfigError("k3_dspark", "holds anchor-as-first blocks, the full vocabulary and a vanilla Markov head")
    out = {k: v for k, v in cfg.backbone.to_hf().items() if k not in ("rope_theta", "rope_scaling", "model_type",
                                                                        "rope_interleave")}
    rope = cfg.backbone.rope.to_hf() or {"rope_type": "default"}
    return {
        "architectures": ["K3DSparkModel"],
        "model_type": K3_DSPARK,
        **out,
        "rope_parameters": {**rope, "rope_theta": cfg.backbone.rope.theta},
        "target_layer_ids": list(cfg.target_layer_ids),
        "num_target_layers": cfg.num_feature_layers,
        "target_hidden_size": cfg.target_hidden_size,
        "block_size": cfg.block_size,
        "sample_from_anchor": True,
        "mask_token_id": cfg.mask_token_id,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_reads_markov,
        "confidence_temperatures": list(cfg.confidence_temperatures) or None,
        "verifier_name_or_path": cfg.verifier_name_or_path,  # not read by vLLM: the target is its own argument
        "verifier_architectures": list(cfg.verifier_architectures),
    }


def k3_dspark_config_from_json(data: dict[str, Any]) -> DraftConfig:
    for key in ("target_layer_ids", "num_target_layers", "target_hidden_size", "markov_rank", "mask_token_id"):
        _require(data, key)
    ids = [int(i) for i in data["target_layer_ids"]]
    if int(data["num_target_layers"]) != len(ids):
        raise ConfigError("num_target_layers", f"{data['num_target_layers']} != len(target_layer_ids) {len(ids)}")
    if data.get("dspark_bonus_anchor") or data.get("sample_from_anchor", True) is False:
        raise ConfigError("sample_from_anchor", "k3_dspark drafts are anchor-as-first (vLLM refuses the other layout)")
    for flag in ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm"):
        if data.get(flag):
            raise ConfigError(flag, "is not supported by MLA DSpark drafts (vLLM refuses it too)")
    if data.get("markov_head_type", "vanilla") != "vanilla":
        raise ConfigError("markov_head_type", "k3_dspark drafts have a vanilla Markov head")
    vocab = int(_require(data, "vocab_size"))
    if int(data.get("draft_vocab_size") or vocab) != vocab:
        raise ConfigError("draft_vocab_size", "k3_dspark drafts share the target's full vocabulary")
    backbone = DecoderConfig.from_hf({**data, "model_type": "deepseek_v3", "rope_interleave": True,
                                      "n_routed_experts": 0})
    temps = data.get("confidence_temperatures") or ()
    return DraftConfig(
        backbone=backbone,
        target_hidden_size=int(data["target_hidden_size"]),
        target_layer_ids=tuple(ids),
        block_size=int(data.get("block_size") or data.get("dspark_block_size") or 7),
        mask_token_id=int(data["mask_token_id"]),
        markov_rank=int(data["markov_rank"]),
        enable_confidence_head=bool(data.get("enable_confidence_head", False)),  # vLLM's defaults
        confidence_with_markov=bool(data.get("confidence_head_with_markov", False)),
        confidence_temperatures=tuple(float(t) for t in temps),
        verifier_name_or_path=data.get("verifier_name_or_path", ""),
        verifier_architectures=tuple(data.get("verifier_architectures", ())),
    )


def draft_config_to_json(cfg: DraftConfig, layout: str | None = None) -> dict[str, Any]:
    """The draft's config.json: speculators ``dspark`` (GQA backbones) or vLLM's ``k3_dspark`` (MLA)."""
    if (layout or draft_layout(cfg)) == K3_DSPARK:
        return k3_dspark_config_to_json(cfg)
    return speculators_config_to_json(cfg)


def speculators_config_to_json(cfg: DraftConfig) -> dict[str, Any]:
    layer_cfg = cfg.backbone.to_hf()
    layer_cfg["architectures"] = ["DSparkDraftModel"]
    return {
        "architectures": ["DSparkSpeculator"],
        "speculators_model_type": "dspark",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": cfg.output_vocab_size,
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
        "block_size": cfg.num_slots,
        "aux_hidden_state_layer_ids": aux_ids_from_target_layers(cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "markov_rank": cfg.markov_rank if cfg.enable_markov_head else 0,  # 0: no Markov head (speculators)
        "markov_head_type": cfg.markov_head_type,
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_reads_markov,
        "confidence_temperatures": list(cfg.confidence_temperatures) or None,
        "sample_from_anchor": cfg.sample_from_anchor,
    }


def _require(data: dict[str, Any], key: str, where: str = "") -> Any:
    if key not in data:
        raise ConfigError(f"{where}{key}", "missing from the draft config.json")
    return data[key]


def draft_config_from_json(data: dict[str, Any]) -> DraftConfig:
    """Read a speculators ``dspark`` config with the meanings speculators and vLLM give its fields.

    Exports of this project made before it matched them carry ``markov_head_type: "markov"``, a value no other tool
    writes; they are read with what they meant then: anchor-as-first blocks and output-of-layer ids.
    """
    if data.get("model_type") == K3_DSPARK:
        return k3_dspark_config_from_json(data)
    model_type = data.get("speculators_model_type")
    if model_type != "dspark":
        raise ConfigError("speculators_model_type", f"expected 'dspark', got {model_type!r}")
    layer_cfg = dict(_require(data, "transformer_layer_config"))
    backbone = DecoderConfig.from_hf(layer_cfg)
    spec = data.get("speculators_config") or {}
    verifier = spec.get("verifier", {})
    markov_type = data.get("markov_head_type", "vanilla")
    legacy = markov_type in LEGACY_MARKOV_TYPES
    markov_type = LEGACY_MARKOV_TYPES.get(markov_type, markov_type)
    if markov_type not in MARKOV_TYPES:
        raise ConfigError("markov_head_type", f"{markov_type!r} is not supported here (supported: "
                                              f"{', '.join(MARKOV_TYPES)})")
    markov = int(data.get("markov_rank", 256) or 0) > 0
    # speculators / vLLM default: false (the anchor is a bonus token, only the masks predict)
    from_anchor = True if legacy else bool(data.get("sample_from_anchor", False))
    slots = int(_require(data, "block_size"))
    gamma = slots - (0 if from_anchor else 1)
    if gamma < 1:
        raise ConfigError("block_size", f"{slots} slots leave no token to draft with sample_from_anchor "
                                        f"{str(from_anchor).lower()}")
    methods = spec.get("proposal_methods") or [{}]
    served = methods[0].get("speculative_tokens")
    if served is not None and not 1 <= int(served) <= gamma:
        raise ConfigError("speculators_config.proposal_methods[0].speculative_tokens",
                          f"{served} is not in [1, {gamma}] (block_size {slots}, sample_from_anchor "
                          f"{str(from_anchor).lower()})")
    aux_ids = [int(i) for i in _require(data, "aux_hidden_state_layer_ids")]
    vocab = int(data.get("draft_vocab_size") or backbone.vocab_size)
    if vocab > backbone.vocab_size:
        raise ConfigError("draft_vocab_size", f"{vocab} exceeds transformer_layer_config.vocab_size "
                                              f"{backbone.vocab_size}")
    temps = data.get("confidence_temperatures") or ()
    return DraftConfig(
        backbone=backbone,
        target_hidden_size=int(_require(data, "target_hidden_size")),
        target_layer_ids=tuple(aux_ids) if legacy else target_layers_from_aux_ids(aux_ids),
        block_size=gamma,
        mask_token_id=int(_require(data, "mask_token_id")),
        markov_rank=int(data.get("markov_rank", 256)) if markov else 1,
        enable_markov_head=markov,
        markov_head_type=markov_type,
        enable_confidence_head=bool(data.get("enable_confidence_head", True)),
        confidence_with_markov=bool(data.get("confidence_head_with_markov", markov)),
        confidence_temperatures=tuple(float(t) for t in temps),
        sample_from_anchor=from_anchor,
        draft_vocab_size=vocab if vocab < backbone.vocab_size else 0,
        verifier_name_or_path=verifier.get("name_or_path", ""),
        verifier_architectures=tuple(verifier.get("architectures", ())),
    )


def _disk_name(name: str, layout: str = "speculators") -> str:
    name = name.removeprefix("own.")  # the draft's own embed_tokens / lm_head keep their speculators names
    if layout == K3_DSPARK:
        for theirs, ours in K3_TENSOR_NAMES.items():
            if name.startswith(ours):
                return theirs + name.removeprefix(ours)
    return name


def _our_name(name: str, layout: str) -> str:
    if layout == K3_DSPARK:
        for theirs, ours in K3_TENSOR_NAMES.items():
            if name.startswith(theirs):
                return ours + name.removeprefix(theirs)
    return "own." + name if name in SHARED_TENSORS else name


def save_draft(model: DSparkDraft, path: str | Path, dtype: torch.dtype | None = None,
               layout: str | None = None) -> None:
    """Write a draft the way vLLM reads it (``layout``: speculators or k3_dspark; default by attention kind)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    layout = layout or draft_layout(model.config)
    (path / "config.json").write_text(json.dumps(draft_config_to_json(model.config, layout), indent=2) + "\n")
    state = {_disk_name(k, layout): v.detach().cpu().to((dtype or v.dtype) if v.is_floating_point() else v.dtype)
             .contiguous() for k, v in model.state_dict().items()}
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
    data = json.loads(config_file.read_text())
    layout = K3_DSPARK if data.get("model_type") == K3_DSPARK else "speculators"
    cfg = draft_config_from_json(data)
    if target_config is not None:
        check_compatible(cfg, target_config)
    model = DSparkDraft(cfg)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise ConfigError("draft_path", f"{path} has no model.safetensors")
    state = {k: v for k, v in load_file(str(weights)).items() if k not in IGNORED_TENSORS}
    for name in SHARED_TENSORS if layout != K3_DSPARK else ():  # a draft that ships its own embedding / LM head
        own = name.split(".")[0]
        if name in state and own not in model.own:
            model.add_own(own)
    if layout == K3_DSPARK:  # the target's embedding and LM head, whatever the file holds (vLLM drops them too)
        state = {k: v for k, v in state.items() if k not in SHARED_TENSORS}
    state = {_our_name(k, layout): v for k, v in state.items()}
    if cfg.reduced_vocab and "t2d" not in state and "d2t" in state:  # t2d is training-only: derive it
        state["t2d"] = _t2d_from_d2t(state["d2t"], cfg.backbone.vocab_size)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ConfigError(_disk_name(missing[0], layout),
                          f"tensor missing from the draft checkpoint ({len(missing)} missing)")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ConfigError(_disk_name(unexpected[0], layout), "unexpected tensor in the draft checkpoint")
    for name, tensor in expected.items():
        if state[name].shape != tensor.shape:
            raise ConfigError(_disk_name(name, layout),
                              f"shape {tuple(state[name].shape)} does not match the config's {tuple(tensor.shape)}")
    if cfg.reduced_vocab:
        _check_vocab_map(state["d2t"].long(), state["t2d"].bool(), cfg.backbone.vocab_size)
        state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    model.load_state_dict(state)
    return model.to(dtype).eval()


def _t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    target_ids = torch.arange(len(d2t), device=d2t.device) + d2t.long()
    marks = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    return marks.index_fill_(0, target_ids.clamp(0, vocab_size - 1), True)


def _check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    """d2t must map the draft ids one to one into the target vocabulary, onto exactly the ids t2d marks."""
    target_ids = torch.arange(len(d2t), device=d2t.device) + d2t
    if bool(((target_ids < 0) | (target_ids >= vocab_size)).any()):
        raise ConfigError("d2t", f"maps draft ids outside the target vocabulary [0, {vocab_size})")
    if len(torch.unique(target_ids)) != len(target_ids):
        raise ConfigError("d2t", "maps two draft ids to the same target id")
    if int(t2d.sum()) != len(d2t) or not bool(t2d[target_ids].all()):
        raise ConfigError("t2d", "does not mark exactly the target ids that d2t maps to")


def check_compatible(cfg: DraftConfig, target: DecoderConfig) -> None:
    if cfg.backbone.vocab_size != target.vocab_size:
        raise ConfigError("transformer_layer_config.vocab_size", f"draft vocabulary {cfg.backbone.vocab_size} != "
                                                                 f"target's {target.vocab_size}")
    if cfg.target_hidden_size != target.hidden_size:
        raise ConfigError("target_hidden_size", f"{cfg.target_hidden_size} != target hidden size "
                                                f"{target.hidden_size}")
    if cfg.backbone.hidden_size != target.hidden_size:
        raise ConfigError("transformer_layer_config.hidden_size",
                          f"{cfg.backbone.hidden_size} must equal the target's {target.hidden_size} "
                          "(embedding and LM head are shared)")
    bad = [i for i in cfg.target_layer_ids if i >= target.num_layers]
    if bad:
        raise ConfigError("aux_hidden_state_layer_ids", f"{aux_ids_from_target_layers(tuple(bad))} name states "
                                                        f"beyond the target's {target.num_layers} layers")
