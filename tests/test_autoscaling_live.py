"""Live autoscaling on a local cluster: lower acceptance at the same offered load adds a replica;
acceptance recovering at that load removes it again.

An open-loop client offers a fixed request rate (a counting prompt, 48 tokens each, one request a
second: 48 tokens/s). Greedy, the shipped draft accepts about 2.7 tokens per verify step on it
(measured 2.69, 59 ms steps: a modelled capacity of 90-180 tokens/s per replica): one replica
suffices. At temperature 1.5 acceptance falls to about 1.25 and steps slow to 115-165 ms (capacity
30-45 tokens/s, below the offered load), the queue grows, and the policy asks for a second replica.
At half this load (24 tokens/s) the degraded capacity was too close to the offered load and the
upscale depended on the machine's noise. Back at temperature 0, once the slow requests have
drained, one replica suffices again and Serve removes the other after ``downscale_delay_s`` (20 s
here) of that decision.
"""
from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from dspark.prepare import prepare_target
from dspark.schema import load_engine_config

from conftest import REPO

pytestmark = pytest.mark.slow
HTTP = "http://127.0.0.1:8000"


def replicas() -> int:
    from ray import serve

    status = serve.status().applications["dspark"].deployments["DSparkServer"]
    return status.replica_states.get("RUNNING", 0)


class OpenLoop:
    """Requests at a fixed rate, whatever the server's speed (a queue builds when it is too slow)."""

    def __init__(self, rate: float):
        self.interval, self.temperature, self.stop = 1.0 / rate, 0.0, threading.Event()
        self.errors, self.refused = 0, 0  # refused: 429 while the queue is full (correct under overload)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _one(self, temperature: float) -> None:
        body = {"model": "smollm2-135m-instruct", "prompt": "Count from 1 to 200: 1, 2, 3, 4, 5,",
                "max_tokens": 48, "temperature": temperature, "top_p": 1.0}
        try:
            status = requests.post(f"{HTTP}/v1/completions", json=body, timeout=300).status_code
        except requests.RequestException:
            status = None
        if status == 429:
            self.refused += 1
        elif status != 200 and not self.stop.is_set():  # requests cut off by the app's deletion do not count
            self.errors += 1

    def _run(self) -> None:
        while not self.stop.is_set():
            threading.Thread(target=self._one, args=(self.temperature,), daemon=True).start()
            self.stop.wait(self.interval)


def wait_for(predicate, timeout: float, what: str) -> float:
    start, last = time.monotonic(), 0.0
    while not predicate():
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        if time.monotonic() - last > 30:  # progress: one replica's view
            last = time.monotonic()
            print(what, requests.get(f"{HTTP}/health", timeout=30).json()["autoscaling"], flush=True)
        time.sleep(1)
    return time.monotonic() - start


def hold(count: int, seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert replicas() == count, f"expected {what}"
        time.sleep(1)


def test_degraded_acceptance_adds_a_replica_and_recovered_acceptance_removes_it(serve_instance, tmp_path):
    from ray import serve

    from deploy.ray_app import build_app

    prepare_target()
    base = load_engine_config(REPO / "configs" / "embedded.yaml")
    data = base.model_dump(exclude={"base_dir"})
    data["draft"]["path"] = str(base.resolve(base.draft.path))
    data["engine"].update(scheduler="full", max_num_seqs=4, draft_gate=False)  # drafts every round, whatever τ
    data["runtime"].update(shard_cpus=0.3, drafter_cpus=0.3, shard_threads=1, drafter_threads=1)
    data["serving"].update(load_aware_speculation=False, router_cpus=0.3, max_queued_requests=64, autoscaling={
        "min_replicas": 1, "max_replicas": 2, "target_utilisation": 0.8, "hysteresis": 0.1, "drain_horizon_s": 10,
        "downscale_cycles": 3, "metrics_interval_s": 1, "look_back_period_s": 5, "upscale_delay_s": 2,
        "downscale_delay_s": 20})
    path = tmp_path / "autoscale.yaml"
    path.write_text(json.dumps(data))
    serve.run(build_app({"config": str(path)}), name="dspark", route_prefix="/")
    load = OpenLoop(rate=1.0)  # 48 tokens/s offered
    try:
        time.sleep(25)
        assert replicas() == 1, "greedy acceptance: one replica has the capacity"
        load.temperature = 1.5  # the drafter's proposals are now accepted far less often
        waited = wait_for(lambda: replicas() == 2, 180, "a second replica")
        print(f"scaled up {waited:.0f} s after acceptance fell")
        hold(2, 30, "two replicas while acceptance stays low")
        load.temperature = 0.0  # acceptance recovers at the same offered load
        waited = wait_for(lambda: replicas() == 1, 420, "scale back to one replica")
        print(f"scaled back {waited:.0f} s after acceptance recovered")
        hold(1, 30, "one replica while acceptance stays high")  # no flapping back up
    finally:
        load.stop.set()
        errors = load.errors
        serve.delete("dspark")
    assert errors == 0
