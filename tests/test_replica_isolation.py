"""Two serving replicas on real Ray Serve: a target shard of one dies mid-stream; the other replica's
requests finish untouched and exact, the hit replica's fail retryably, and the hit replica comes back."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import requests

from dspark.builder import build_engine
from dspark.config import SamplingParams
from dspark.loader import encode_prompt

from conftest import HTTP, benchmark_prompts, deploy_app, wait_for

pytestmark = pytest.mark.slow
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def two_replicas(serve_instance, tmp_path_factory):
    """The embedded default as two fixed replicas, each with its own shard, drafter and router actors."""
    with deploy_app(tmp_path_factory.mktemp("isolation"),
                    serving={"num_replicas": 2, "load_aware_speculation": False, "max_concurrent_requests": 4,
                             "max_queued_requests": 8, "max_tokens_limit": 64, "api_key_env": "DSPARK_TEST_NO_KEY",
                             "router_cpus": 0.3},
                    engine={"max_num_seqs": 4, "scheduler": "full"},
                    runtime={"shard_cpus": 0.3, "drafter_cpus": 0.3, "shard_threads": 1,
                             "drafter_threads": 1}) as config:
        yield config


def replica_health(count: int = 2, timeout_s: float = 120.0) -> dict[str, dict]:
    """Health of each replica (Serve routes each /health to one of them), keyed by replica id."""
    seen: dict[str, dict] = {}

    def probe() -> list[str]:
        response = requests.get(f"{HTTP}/health", timeout=30)
        if response.status_code == 200:
            health = response.json()
            assert response.headers["x-dspark-replica"] == health["replica"]
            seen[health["replica"]] = health
        return sorted(seen)

    wait_for(probe, timeout_s, f"/health answered by {count} replicas (replicas seen)",
             until=lambda ids: len(ids) >= count, interval_s=0.05)
    return seen


def test_a_shard_dying_on_one_replica_leaves_the_other_replicas_requests_untouched(two_replicas):
    prompts = benchmark_prompts("mt-bench", 4) + benchmark_prompts("gsm8k", 4)
    engine = build_engine(two_replicas, speculate=False, backend="native")
    expected = [engine.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in engine.generate(
        [encode_prompt(engine.tokenizer, p, chat=True) for p in prompts],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0))]
    del engine
    health = replica_health()
    model = two_replicas.name
    replica_of: dict[int, str] = {}
    decoding: set[int] = set()  # requests that have streamed a token
    outcome: dict[int, tuple[str, str]] = {}  # index -> ("done", text) | ("error", code)

    def stream(index: int) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": prompts[index]}],
                "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True}
        text, result = [], ("hung", "")
        with requests.post(f"{HTTP}/v1/chat/completions", json=body, stream=True, timeout=300) as response:
            replica_of[index] = response.headers["x-dspark-replica"]
            if response.status_code != 200:
                result = ("refused", str(response.status_code))
            for line in response.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result = ("error", chunk["error"]["code"])
                    break
                choice = chunk["choices"][0]
                text.append(choice["delta"].get("content") or "")
                decoding.add(index)
                if choice["finish_reason"]:
                    result = ("done", "".join(text))
        outcome[index] = result

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(replica_of), 120, f"all {len(prompts)} requests answered with headers",
             until=lambda answered: answered == len(prompts))
    assert len(set(replica_of.values())) == 2, f"Serve sent every request to one replica: {replica_of}"
    hit = replica_of[0]
    (other,) = set(health) - {hit}
    wait_for(lambda: sorted({replica_of[i] for i in decoding}), 120, "decoding started on both replicas",
             until=lambda replicas: replicas == sorted(health))
    os.kill(health[hit]["actors"]["target_shards"][0], signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a request hung after the shard died"
    on_hit = [i for i in range(len(prompts)) if replica_of[i] == hit]
    on_other = [i for i in range(len(prompts)) if replica_of[i] == other]
    print(f"replica {hit}: {[outcome[i][0] for i in on_hit]}; replica {other}: {[outcome[i][0] for i in on_other]}")
    # the other replica: every request completes, exactly the target's greedy output
    assert [outcome[i] for i in on_other] == [("done", expected[i]) for i in on_other]
    # the hit replica: each in-flight request either had finished (exactly) or ends with a retryable error
    assert all(outcome[i] in (("done", expected[i]), ("error", "unavailable")) for i in on_hit)
    assert any(outcome[i] == ("error", "unavailable") for i in on_hit)
    # both replicas serve again: the hit one restarted its actors in its own placement group
    def restarted(after: dict[str, dict]) -> bool:
        shards = after[hit]["actors"].get("target_shards")  # [] while the replica restarts its actors
        return bool(shards) and shards != health[hit]["actors"]["target_shards"]

    after = wait_for(lambda: replica_health(timeout_s=240), 240, "the hit replica to restart its shard",
                     until=restarted, interval_s=2)
    assert after[other]["actors"] == health[other]["actors"]  # the other replica's actors were never touched
