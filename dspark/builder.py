"""The one builder: the engine a serving config describes, in this process.

``serve run`` (the replica), ``dspark generate``, ``dspark bench``, ``benchmarks.peers`` and the tests all build
their engine here, so a figure is always measured on the engine that serves. ``engine.backend`` picks it:

- ``vllm`` (the embedded default): vLLM's engine (``dspark.integrations.vllm_0_32.engine.VllmEngine``) with the
  config's proposer (``engine.vllm_speculation``: our DSpark proposer, with its draft gate and prefix scheduler, vLLM's
  prompt lookup, or none) and, with ``engine.vllm_drafter: actor``, the head in a drafter actor (``drafter_host``:
  the replica passes ``actors.draft_actor.DrafterHostFactory``; without one the head drafts in this process).
- ``native``: the reference engine (``dspark.decoding.engine.Engine``) with the target and the head in this process.
  (A served native replica runs the same ``Engine`` as ``actors.router.Router``, its passes in shard and drafter
  actors.)

Every engine says what it is in ``engine.description``: backend, dtypes (and why ``auto`` chose them), proposer,
kernels — written beside every figure the CLI and the benchmarks print.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from dspark.config import ConfigError
from dspark.schema import EngineFileConfig

log = logging.getLogger("dspark")

BACKENDS = ("native", "vllm")


def build_engine(cfg: EngineFileConfig, speculate: bool | None = None, backend: str | None = None,
                 drafter_host=None):
    """The engine ``cfg`` describes (``backend`` overrides ``engine.backend``; ``speculate=False``: plain decoding,
    the baseline of the same engine and dtypes)."""
    backend = backend or cfg.engine.backend
    if backend not in BACKENDS:
        raise ConfigError("engine.backend", f"{backend!r} is not one of {', '.join(BACKENDS)}")
    if backend != cfg.engine.backend:
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"backend": backend})})
    on_gpu = False
    if backend == "vllm":
        import torch

        on_gpu = torch.cuda.is_available()
    cfg, choices = cfg.with_concrete_dtypes(target_on_gpu=on_gpu)
    for part, choice in choices.items():
        log.info("%s dtype %s (%s)", part, choice.dtype, choice.reason)
    target_path = cfg.resolve(cfg.target.path)
    if not target_path.is_dir():
        raise ConfigError("target.path", f"{target_path} is not a directory (run `dspark prepare`?)")
    dtypes = {part: c.as_dict() for part, c in choices.items()}
    if backend == "vllm":
        engine = _vllm_engine(cfg, speculate, drafter_host)
    else:
        engine = _native_engine(cfg, speculate)
    engine.dtypes = {part: {**dtypes[part], **engine.dtypes.get(part, {})} for part in dtypes}
    engine.description = describe(cfg, engine)
    log.info("engine: %s", engine.description)
    return engine


def describe(cfg: EngineFileConfig, engine) -> dict:
    """What produced a figure: backend (and vLLM's version), dtypes, proposer, and whether the kernels are the
    shape-invariant ones."""
    e = cfg.engine
    chosen = getattr(engine, "dtypes", None) or {}
    target_dtype = chosen.get("target", {}).get("dtype", cfg.target.dtype)
    draft_dtype = chosen.get("draft", {}).get("dtype", cfg.draft.dtype)
    if cfg.engine.backend == "vllm":
        from dspark.integrations.vllm_0_32 import installed_version
        from dspark.integrations.vllm_0_32.args import exact_kernels

        proposer = e.vllm_speculation if engine.speculation_enabled else "off"
        if proposer == "dspark_plugin":
            proposer = f"dspark (our proposer in vLLM, drafter {e.vllm_drafter})"
        return {"backend": "vllm", "vllm": installed_version(), "target_dtype": target_dtype,
                "draft_dtype": draft_dtype, "proposer": proposer, "exact_kernels": exact_kernels(cfg),
                "draft_gate": e.draft_gate, "scheduler": e.scheduler}
    proposer = "dspark" if engine.drafter is not None else "off"
    return {"backend": "native", "target_dtype": target_dtype, "draft_dtype": draft_dtype,
            "proposer": proposer, "exact_kernels": True, "draft_gate": e.draft_gate, "scheduler": e.scheduler}


def _vllm_engine(cfg: EngineFileConfig, speculate: bool | None, drafter_host):
    from dspark.integrations.vllm_0_32.engine import VllmEngine

    if speculate is False:
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"vllm_speculation": "off"})})
    engine = VllmEngine(cfg)
    if cfg.engine.vllm_drafter != "actor" or not engine.our_proposer or drafter_host is None:
        return engine
    try:  # in this process, or with tensor parallelism in vLLM's rank-0 worker
        engine.attach_drafter(drafter_host)
    except BaseException:
        engine.shutdown()
        raise
    return engine


def _native_engine(cfg: EngineFileConfig, speculate: bool | None):
    from dspark.decoding.engine import Engine
    from dspark.formats.target_checkpoint import load_target
    from dspark.loader import build_drafter, load_tokenizer

    engine_cfg = cfg.engine.to_core(cfg.target.dtype)
    if speculate is not None:
        engine_cfg = replace(engine_cfg, speculate=speculate)
    target_path = cfg.resolve(cfg.target.path)
    target = load_target(target_path, cfg.target.dtype, fp8_weights=cfg.target.fp8_mode(on_gpu=False))
    tokenizer = load_tokenizer(target_path, cfg.target.trust_remote_code)
    drafter = build_drafter(cfg, target, engine_cfg)
    layers = drafter.model.config.target_layer_ids if drafter else ()
    engine = Engine(target, tokenizer, drafter, engine_cfg, feature_layers=layers)
    engine.dtypes = {}
    return engine
