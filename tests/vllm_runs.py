"""Offline vLLM runs for the vLLM tests: ``tests/vllm_generate.py`` in its own process (its engine, its threads), the
embedded default's engine settings in fp32, and the 20 shared chat prompts the greedy comparisons use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.report import DATASETS
from dspark.evaluation.prompt_sets import round_robin
from dspark.loader import encode_chat
from dspark.schema import load_engine_config

from conftest import REPO

MAX_TOKENS, PROMPTS = 32, 20  # 40 x 128 in benchmarks.exactness; here what proves the same
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0}


def vllm_generate(engine_args: dict, prompts: list[list[int]], params: list[dict], tmp: Path,
                  concurrency: tuple[int, ...] = (1,), broken_draft_probs: bool | str = False,
                  drafter_actor=None, rank_digests: bool = False, env: dict | None = None) -> list[dict]:
    """One engine, all ``prompts`` once per entry of ``concurrency`` (1: one request at a time; N: all submitted
    together); one result per run (outputs and that run's counters, see ``tests/vllm_generate.py``).
    ``drafter_actor``: the serving config (``engine.vllm_drafter: actor``) whose drafter actor our proposer drafts
    through, on a local Ray cluster of the script's own. ``rank_digests``: the last run carries "ranks", each
    tensor-parallel rank's digest of its proposer's steps (``tests/vllm_generate.py``). ``env``: vLLM's environment
    for the config (``engine_env``)."""
    request = tmp / f"request-{os.getpid()}-{len(list(tmp.iterdir()))}.json"
    actor = {**drafter_actor.model_dump(mode="json"), "base_dir": drafter_actor.base_dir} if drafter_actor else None
    request.write_text(json.dumps({"engine_args": engine_args, "prompts": prompts, "params": params,
                                   "concurrency": list(concurrency), "broken_draft_probs": broken_draft_probs,
                                   "drafter_actor": actor, "rank_digests": rank_digests}))
    # the engine core in the script's process
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_generate.py")), str(request)],
                         capture_output=True, text=True, env=env, timeout=1200, cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    # the result's line (vLLM's multiprocessing executor logs its workers' exit to stdout after it)
    result = json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith('{"runs"')))
    runs = result["runs"]
    assert len(runs) == len(concurrency)
    if result.get("channel"):  # the drafter actor's feature channel at the end (on the last run)
        runs[-1]["channel"] = result["channel"]
    if result.get("ranks"):
        runs[-1]["ranks"] = result["ranks"]
    return runs


def fp32_vllm_config():
    """configs/embedded.yaml on vLLM in fp32 (batch-invariant enough to compare token for token), our proposer (the
    head only, no prompt lookup) with full blocks and no gate (every round drafts, so acceptance compares with the
    native engine's)."""
    config = in_dtype(load_engine_config(REPO / "configs" / "embedded.yaml"), "float32")
    return config.model_copy(update={"engine": config.engine.model_copy(
        update={"backend": "vllm", "max_num_seqs": 8, "scheduler": "full", "draft_gate": False,
                "draft_sources": "head"})})  # the head only: acceptance compares with the native engine's


def in_dtype(config, dtype: str):
    """``config`` with its target and draft in ``dtype``."""
    return config.model_copy(update={part: getattr(config, part).model_copy(update={"dtype": dtype})
                                     for part in ("target", "draft")})


def with_speculation(config, speculation: str):
    return config.model_copy(update={"engine": config.engine.model_copy(update={"vllm_speculation": speculation})})


def shared_texts(count: int = PROMPTS) -> list[str]:
    """The first turns of the repo's shared prompt sets, in turn (code, code, math, chat), cut to 600 characters."""
    return [text[:600] for text in round_robin(DATASETS, count)]


def shared_prompts(tokenizer, count: int = PROMPTS) -> list[list[int]]:
    """``shared_texts`` as chat prompts, token ids."""
    return [encode_chat(tokenizer, [{"role": "user", "content": text}]) for text in shared_texts(count)]
