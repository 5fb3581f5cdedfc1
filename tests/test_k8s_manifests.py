"""The KubeRay manifests in k8s/ validate offline, and each kind of breakage is caught by name."""

from __future__ import annotations

import copy

import pytest
import yaml

from deploy.manifest_check import load_schema, main, validate, validate_file

from conftest import REPO

MANIFESTS = sorted((REPO / "k8s").glob("*/rayservice.yaml"))
GPU = REPO / "k8s" / "kimi-b300" / "rayservice.yaml"



@pytest.fixture(scope="module")
def schema():
    return load_schema()


@pytest.fixture
def gpu_doc():
    return yaml.safe_load(GPU.read_text())


def test_every_manifest_is_valid(schema):
    assert len(MANIFESTS) >= 2
    for path in MANIFESTS:
        assert validate_file(path, schema) == [], path
    assert main([str(p) for p in MANIFESTS]) == 0


def test_gpu_manifest_is_the_seeds_deployment(gpu_doc):
    spec = gpu_doc["spec"]
    workers = spec["rayClusterConfig"]["workerGroupSpecs"][0]
    container = workers["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["serve"] == 8000 and ports["serve-grpc"] == 9000
    serve = yaml.safe_load(spec["serveConfigV2"])
    assert serve["applications"][0]["args"]["config"] == "configs/kimi-k3.1-pro-b300.yaml"
    assert serve["grpc_options"]["port"] == 9000
    front = spec["rayClusterConfig"]["workerGroupSpecs"][1]  # the front door on pods that hold no engine replica
    assert front["groupName"] == "front-door" and "dspark_front_door" in front["rayStartParams"]["resources"]
    assert "dspark_front_door" not in workers["rayStartParams"]["resources"]


def _serve(doc, edit):
    config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    edit(config)
    doc["spec"]["serveConfigV2"] = yaml.safe_dump(config)


def _workers(doc):
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


BROKEN = {
    "name-too-long": (lambda d: d["metadata"].__setitem__("name", "k" * 48), "longer than 47"),
    "name-not-dns1035": (lambda d: d["metadata"].__setitem__("name", "Kimi_K3"), "DNS-1035"),
    "upgrade-type": (lambda d: d["spec"]["upgradeStrategy"].__setitem__("type", "BlueGreen"),
                     "spec.upgradeStrategy.type"),
    "min-above-max": (lambda d: _workers(d).update(minReplicas=5), "minReplicas 5 > maxReplicas 4"),
    "no-serve-port": (lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
                      .__setitem__("ports", [{"containerPort": 8265, "name": "dashboard"}]), "no port named 'serve'"),
    "unknown-field": (lambda d: d["spec"]["rayClusterConfig"].__setitem__("workerGroupSpec", []),
                      "spec.rayClusterConfig.workerGroupSpec: unknown field"),
    "unknown-nested-field": (lambda d: _workers(d)["template"]["spec"]["containers"][0].__setitem__("imagePullPolicies",
                                                                                                   "Always"),
                             "imagePullPolicies: unknown field"),
    "wrong-type": (lambda d: _workers(d).__setitem__("replicas", "two"), "replicas: must be integer"),
    "ray-actor-options-typo": (lambda d: _serve(d, lambda c: c["applications"][0].__setitem__(
        "deployments", [{"name": "DSparkServer", "ray_actor_options": {"num_gpu": 1}}])), "ray_actor_options.num_gpu"),
    "serve-schema": (lambda d: _serve(d, lambda c: c["applications"][0].pop("import_path")), "Ray Serve refuses"),
    "serve-not-yaml": (lambda d: d["spec"].__setitem__("serveConfigV2", "applications: [\n  - name: x"), "not YAML"),
    "servicer-missing": (lambda d: _serve(d, lambda c: c["grpc_options"]["grpc_servicer_functions"].append(
        "dspark.v1.serving_pb2_grpc.add_Nope_to_server")), "cannot be imported"),
    "engine-config-missing": (lambda d: _serve(d, lambda c: c["applications"][0]["args"].__setitem__(
        "config", "configs/nope.yaml")), "no such file"),
    "replica-does-not-fit": (lambda d: _workers(d)["template"]["spec"]["containers"][0]["resources"].update(
        limits={"cpu": "112", "memory": "1600Gi", "nvidia.com/gpu": "4"},
        requests={"cpu": "112", "memory": "1600Gi", "nvidia.com/gpu": "4"}), "no pod group offers that"),
    "too-few-nodes": (lambda d: _workers(d).update(maxReplicas=2), "at most 2"),
    "replica-resource-not-advertised": (lambda d: _workers(d)["rayStartParams"].pop("resources"),
                                        "8 GPU, 1 dspark_replica on one pod; no pod group offers that"),
    "incremental-without-autoscaler": (lambda d: d["spec"]["rayClusterConfig"].__setitem__(
        "enableInTreeAutoscaling", False), "needs the Ray autoscaler"),
    "port-name-too-long": (lambda d: _workers(d)["template"]["spec"]["containers"][0]["ports"].append(
        {"containerPort": 9100, "name": "serve-grpc-secondary"}), "IANA service name"),
    "bad-quantity": (lambda d: _workers(d)["template"]["spec"]["containers"][0]["resources"]["limits"].__setitem__(
        "memory", "lots"), "does not match"),
    "managed-by": (lambda d: d["spec"].__setitem__("managedBy", "me"), "managedBy field value"),
    # the front door's own pods (serving.front_door: deployment)
    "front-door-without-pods": (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"].pop(1),
                                "a front door replica (serving.front_door: deployment) needs 4 CPU, 1 "
                                "dspark_front_door on one pod; no pod group offers that"),
    "front-door-beside-replicas": (lambda d: _workers(d)["rayStartParams"].__setitem__(
        "resources", '{"dspark_replica": 1, "dspark_front_door": 1}'), "of b300, which also hold engine replicas"),
    "too-few-front-door-pods": (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][1].update(
        replicas=1, minReplicas=1, maxReplicas=1), "front_door_replicas is 2 but the pod groups hold at most 1"),
    # exposure
    "dashboard-open-without-token": (lambda d: d["spec"]["rayClusterConfig"].pop("authOptions"),
                                     "exposes Ray's job API"),
    "grpc-reflection-on": (lambda d: _serve(d, lambda c: c["grpc_options"].pop("enable_reflection")),
                           "enable_reflection: must be false"),
    "grpc-message-cap-unset": (lambda d: _workers(d)["template"]["spec"]["containers"][0].__setitem__(
        "env", [{"name": "DSPARK_CACHE", "value": "/models/cache"}]), "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE unset"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_variant_is_caught(schema, gpu_doc, case):
    breakage, expected = BROKEN[case]
    assert validate(copy.deepcopy(gpu_doc), schema) == []
    breakage(gpu_doc)
    errors = validate(gpu_doc, schema)
    assert any(expected in e for e in errors), errors


def test_a_config_without_key_or_consent_is_caught(schema, gpu_doc, tmp_path):
    config = (REPO / "configs" / "kimi-k3.1-pro-b300.yaml").read_text()
    keyless = tmp_path / "keyless.yaml"
    keyless.write_text(config.replace("api_key_file: /etc/dspark/api-key/key", "api_key_env: DSPARK_API_KEY"))
    _serve(gpu_doc, lambda c: c["applications"][0]["args"].__setitem__("config", str(keyless)))
    errors = validate(gpu_doc, schema)
    assert any("allow_unauthenticated" in e for e in errors), errors


def test_defaults_are_applied_before_validation(schema, gpu_doc):
    """maxSurgePercent has a schema default (100): the incremental-upgrade rule sees it, as the operator would."""
    del gpu_doc["spec"]["upgradeStrategy"]["clusterUpgradeOptions"]["maxSurgePercent"]
    assert validate(gpu_doc, schema) == []
    gpu_doc["spec"]["upgradeStrategy"]["clusterUpgradeOptions"]["maxSurgePercent"] = 101
    assert any("maxSurgePercent" in e for e in validate(gpu_doc, schema))


def test_cli_fails_on_a_broken_file(tmp_path, gpu_doc, capsys):
    gpu_doc["metadata"]["name"] = "x" * 60
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(gpu_doc))
    assert main([str(bad)]) == 1
    assert "FAIL" in capsys.readouterr().out
