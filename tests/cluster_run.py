"""A multi-node Ray cluster on this machine serving an app, driven from a test (its own process: the test session
keeps its own single-node cluster).

    python tests/cluster_run.py SPEC_JSON_FILE

SPEC: {"config": engine config YAML, "http_port": int, "head": {"num_cpus": ..., "resources": {...}},
"nodes": {name: {"num_cpus": ..., "resources": {...}}}}. One raylet per node (``ray.cluster_utils.Cluster``, as Ray's
own multi-node tests), logical CPUs, a custom resource ``node:<name>`` naming each node besides the spec's. Serve's
HTTP proxy runs on the head node only (``location: HeadOnly``); ``deploy.ray_app`` deploys the config.

Prints one JSON line per event on stdout: {"ready": {"nodes": {name: node id}}} once the app answers, then one
answer per command read from stdin (one JSON object per line):
- {"cmd": "placement"}: {"placement": [{"bundles": {index: node id}, "strategy": ...}]} for every placement group,
  from Ray's placement group table;
- {"cmd": "deploy", "config": path}: the app deleted and ``config`` deployed in its place on the same cluster;
  {"deployed": true} once it answers;
- {"cmd": "remove_node", "name": name}: that node's raylet and processes killed; {"removed": name};
- {"cmd": "add_node", "name": name, "spec": {"num_cpus": ..., "resources": {...}}}: a node added; {"added": id};
- {"cmd": "replicas"}: {"replicas": {state: count}} of the engine deployment (``DSparkServer``);
- {"cmd": "stop"}: Serve shut down, the cluster stopped, the script exits.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request

import ray
from ray import serve
from ray.cluster_utils import Cluster

from deploy.ray_app import build_app


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def node_args(name: str, spec: dict) -> dict:
    return {"num_cpus": spec.get("num_cpus", 1), "resources": {f"node:{name}": 1, **spec.get("resources", {})}}


def wait_healthy(port: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as reply:
                if json.loads(reply.read()).get("status") == "ok":
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the app did not answer /health within {timeout_s:g} s")
        time.sleep(0.5)


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    cluster = Cluster(initialize_head=True, head_node_args=node_args("head", spec.get("head", {})))
    nodes = {"head": cluster.head_node}
    for name, node_spec in spec["nodes"].items():
        nodes[name] = cluster.add_node(**node_args(name, node_spec))
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": spec["http_port"], "location": "HeadOnly"})
    serve.run(build_app({"config": spec["config"]}), name="dspark", route_prefix="/", blocking=False)
    wait_healthy(spec["http_port"])
    say(ready={"nodes": {name: node.node_id for name, node in nodes.items()}})
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "placement":
            table = ray.util.placement_group_table()
            say(placement=[{"bundles": pg["bundles_to_node_id"],
                            "strategy": pg["strategy"], "state": pg["state"]} for pg in table.values()])
        elif command["cmd"] == "deploy":
            serve.delete("dspark")  # its replicas and their actors gone before the new app asks for their nodes
            serve.run(build_app({"config": command["config"]}), name="dspark", route_prefix="/", blocking=False)
            wait_healthy(spec["http_port"])
            say(deployed=True)
        elif command["cmd"] == "remove_node":  # its raylet and every process on it killed, as a lost host
            cluster.remove_node(nodes.pop(command["name"]), allow_graceful=False)
            say(removed=command["name"])
        elif command["cmd"] == "add_node":  # a node joining the running cluster, as KubeRay adds a worker pod
            nodes[command["name"]] = cluster.add_node(**node_args(command["name"], command.get("spec", {})))
            cluster.wait_for_nodes()
            say(added=nodes[command["name"]].node_id)
        elif command["cmd"] == "replicas":  # the engine deployment's replicas by state, as Serve reports them
            deployments = serve.status().applications["dspark"].deployments
            engine = deployments.get("DSparkServer") or next(iter(deployments.values()))
            say(replicas={getattr(state, "value", str(state)): count for state, count in engine.replica_states.items()})
        elif command["cmd"] == "stop":
            break
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()
    say(stopped=True)


if __name__ == "__main__":
    main()
