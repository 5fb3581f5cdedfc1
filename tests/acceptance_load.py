"""Load whose acceptance can be degraded at will, for the live autoscaling test (``tests/test_multinode.py``: the
second replica on a node added at run time): one engine config, one prompt, an open-loop client, and the replica's
capacity as the policy models it.

The replica drafts by prompt lookup (``NATIVE_ENGINE``: the native engine's own lookup, no head). Greedy, the target
continues the prompt with a list (``\\n- \\n- ...``) that prompt lookup drafts; at temperature 1.5 the continuation
is noise that nothing in the context predicts (no drafts: acceptance 1). The replica decodes one request at a time
(``max_num_seqs: 1``) and lookup drafts 4 tokens: on a CPU the target's step grows with the tokens it verifies (about
0.02 s a token beyond 0.08 s here), so at a larger batch or block speculation adds no capacity at all (measured at 4
rows x 8 tokens: 0.9 s a step, 19.6 tokens/s at acceptance 4.4, against 33 without drafts) and acceptance could not
move the policy's decision; one row verifying 5 tokens is where speculation pays on this machine, as it does at any
batch on a GPU.

A replica's capacity (``deploy.autoscaling.ReplicaStats.capacity``: acceptance length x batch slots / step time) is
measured at both temperatures under a light load, and the open-loop client offers 0.8 x their geometric mean: at
greedy demand / (0.8 x capacity) is below 1 and the policy keeps one replica, at temperature 1.5 above 1 and it asks
for two. Scale-down is shown when the demand ends, not at the same load with acceptance recovered: the policy's
decision for recovered acceptance is tested on synthetic statistics in ``tests/test_autoscaling.py`` (two replicas
sharing one small host's cores each step slower than one alone, so there the two conditions barely overlap). The
single-node live test on vLLM (``test_autoscaling_live.py``, until 2026-12-07) showed the same decisions as the
multi-node one and was folded into it: the policy reads the same five statistics from either engine (vLLM's feed:
``tests/test_vllm_backend.py``; the native replica's: ``tests/test_serving.py``).
"""

from __future__ import annotations

import threading

import requests

from deploy.autoscaling import METRICS, ReplicaStats

MAX_TOKENS, SLOTS = 48, 1
PROMPT = "red green blue yellow purple orange " * 6
# The native engine: a replica starts in seconds, where vLLM's processes would not fit the cores (a multi-node cluster
# on one host). Its capacities here: 32-35 tokens/s greedy against 13.6 at temperature 1.5 (in-process, 2 cores
# shared with a test run).
NATIVE_ENGINE = {"backend": "native", "draft_sources": "lookup", "max_num_seqs": SLOTS, "block_size": 4}
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_utilisation": 0.8, "hysteresis": 0.1,
               "drain_horizon_s": 10, "downscale_cycles": 3, "metrics_interval_s": 1, "look_back_period_s": 5,
               "upscale_delay_s": 5, "downscale_delay_s": 10}
RUNTIME = {"shard_cpus": 0.3, "drafter_cpus": 0.3, "shard_threads": 1, "drafter_threads": 1}
SERVING = {"load_aware_speculation": False, "router_cpus": 0.3, "max_queued_requests": 64,
           "autoscaling": AUTOSCALING}


def complete(http: str, temperature: float) -> int | None:
    body = {"model": "smollm2-135m-instruct", "prompt": PROMPT,
            "max_tokens": MAX_TOKENS, "temperature": temperature, "top_p": 1.0}
    try:
        return requests.post(f"{http}/v1/completions", json=body, timeout=300).status_code
    except requests.RequestException:
        return None


class OpenLoop:
    """Requests at a fixed rate, whatever the server's speed (a queue builds when it is too slow)."""

    def __init__(self, http: str, rate: float, temperature: float = 0.0):
        self.http, self.interval, self.temperature, self.stop = http, 1.0 / rate, temperature, threading.Event()
        self.errors, self.refused = 0, 0  # refused: 429 while the queue is full (correct under overload)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _one(self, temperature: float) -> None:
        status = complete(self.http, temperature)
        if status == 429:
            self.refused += 1
        elif status != 200 and not self.stop.is_set():  # requests cut off by the app's deletion do not count
            self.errors += 1

    def _run(self) -> None:
        while not self.stop.is_set():
            threading.Thread(target=self._one, args=(self.temperature,), daemon=True).start()
            self.stop.wait(self.interval)


def measured_capacity(http: str, health, seconds: float, temperature: float) -> float:
    """Tokens/s one replica generates at its full batch (one request), as the policy computes it from the replica's
    telemetry (``health()``'s ``autoscaling``: acceptance length / step time), after ``seconds`` (longer than its
    10 s window) of requests at ``temperature`` arriving every 8 s (at most 60% of the capacity: measuring must not
    itself scale the deployment)."""
    load = OpenLoop(http, rate=1 / 8.0, temperature=temperature)
    load.stop.wait(seconds)
    load.stop.set()
    assert load.errors == 0 and load.refused == 0, (load.errors, load.refused)
    stats = ReplicaStats(*(float(health()["autoscaling"][m]) for m in METRICS))
    print(f"temperature {temperature}: policy's view {stats}: capacity {stats.capacity:.1f} tokens/s", flush=True)
    return stats.capacity


def offered_load(http: str, health) -> float:
    """After a warm-up (a replica's first steps are slower than the rest and would inflate the step time), the
    capacity at temperature 1.5 and then greedy (last: the load starts greedy, on a window of greedy steps);
    the tokens/s to offer: 0.8 x their geometric mean, between the two capacities' targets (0.8 of each) and as far
    from either in ratio (the two must be 1.3x apart: each side at least 1.14x from its threshold)."""
    assert {complete(http, 0.0), complete(http, 1.5)} == {200}
    noisy = measured_capacity(http, health, 14.0, 1.5)  # past the replica's 10 s window: only this phase's steps
    greedy = measured_capacity(http, health, 14.0, 0.0)
    assert greedy > 1.3 * noisy, ("the premise: lower acceptance lowers a replica's capacity", greedy, noisy)
    return 0.8 * (greedy * noisy) ** 0.5
