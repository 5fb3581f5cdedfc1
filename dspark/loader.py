"""Building a ready engine (target, tokenizer, drafter) from a validated config."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from dspark.checkpoint import load_draft
from dspark.config import ConfigError, EngineConfig
from dspark.drafter import DSparkDrafter
from dspark.engine import Engine
from dspark.schema import EngineFileConfig
from dspark.target_checkpoint import load_target
from dspark.target_model import DTYPES, TargetModel

log = logging.getLogger("dspark")


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError("target.path", f"cannot load a tokenizer from {path}: {exc}") from None


def build_drafter(cfg: EngineFileConfig, target: TargetModel, engine_cfg: EngineConfig) -> DSparkDrafter | None:
    if not engine_cfg.speculate or not cfg.draft.path:
        return None
    draft_path = cfg.resolve(cfg.draft.path)
    if not draft_path.is_dir():
        raise ConfigError("draft.path", f"{draft_path} is not a directory")
    draft = load_draft(draft_path, target.config, DTYPES[cfg.draft.dtype])
    draft.bind_target(target.embed_tokens, target.lm_head)
    return DSparkDrafter(draft, engine_cfg.kv_cache_tokens, engine_cfg.kv_block_size, engine_cfg.draft_top_k,
                         engine_cfg.block_size)


def build_engine(cfg: EngineFileConfig, speculate: bool | None = None) -> Engine:
    """An in-process engine on this machine's CPU (``auto`` dtypes chosen here; ``engine.dtypes`` says how)."""
    cfg, choices = cfg.with_concrete_dtypes()
    for part, choice in choices.items():
        log.info("%s dtype %s (%s)", part, choice.dtype, choice.reason)
    target_path = cfg.resolve(cfg.target.path)
    if not target_path.is_dir():
        raise ConfigError("target.path", f"{target_path} is not a directory (run `dspark prepare`?)")
    engine_cfg = cfg.engine.to_core(cfg.target.dtype)
    if speculate is not None:
        engine_cfg = replace(engine_cfg, speculate=speculate)
    target = load_target(target_path, cfg.target.dtype, fp8_weights=cfg.target.fp8_mode(on_gpu=False))
    tokenizer = load_tokenizer(target_path)
    drafter = build_drafter(cfg, target, engine_cfg)
    layers = drafter.model.config.target_layer_ids if drafter else ()
    engine = Engine(target, tokenizer, drafter, engine_cfg, feature_layers=layers)
    engine.dtypes = {part: c.as_dict() for part, c in choices.items()}
    return engine


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of a prompt, optionally as one user turn in the target's chat template."""
    if chat:
        if not tokenizer.chat_template:
            raise ConfigError("chat", "the target's tokenizer has no chat template")
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))
