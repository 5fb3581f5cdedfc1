"""Serving across Ray nodes: a 3-node cluster on this machine (``tests/cluster_run.py``: one raylet per node, logical
CPUs), the embedded default on the native engine, two replicas steered by custom resources (``runtime.
replica_resources``: each engine node holds one replica; ``runtime.drafter_resources``: the drafter actors on a node
of their own); then, on the same cluster, one vLLM replica whose DSpark head drafts in the drafter actor on the
drafter node (``engine.vllm_drafter: actor``); then the front door as a deployment of its own in front of two engine
replicas, one drained by a scale-down under 8 streams and then the other's node removed under 8 more (carried over,
nothing lost); then the acceptance autoscaler keeping one replica while acceptance is high and starting the second
on a node added at run time when it falls (native engine, its own prompt lookup). Where everything runs is read from
Ray: each actor's node as its own runtime context reports it in ``/health``, checked against Ray's placement group
table. On one host this proves placement and addressing (the hidden states cross between raylets over gloo's TCP on
the host's address), not a real network."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from dspark.builder import build_engine
from dspark.config import SamplingParams
from dspark.loader import encode_prompt, load_tokenizer
from dspark.schema import load_engine_config, write_variant
from dspark.training.prepare import prepare_target

from acceptance_load import MAX_TOKENS as ACCEPTANCE_TOKENS
from acceptance_load import NATIVE_ENGINE, RUNTIME, SERVING, OpenLoop, offered_load
from conftest import REPO, benchmark_prompts, free_port, holds, wait_for
from vllm_runs import MAX_TOKENS as VLLM_MAX_TOKENS
from vllm_runs import shared_texts

pytestmark = pytest.mark.slow
PROMPTS, MAX_TOKENS = 20, 12
VLLM_PROMPTS = 2  # of the shared chat prompts, against the session's plain vLLM run of them
CARRIED_TOKENS = 32  # per stream in the node-removal test: long enough to be mid-stream when the node goes
DRAINED_TOKENS, DRAIN_GRACE_S = 48, 1.0  # the drain test's streams outlast the drained replica's grace period
GREEDY_HOLD_S = 10  # the autoscaling test: one replica kept this long at the offered load while acceptance is high
NODES = {"a": {"num_cpus": 2, "resources": {"dspark_replica": 1}},
         "b": {"num_cpus": 2, "resources": {"dspark_replica": 1}},
         "c": {"num_cpus": 2, "resources": {"dspark_drafter": 2}}}


class ClusterRun:
    """``tests/cluster_run.py`` in its own process: commands in, one JSON event per line out."""

    def __init__(self, tmp: Path, config: Path, nodes: dict):
        self.port = free_port()
        spec = tmp / "cluster.json"
        head = {"num_cpus": 1, "resources": {"dspark_front_door": 1}}  # the proxy, and a split front door
        spec.write_text(json.dumps({"config": str(config), "http_port": self.port, "head": head, "nodes": nodes}))
        self.log = open(tmp / "cluster.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cluster_run.py")), str(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     cwd=REPO)
        self.http = f"http://127.0.0.1:{self.port}"
        self.nodes = self._event("ready", timeout_s=600)["nodes"]

    def _event(self, key: str, timeout_s: float = 120) -> dict:
        found: dict = {}

        def read() -> None:
            for line in self.proc.stdout:
                if line.startswith("{"):
                    event = json.loads(line)
                    if key in event:
                        found["value"] = event[key]
                        return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if "value" not in found:
            self.log.flush()
            tail = Path(self.log.name).read_text()[-3000:]
            raise AssertionError(f"cluster_run.py gave no {key!r} within {timeout_s:g} s: {tail}")
        return found["value"]

    def command(self, key: str, timeout_s: float = 120, **command):
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._event(key, timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.command("stopped", cmd="stop")
                self.proc.wait(timeout=60)
            except (AssertionError, subprocess.TimeoutExpired, BrokenPipeError):
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def native_cluster(tmp_path_factory):
    prepare_target()
    tmp = tmp_path_factory.mktemp("multinode")
    config = write_variant(
        load_engine_config(REPO / "configs" / "embedded.yaml"), tmp / "native.yaml",
        target={"dtype": "bfloat16"}, draft={"dtype": "bfloat16"},
        engine={"backend": "native", "scheduler": "full", "draft_gate": False, "max_num_seqs": 4},
        serving={"num_replicas": 2, "load_aware_speculation": False},
        runtime={"placement_strategy": "PACK", "replica_resources": {"dspark_replica": 1},
                 "drafter_resources": {"dspark_drafter": 1}, "shard_threads": 1, "drafter_threads": 1})
    run = ClusterRun(tmp, config, NODES)
    try:
        yield run, load_engine_config(config)
    finally:
        run.stop()


def replica_healths(http: str, replicas: int) -> dict[str, dict]:
    """/health of every engine replica (each call answers from one; ask until each has answered), by replica."""
    seen: dict[str, dict] = {}

    def ask() -> dict:
        health = requests.get(f"{http}/health", timeout=30).json()
        seen[health["replica"]] = health
        return seen

    return wait_for(ask, 120, f"{replicas} replicas to answer /health", until=lambda s: len(s) >= replicas,
                    interval_s=0.05)


def test_replicas_and_drafters_run_where_placement_puts_them(native_cluster):
    """Two replicas on the two replica nodes, each replica's target shard beside it and its drafter actor on the
    drafter node: as the actors report their own nodes, and as Ray's placement group table has the bundles."""
    run, _ = native_cluster
    ids = run.nodes
    healths = replica_healths(run.http, 2)
    where = [health["nodes"] for health in healths.values()]
    assert sorted(w["replica"] for w in where) == sorted([ids["a"], ids["b"]]), (where, ids)
    for w in where:
        assert w["target_shards"] == [w["replica"]]  # packed with its replica (no custom resource of its own)
        assert w["drafter"] == ids["c"] != w["target_shards"][0]  # the card's separate actors, on another node
    groups = [g for g in run.command("placement", cmd="placement") if g["state"] == "CREATED"]
    bundles = sorted((g["bundles"]["0"], g["bundles"]["1"], g["bundles"]["2"]) for g in groups)  # JSON: str keys
    assert bundles == sorted((w["replica"], w["target_shards"][0], w["drafter"]) for w in where)


