"""Live autoscaling on a local cluster, on the vLLM backend (the engine the embedded default serves on): lower
acceptance at the same offered load adds a replica; acceptance recovering at that load removes it again.

vLLM drafts by prompt lookup here (``engine.vllm_speculation: ngram``): the policy's acceptance length and the
replica's ``dspark:spec_decode_*`` counters come from vLLM's engine (its per-request outputs and its
``SpecDecodingStats``). The prompt is a repeating list of colours: greedy, the target continues the cycle and
prompt lookup drafts it (measured: acceptance 6.7, 430 tokens/s at batch 2); at temperature 1.5 the continuation is
noise that nothing in the context predicts (no drafts, 114 tokens/s).

The offered load derives from the replica's capacity as the policy itself models it
(``deploy.autoscaling.ReplicaStats.capacity``: acceptance length x batch slots / step time), measured on this
machine by a short greedy run at half the batch (the occupancy the load then keeps). An open-loop client offers 40%
of it (48 tokens a request): the policy wants ceil(0.4 / 0.8) = 1 replica. At temperature 1.5 the capacity falls
(to about a third), the offered load exceeds the target utilisation of one replica, and the policy asks for a second
replica. Back at temperature 0, once the slow requests have drained, one replica suffices again and Serve removes
the other after ``downscale_delay_s`` (20 s here) of that decision. Two replicas share this node's two cores, so
together they drain the backlog of the slow phase at about one replica's capacity less the offered load: at 40%
(not half) that leaves room for a node busier than the measurement was (a run at half with another process
computing beside it ended with two replicas at 1.25 s a step, 3.4x the step of one, and a backlog that never
drained).

Why not the native engine as well (it ran here until 2026-12-03): two replicas on one 2-core node share its cores,
so each replica's measured step time, and with it the capacity the policy sees, depends on how many replicas there
are. With the native engine (three processes per replica, bf16 emulated on CPUs without native bf16) a step took
0.42 s with one replica and 1.47 s with two (AMD EPYC, AVX2): two contended replicas then look too slow to hand
the load back to one, and the test measured the node, not the policy. The policy reads the same five statistics
from either engine (the native replica's feed: ``tests/test_serving.py``; the policy on synthetic inputs:
``tests/test_autoscaling.py``); on a cluster each replica has its own devices.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from deploy.autoscaling import METRICS, ReplicaStats

from conftest import HTTP, deploy_app, get_health, holds, wait_for

pytestmark = pytest.mark.slow
MAX_TOKENS, SLOTS = 48, 4
LOAD = 0.4  # of one replica's measured capacity


def replicas() -> int:
    from ray import serve

    status = serve.status().applications["dspark"].deployments["DSparkServer"]
    return status.replica_states.get("RUNNING", 0)


PROMPT = "red green blue yellow purple orange " * 6
ENGINE = {"backend": "vllm", "vllm_speculation": "ngram", "max_num_seqs": SLOTS}


def complete(temperature: float) -> int | None:
    body = {"model": "smollm2-135m-instruct", "prompt": PROMPT,
            "max_tokens": MAX_TOKENS, "temperature": temperature, "top_p": 1.0}
    try:
        return requests.post(f"{HTTP}/v1/completions", json=body, timeout=300).status_code
    except requests.RequestException:
        return None


def measured_capacity(seconds: float) -> float:
    """Tokens/s one replica generates at a full batch, as the policy computes it from the replica's telemetry,
    after ``seconds`` (longer than its 10 s window) of greedy requests at half the batch."""
    end = time.monotonic() + seconds

    def closed_loop(_) -> list[int | None]:
        statuses = []
        while time.monotonic() < end:
            statuses.append(complete(0.0))
        return statuses

    start = time.monotonic()
    with ThreadPoolExecutor(SLOTS // 2) as pool:
        statuses = [s for worker in pool.map(closed_loop, range(SLOTS // 2)) for s in worker]
    assert statuses and set(statuses) == {200}, statuses
    stats = ReplicaStats(*(float(get_health()["autoscaling"][m]) for m in METRICS))
    print(f"measured {len(statuses) * MAX_TOKENS / (time.monotonic() - start):.1f} tokens/s at half the batch; "
          f"policy's view {stats}: capacity {stats.capacity:.1f} tokens/s", flush=True)
    return stats.capacity


class OpenLoop:
    """Requests at a fixed rate, whatever the server's speed (a queue builds when it is too slow)."""

    def __init__(self, rate: float):
        self.interval, self.temperature, self.stop = 1.0 / rate, 0.0, threading.Event()
        self.errors, self.refused = 0, 0  # refused: 429 while the queue is full (correct under overload)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _one(self, temperature: float) -> None:
        status = complete(temperature)
        if status == 429:
            self.refused += 1
        elif status != 200 and not self.stop.is_set():  # requests cut off by the app's deletion do not count
            self.errors += 1

    def _run(self) -> None:
        while not self.stop.is_set():
            threading.Thread(target=self._one, args=(self.temperature,), daemon=True).start()
            self.stop.wait(self.interval)


def scaled_to(count: int, timeout_s: float, what: str) -> None:
    start = time.monotonic()
    wait_for(lambda: (replicas(), get_health(timeout_s=10)["autoscaling"]), timeout_s, f"{what} (replicas, stats)",
             until=lambda seen: seen[0] == count, interval_s=1, ignore=(requests.RequestException,))
    print(f"{what}: {time.monotonic() - start:.0f} s", flush=True)


def test_degraded_acceptance_adds_a_replica_and_recovered_acceptance_removes_it(serve_instance, tmp_path):
    autoscaling = {"min_replicas": 1, "max_replicas": 2, "target_utilisation": 0.8, "hysteresis": 0.1,
                   "drain_horizon_s": 10, "downscale_cycles": 3, "metrics_interval_s": 1, "look_back_period_s": 5,
                   "upscale_delay_s": 2, "downscale_delay_s": 20}
    with deploy_app(tmp_path,
                    engine=ENGINE,
                    runtime={"shard_cpus": 0.3, "drafter_cpus": 0.3, "shard_threads": 1, "drafter_threads": 1},
                    serving={"load_aware_speculation": False, "router_cpus": 0.3, "max_queued_requests": 64,
                             "autoscaling": autoscaling}):
        capacity = measured_capacity(12.0)
        assert replicas() == 1, "half the batch, greedy: one replica"
        accepted = sum(s.value for f in text_string_to_metric_families(requests.get(f"{HTTP}/metrics", timeout=30).text)
                       for s in f.samples if s.name == "dspark:spec_decode_num_accepted_tokens_total")
        assert accepted > 0, "the replica's drafts were verified (on vLLM: its SpecDecodingStats)"
        assert get_health()["dtypes"]["target"].get("backend") == "vllm"
        load = OpenLoop(rate=LOAD * capacity / MAX_TOKENS)
        print(f"offering {LOAD * capacity:.1f} tokens/s", flush=True)
        try:
            holds(replicas, 15, "one replica: at greedy acceptance it carries the load", until=lambda n: n == 1)
            load.temperature = 1.5  # the drafter's proposals are now accepted far less often
            scaled_to(2, 180, "a second replica after acceptance fell")
            holds(replicas, 30, "two replicas while acceptance stays low", until=lambda n: n == 2)
            load.temperature = 0.0  # acceptance recovers at the same offered load
            scaled_to(1, 420, "back to one replica after acceptance recovered")
            holds(replicas, 15, "one replica while acceptance stays high", until=lambda n: n == 1)  # no flapping
        finally:
            load.stop.set()
            errors = load.errors
    assert errors == 0
