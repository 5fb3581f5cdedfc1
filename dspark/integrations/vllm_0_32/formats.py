"""How vLLM reads a draft config, beside how this library reads it (``docs/formats.md``)."""

from __future__ import annotations

import copy
from typing import Any

from dspark.config import DraftConfig
from dspark.formats.checkpoint import K3_DSPARK, draft_layout


def vllm_draft_view(data: dict[str, Any]) -> dict[str, Any]:
    """What vLLM makes of a draft config.json (speculators ``dspark``, or its own ``k3_dspark``): the fields that
    decide what the draft computes.

    ``num_slots`` is the block's input slots per request: ``num_speculative_tokens`` when the anchor predicts,
    one more when it is a bonus token (``v1/worker/gpu/spec_decode/dspark/speculator.py``, ``num_query_per_req``).
    """
    if data.get("model_type") == "k3_dspark":
        return _vllm_k3_view(data)
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    pre = SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(data))
    spec = SpeculatorsConfig.extract_vllm_speculative_config(copy.deepcopy(data))
    SpeculatorsConfig(**copy.deepcopy(pre))  # vLLM builds its PretrainedConfig from this: it must accept it
    tokens = int(spec["num_speculative_tokens"])
    from_anchor = bool(pre["sample_from_anchor"])
    return {
        "target_layer_ids": list(pre["target_layer_ids"]),  # outputs of these target layers feed the draft
        "num_speculative_tokens": tokens,
        "num_slots": tokens if from_anchor else tokens + 1,
        "sample_from_anchor": from_anchor,
        "vocab_size": int(pre["vocab_size"]),
        "draft_vocab_size": int(pre.get("draft_vocab_size") or pre["vocab_size"]),
        "mask_token_id": int(pre["mask_token_id"]),
        "is_neox_style": bool(pre.get("is_neox_style", True)),
        "markov_head_type": pre.get("markov_head_type"),
        "markov_rank": int(pre.get("markov_rank") or 0),
        "confidence_head_with_markov": bool(pre.get("confidence_head_with_markov", False)),
        # qwen3_dflash.py _resolve_layer_attention: sliding layers are windowed and causal; absent = all full
        "sliding_layers": [t == "sliding_attention" for t in pre.get("layer_types") or []] or None,
        "sliding_window": int(pre.get("sliding_window") or 0) if pre.get("layer_types") else 0,
    }


def our_draft_view(cfg: DraftConfig) -> dict[str, Any]:
    """The same fields as :func:`vllm_draft_view`, from this library's reading of the config."""
    return _our_k3_view(cfg) if draft_layout(cfg) == K3_DSPARK else _our_speculators_view(cfg)


def _our_speculators_view(cfg: DraftConfig) -> dict[str, Any]:
    return {
        "target_layer_ids": list(cfg.target_layer_ids),
        "num_speculative_tokens": cfg.block_size,
        "num_slots": cfg.num_slots,
        "sample_from_anchor": cfg.sample_from_anchor,
        "vocab_size": cfg.backbone.vocab_size,
        "draft_vocab_size": cfg.output_vocab_size,
        "mask_token_id": cfg.mask_token_id,
        "is_neox_style": not cfg.backbone.rope_interleave,
        "markov_head_type": cfg.markov_head_type,
        "markov_rank": cfg.markov_rank if cfg.enable_markov_head else 0,
        "confidence_head_with_markov": cfg.confidence_reads_markov,
        "sliding_layers": [cfg.backbone.is_sliding(i) for i in range(cfg.backbone.num_layers)]
        if cfg.backbone.is_sliding(None) else None,
        "sliding_window": cfg.backbone.sliding_window,
    }


def _vllm_k3_view(data: dict[str, Any]) -> dict[str, Any]:
    from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig

    cfg = K3DSparkConfig(**copy.deepcopy(data))
    rope = dict(cfg.rope_parameters)
    tokens = int(getattr(cfg, "block_size", 0) or 0)  # the default of --speculative-config num_speculative_tokens
    return {
        "target_layer_ids": list(cfg.target_layer_ids),
        "num_speculative_tokens": tokens,
        "num_slots": tokens,  # K3DSparkConfig refuses the bonus-anchor layout
        "sample_from_anchor": bool(getattr(cfg, "sample_from_anchor", True)),
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "mask_token_id": int(cfg.mask_token_id),
        "markov_rank": int(cfg.markov_rank),
        "confidence_head_with_markov": bool(getattr(cfg, "confidence_head_with_markov", False)),
        "num_hidden_layers": cfg.num_hidden_layers,
        "mla": (cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                cfg.qk_rope_head_dim, cfg.v_head_dim),
        "rope": (rope.get("rope_type"), float(rope.get("rope_theta")), float(rope.get("factor", 1.0)),
                 int(rope.get("original_max_position_embeddings", 0) or 0)),
    }


def _our_k3_view(cfg: DraftConfig) -> dict[str, Any]:
    bb, rope = cfg.backbone, cfg.backbone.rope
    view = {k: v for k, v in _our_speculators_view(cfg).items()
            if k not in ("is_neox_style", "markov_head_type", "sliding_layers", "sliding_window")}
    return {
        **view,
        "num_hidden_layers": bb.num_layers,
        "mla": (bb.num_heads, bb.q_lora_rank, bb.kv_lora_rank, bb.qk_nope_head_dim, bb.qk_rope_head_dim,
                bb.v_head_dim),
        "rope": (rope.scaling_type or "default", float(rope.theta), float(rope.factor),
                 int(rope.original_max_position_embeddings) if rope.scaling_type else 0),
    }

