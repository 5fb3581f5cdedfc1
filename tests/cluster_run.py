"""A multi-node Ray cluster on this machine serving an app, driven from a test (its own process: the test session
keeps its own single-node cluster).

    python tests/cluster_run.py SPEC_JSON_FILE

SPEC: {"config": engine config YAML, "http_port": int, "head": {"num_cpus": ..., "resources": {...}},
"nodes": {name: {"num_cpus": ..., "resources": {...}}}}. One raylet per node (``ray.cluster_utils.Cluster``, as Ray's
own multi-node tests), logical CPUs, a custom resource ``node:<name>`` naming each node besides the spec's. Serve's
HTTP proxy runs on the head node only (``location: HeadOnly``); the app is deployed declaratively
(``deploy.ray_app:app`` with the config as its argument, as ``serve deploy`` and KubeRay's RayService do).

Prints one JSON line per event on stdout: {"ready": {"nodes": {name: node id}}} once the app answers, then one
answer per command read from stdin (one JSON object per line):
- {"cmd": "placement"}: {"placement": [{"bundles": {index: node id}, "strategy": ...}]} for every placement group,
  from Ray's placement group table;
- {"cmd": "deploy", "config": path}: the app deleted and ``config`` deployed in its place on the same cluster;
  {"deployed": true} once it answers;
- {"cmd": "scale", "replicas": n}: the engine deployment's replica count set to ``n`` by a lightweight config
  update (as KubeRay applies a changed ``serveConfigV2``: the other replicas and the front door keep running, a
  replica scaled away is drained with its grace period); {"scaled": n} at once;
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
from ray.serve.context import _get_global_client
from ray.serve.schema import ServeDeploySchema

ENGINE = "DSparkServer"  # the engine deployment's name, with or without a front door of its own


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


def deploy(port: int, config: str, replicas: int | None = None) -> None:
    """``config`` as the app ``dspark``; ``replicas``: the engine deployment's count, overriding the config's."""
    app = {"name": "dspark", "route_prefix": "/", "import_path": "deploy.ray_app:app", "args": {"config": config},
           "deployments": [{"name": ENGINE, "num_replicas": replicas}] if replicas is not None else []}
    _get_global_client().deploy_apps(ServeDeploySchema(
        proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port}, applications=[app]))


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    cluster = Cluster(initialize_head=True, head_node_args=node_args("head", spec.get("head", {})))
    nodes = {"head": cluster.head_node}
    for name, node_spec in spec["nodes"].items():
        nodes[name] = cluster.add_node(**node_args(name, node_spec))
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": spec["http_port"], "location": "HeadOnly"})
    config = spec["config"]
    deploy(spec["http_port"], config)
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
            config = command["config"]
            deploy(spec["http_port"], config)
            wait_healthy(spec["http_port"])
            say(deployed=True)
        elif command["cmd"] == "scale":
            deploy(spec["http_port"], config, command["replicas"])
            say(scaled=command["replicas"])
        elif command["cmd"] == "remove_node":  # its raylet and every process on it killed, as a lost host
            cluster.remove_node(nodes.pop(command["name"]), allow_graceful=False)
            say(removed=command["name"])
        elif command["cmd"] == "add_node":  # a node joining the running cluster, as KubeRay adds a worker pod
            nodes[command["name"]] = cluster.add_node(**node_args(command["name"], command.get("spec", {})))
            cluster.wait_for_nodes()
            say(added=nodes[command["name"]].node_id)
        elif command["cmd"] == "replicas":  # the engine deployment's replicas by state, as Serve reports them
            deployments = serve.status().applications["dspark"].deployments
            engine = deployments[ENGINE]
            say(replicas={getattr(state, "value", str(state)): count for state, count in engine.replica_states.items()})
        elif command["cmd"] == "stop":
            break
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()
    say(stopped=True)


if __name__ == "__main__":
    main()