def test_greedy_output_across_nodes_equals_plain_decoding(native_cluster):
    """20 greedy prompts spread over both replicas (4 at a time): each reply equals plain decoding of the same
    engine and dtype (native, bf16: batch-invariant kernels), and both replicas served some."""
    run, config = native_cluster
    prompts = benchmark_prompts("humaneval", PROMPTS // 2) + benchmark_prompts("gsm8k", PROMPTS - PROMPTS // 2)

    def ask(text: str) -> tuple[str, str, dict]:
        reply = requests.post(f"{run.http}/v1/completions", timeout=300, json={
            "model": config.name, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        return body["choices"][0]["text"], reply.headers["x-dspark-replica"], body["spec"]

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, prompts))
    plain = build_engine(config, speculate=False, backend="native")  # batch-invariant: one batch is each alone
    expected = plain.generate([encode_prompt(plain.tokenizer, text, chat=False) for text in prompts],
                              SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for text, (served, _, _), reference in zip(prompts, replies, expected):
        assert served == plain.tokenizer.decode(reference.token_ids, skip_special_tokens=True), text[:60]
    assert len({replica for _, replica, _ in replies}) == 2
    assert sum(spec["accepted_tokens"] for _, _, spec in replies) > 0  # the drafters across the node drafted


def test_the_vllm_replicas_drafter_actor_runs_on_another_node_and_replies_as_plain_vllm(native_cluster,
                                                                                      plain_vllm_fp32, tmp_path):
    """The vLLM backend on the same cluster (the native app replaced): one replica on a replica node, vLLM's engine
    in it, our DSpark head in the drafter actor on the drafter node, fed the target's hidden states across the
    raylets over gloo. Its greedy chat replies equal offline plain vLLM's (fp32, the same engine settings), and the
    head drafted."""
    run, _ = native_cluster
    config = write_variant(
        load_engine_config(REPO / "configs" / "embedded.yaml"), tmp_path / "vllm.yaml",
        target={"dtype": "float32"}, draft={"dtype": "float32"},
        engine={"backend": "vllm", "vllm_speculation": "dspark_plugin", "vllm_drafter": "actor", "max_num_seqs": 8,
                "scheduler": "full", "draft_gate": False, "draft_sources": "head"},
        serving={"num_replicas": 1, "load_aware_speculation": False},
        runtime={"placement_strategy": "PACK", "replica_resources": {"dspark_replica": 1},
                 "drafter_resources": {"dspark_drafter": 1}, "drafter_threads": 1})
    run.command("deployed", cmd="deploy", config=str(config), timeout_s=600)
    where = next(iter(replica_healths(run.http, 1).values()))["nodes"]
    assert where["replica"] in (run.nodes["a"], run.nodes["b"]) and where["drafter"] == run.nodes["c"], where
    served = load_engine_config(config)
    tokenizer = load_tokenizer(served.resolve(served.target.path))
    accepted = 0
    for text, reference in zip(shared_texts(VLLM_PROMPTS), plain_vllm_fp32["outputs"]):
        reply = requests.post(f"{run.http}/v1/chat/completions", timeout=300, json={
            "model": served.name, "messages": [{"role": "user", "content": text}],
            "max_tokens": VLLM_MAX_TOKENS, "temperature": 0})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["message"]["content"] == tokenizer.decode(reference, skip_special_tokens=True)
        accepted += body["spec"]["accepted_tokens"]
    assert accepted > 0  # the head drafted from across the node, and its drafts were verified


def stream(http: str, body: dict, chunks: list[str]) -> dict:
    """One streamed completion (``messages`` in ``body``: a chat completion): its text pieces appended to ``chunks``
    as they arrive; the final chunk (finish reason, spec, usage) returned, or the in-band error."""
    final: dict = {}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with requests.post(f"{http}{path}", json={**body, "stream": True}, stream=True, timeout=600) as reply:
        assert reply.status_code == 200, reply.text
        for line in reply.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return chunk
            for choice in chunk.get("choices", []):
                chunks.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                if choice.get("finish_reason"):
                    final = chunk
    return final


@pytest.fixture(scope="module")
def split_app(native_cluster, tmp_path_factory):
    """The front door in its own deployment on the head node (``serving.front_door: deployment``) in front of two
    engine replicas, one on each replica node, their drafters on the drafter node; a replica being stopped keeps
    decoding for ``DRAIN_GRACE_S``."""
    run, _ = native_cluster
    config = write_variant(
        load_engine_config(REPO / "configs" / "embedded.yaml"), tmp_path_factory.mktemp("split") / "split.yaml",
        target={"dtype": "bfloat16"}, draft={"dtype": "bfloat16"},
        engine={"backend": "native", "max_num_seqs": 8},
        serving={"num_replicas": 2, "load_aware_speculation": False, "front_door": "deployment",
                 "front_door_resources": {"dspark_front_door": 1}, "front_door_cpus": 0.5,
                 "drain_grace_s": DRAIN_GRACE_S},
        runtime={"placement_strategy": "PACK", "replica_resources": {"dspark_replica": 1},
                 "drafter_resources": {"dspark_drafter": 1}, "shard_threads": 1, "drafter_threads": 1})
    run.command("deployed", cmd="deploy", config=str(config), timeout_s=600)
    served = load_engine_config(config)
    return run, served, build_engine(served, speculate=False, backend="native")


def carried_streams(run: ClusterRun, served, plain, tokens: int, during) -> None:
    """8 streams (4 greedy, 4 sampled) through the front door; ``during()`` once every stream has sent its first
    tokens and none has ended. Then: 8/8 complete, none with an error; each greedy stream's text equals plain
    decoding of the same engine and dtype (nothing missing, nothing repeated); each sampled one has all its tokens."""
    texts = benchmark_prompts("humaneval", 4)  # code, and (sampled) long stories: no early end
    bodies = [{"model": served.name, "prompt": text, "max_tokens": tokens, "temperature": 0} for text in texts]
    bodies += [{"model": served.name, "messages": [{"role": "user", "content": f"Write a long story about {topic}."}],
                "max_tokens": tokens, "temperature": 1.0, "top_p": 0.95}
               for topic in ("a lighthouse keeper", "a mountain railway", "a glassblower", "a river pilot")]
    chunks: list[list[str]] = [[] for _ in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        finals = [pool.submit(stream, run.http, body, pieces) for body, pieces in zip(bodies, chunks)]
        wait_for(lambda: [len(pieces) for pieces in chunks], 300, "every stream's first tokens",
                 until=lambda seen: all(n >= 2 for n in seen))
        ended = [(body, f.result()) for body, f in zip(bodies, finals) if f.done()]
        assert not ended, ended  # every stream still running when its replica goes
        during()
        finals = [f.result(timeout=600) for f in finals]
    assert all("error" not in final and final["choices"][0]["finish_reason"] for final in finals), finals
    expected = plain.generate([encode_prompt(plain.tokenizer, text, chat=False) for text in texts],
                              SamplingParams(max_tokens=tokens, temperature=0.0))
    for pieces, reference in zip(chunks, expected):
        assert "".join(pieces) == plain.tokenizer.decode(reference.token_ids, skip_special_tokens=True)
    for final, pieces in zip(finals[len(texts):], chunks[len(texts):]):
        assert final["usage"]["completion_tokens"] == tokens or final["choices"][0]["finish_reason"] == "stop"
        assert "".join(pieces)


def carry_overs(http: str) -> float:
    """``dspark:request_carry_overs_total`` in the front door's /metrics."""
    metrics = requests.get(f"{http}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("dspark:request_carry_overs_total"))


def engine_replicas(run: ClusterRun) -> dict[str, int]:
    return run.command("replicas", cmd="replicas")


def test_a_drained_replica_hands_its_requests_over(split_app):
    """Two engine replicas behind the front door, 8 streams over them; the engine deployment is scaled down to one
    replica by a lightweight config update (as KubeRay applies a changed serveConfigV2, or the autoscaler decides):
    Serve drains a replica, which keeps decoding for its grace period (``serving.drain_grace_s``) and is then
    stopped with streams still running. Its requests are carried over to the other replica: 8/8 complete, greedy
    equal to plain decoding, the carry-overs counted; the front door and the other replica were never restarted."""
    run, served, plain = split_app
    before = replica_healths(run.http, 2)
    front = next(iter(before.values()))["front_door"]["replica"]
    carried = carry_overs(run.http)
    carried_streams(run, served, plain, DRAINED_TOKENS, lambda: run.command("scaled", cmd="scale", replicas=1))
    wait_for(lambda: engine_replicas(run), 120, "one engine replica left",
             until=lambda states: states == {"RUNNING": 1}, interval_s=0.5)
    (kept, health), = replica_healths(run.http, 1).items()
    assert kept in before and health["front_door"]["replica"] == front  # nothing else was restarted
    assert 1 <= carry_overs(run.http) - carried <= 8  # the drained replica's streams, carried over


def test_a_removed_node_loses_no_request(split_app):
    """One engine replica behind the front door (after the drain above), its drafter on the drafter node; 8 streams
    (4 greedy, 4 sampled) run on it and its node is removed mid-stream (raylet and processes killed, as a lost host).
    Serve starts a replacement on the other replica node, and the front door carries every request over to it with
    the prompt plus the tokens already sent: 8/8 streams complete, greedy equal to plain decoding, each stream
    carried over once, counted in /metrics and /health. Last of the native app: the node stays removed."""
    run, served, plain = split_app
    run.command("scaled", cmd="scale", replicas=1)  # as the drain above left it (a no-op after it)
    wait_for(lambda: engine_replicas(run), 120, "one engine replica", until=lambda states: states == {"RUNNING": 1},
             interval_s=0.5)
    health = next(iter(replica_healths(run.http, 1).values()))
    where, front = health["nodes"], health["front_door"]
    assert front["node"] == run.nodes["head"] and where["drafter"] == run.nodes["c"], (front, where)
    lost = next(name for name in ("a", "b") if run.nodes[name] == where["replica"])
    carried = carry_overs(run.http)
    carried_streams(run, served, plain, CARRIED_TOKENS,
                    lambda: run.command("removed", cmd="remove_node", name=lost, timeout_s=120))
    after = next(iter(replica_healths(run.http, 1).values()))
    assert after["nodes"]["replica"] != where["replica"]  # the replacement, on the other replica node
    now = carry_overs(run.http)
    assert now - carried >= 8 and after["front_door"]["carry_overs"] == now, (now, carried, after["front_door"])


def test_degraded_acceptance_adds_a_replica_on_a_node_added_at_run_time(native_cluster, tmp_path):
    """The acceptance-driven autoscaler (``tests/acceptance_load.py``'s load, on the native engine) on this cluster
    after the node removal above: one replica node is left, and each replica asks for its ``dspark_replica`` resource.
    At greedy acceptance one replica carries the offered load (no second one is asked for); when acceptance falls
    (temperature 1.5, same request rate) the policy asks for a second replica, which has nowhere to start until a
    node is added while the app runs (as KubeRay's autoscaler adds a worker pod); it starts there. When the load ends
    Serve removes a replica again."""
    run, _ = native_cluster
    config = write_variant(
        load_engine_config(REPO / "configs" / "embedded.yaml"), tmp_path / "autoscaled.yaml",
        target={"dtype": "float32"}, draft={"dtype": "float32"}, engine=NATIVE_ENGINE,
        serving=SERVING, runtime={**RUNTIME, "replica_resources": {"dspark_replica": 1}})
    run.command("deployed", cmd="deploy", config=str(config), timeout_s=600)

    def health() -> dict:
        return requests.get(f"{run.http}/health", timeout=30).json()

    first = health()["nodes"]["replica"]
    offered = offered_load(run.http, health)
    load = OpenLoop(run.http, rate=offered / ACCEPTANCE_TOKENS)  # greedy: lookup's drafts are accepted
    try:
        holds(lambda: engine_replicas(run), GREEDY_HOLD_S, "one replica while acceptance is high",
              until=lambda states: states == {"RUNNING": 1})
        load.temperature = 1.5  # the same request rate; lookup's proposals now find nothing to draft
        wait_for(lambda: engine_replicas(run), 180, "Serve to ask for a second replica",
                 until=lambda states: sum(states.values()) >= 2 and states.get("RUNNING", 0) == 1, interval_s=1)
        added = run.command("added", cmd="add_node", name="d",
                            spec={"num_cpus": 2, "resources": {"dspark_replica": 1}}, timeout_s=180)
        wait_for(lambda: engine_replicas(run), 300, "the second replica running",
                 until=lambda states: states.get("RUNNING", 0) == 2, interval_s=1)
        nodes = {h["nodes"]["replica"] for h in replica_healths(run.http, 2).values()}
        assert nodes == {first, added}, (nodes, first, added)
    finally:
        load.stop.set()
    assert load.errors == 0
    wait_for(lambda: engine_replicas(run), 300, "one replica again once the load ended",
             until=lambda states: states == {"RUNNING": 1}, interval_s=1)
