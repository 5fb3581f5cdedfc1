"""Offline validation of the KubeRay manifests in ``k8s/``: what the API server, the KubeRay operator
and Ray Serve would refuse, found before anything is applied.

    python -m deploy.manifest_check k8s/*/rayservice.yaml [--schema deploy/schemas/rayservice_v1_openapiv3.json]

Four layers, each reporting ``path: message``:
1. the RayService v1 OpenAPI schema (structural, as the API server checks a CRD): defaults applied
   first, then types, enums, patterns, required fields, and unknown fields as errors (``kubectl
   apply --validate=strict``), plus the schema's CEL rules that apply on create;
2. KubeRay's own rules (``ValidateRayServiceMetadata`` / ``ValidateRayServiceSpec``): name at most 47
   characters and a DNS-1035 label, upgrade type, incremental-upgrade options, worker-group bounds,
   rayStartParams vs group resources, a head container with a port named ``serve``;
3. ``serveConfigV2`` through Ray Serve's own ``ServeDeploySchema``, with ``ray_actor_options`` keys
   checked against Ray's (its schema silently drops typos such as ``num_gpu``) and gRPC servicer
   functions imported;
4. this project's configs: an application built by ``deploy.ray_app`` names an engine config that
   loads, one replica (router + target shards + drafter) fits a worker pod, and Serve's
   ``max_replicas`` replicas fit the worker group's ``maxReplicas`` pods;
5. exposure: Ray's dashboard (its job API runs code) either bound to loopback or behind Ray's token
   authentication (``rayClusterConfig.authOptions.mode: token``; KubeRay submits ``serveConfigV2``
   through the head service's dashboard port, so a RayService cannot bind it to loopback); gRPC
   reflection off; every Ray container caps gRPC messages (``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE``, Serve's
   default is 2 GiB); an application's engine config has an API key or says
   ``serving.allow_unauthenticated: true``.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib
import json
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SCHEMA = REPO / "deploy" / "schemas" / "rayservice_v1_openapiv3.json"
MAX_RAYSERVICE_NAME = 47  # KubeRay: MaxRayServiceNameLength
UPGRADE_TYPES = ("NewCluster", "NewClusterWithIncrementalUpgrade", "None")
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
IANA_SVC_NAME = re.compile(r"^(?=.*[a-z])(?!.*--)[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?$")
INT32 = (-(2**31), 2**31 - 1)


# ---------------------------------------------------------------------------- layer 1: the CRD schema
def apply_defaults(value, schema: dict):
    """Fill defaults the way the API server does for structural schemas (only inside present objects)."""
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                apply_defaults(value[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                apply_defaults(value[key], extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(item, schema["items"])
    return value


def _type_ok(value, kind: str) -> bool:
    return {
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
    }.get(kind, True)


def _cel(value, rule: str) -> bool | None:
    """The CEL rule forms this CRD uses: ``self in [...]``; transition rules (oldSelf) do not apply on create."""
    if "oldSelf" in rule:
        return True
    match = re.fullmatch(r"self in (\[.*\])", rule.strip())
    return value in ast.literal_eval(match[1]) if match else None


def check_schema(value, schema: dict, path: str, errors: list[str]) -> None:
    if value is None:
        if not schema.get("nullable"):
            errors.append(f"{path}: null is not allowed")
        return
    if schema.get("x-kubernetes-int-or-string"):
        if not (_type_ok(value, "integer") or isinstance(value, str)):
            errors.append(f"{path}: must be an integer or a string, got {type(value).__name__}")
            return
    elif "anyOf" in schema:
        if not any(_type_ok(value, s.get("type", "")) for s in schema["anyOf"]):
            errors.append(f"{path}: matches none of {[s.get('type') for s in schema['anyOf']]}")
            return
    kind = schema.get("type")
    if kind and not _type_ok(value, kind):
        errors.append(f"{path}: must be {kind}, got {type(value).__name__} {value!r}"[:200])
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']} characters")
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{path}: shorter than {schema['minLength']} characters")
    if _type_ok(value, "number"):
        if schema.get("format") == "int32" and not INT32[0] <= value <= INT32[1]:
            errors.append(f"{path}: {value} does not fit int32")
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} is below the minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} is above the maximum {schema['maximum']}")
    for rule in schema.get("x-kubernetes-validations", []):
        verdict = _cel(value, rule["rule"])
        if verdict is None:
            errors.append(f"{path}: cannot evaluate the CEL rule {rule['rule']!r} offline")
        elif not verdict:
            errors.append(f"{path}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}.{key}: required")
        for key, item in value.items():
            if props is not None and key in props:
                check_schema(item, props[key], f"{path}.{key}", errors)
            elif isinstance(extra, dict):
                check_schema(item, extra, f"{path}.{key}", errors)
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields") and extra is not True:
                errors.append(f"{path}.{key}: unknown field")
    elif isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} items")
        for index, item in enumerate(value):
            check_schema(item, schema.get("items", {}), f"{path}[{index}]", errors)


# ---------------------------------------------------------------------------- layer 2: KubeRay's rules
def _int(value, default):
    """An integer field, or ``default`` when absent or mistyped (the schema layer reports the type)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _containers(group: dict) -> list[dict]:
    return ((group.get("template") or {}).get("spec") or {}).get("containers") or []


def check_kuberay(doc: dict, errors: list[str]) -> None:
    name = (doc.get("metadata") or {}).get("name", "")
    if len(name) > MAX_RAYSERVICE_NAME:
        errors.append(f"metadata.name: {name!r} is longer than {MAX_RAYSERVICE_NAME} characters")
    if not DNS1035.match(name) or len(name) > 63:
        errors.append(f"metadata.name: {name!r} is not a DNS-1035 label")
    timeout = ((doc.get("metadata") or {}).get("annotations") or {}).get("ray.io/initializing-timeout")
    if timeout is not None and not re.fullmatch(r"[1-9]\d*|(\d+(\.\d+)?(ns|us|ms|s|m|h))+", str(timeout)):
        errors.append(f"metadata.annotations.ray.io/initializing-timeout: {timeout!r} is neither a duration "
                      "nor positive seconds")
    spec = doc.get("spec") or {}
    if doc.get("apiVersion") != "ray.io/v1" or doc.get("kind") != "RayService":
        errors.append(f"apiVersion/kind: expected ray.io/v1 RayService, got {doc.get('apiVersion')} {doc.get('kind')}")
    upgrade = spec.get("upgradeStrategy") or {}
    if "type" in upgrade and upgrade["type"] not in UPGRADE_TYPES:
        errors.append(f"spec.upgradeStrategy.type: {upgrade['type']!r} is not one of {', '.join(UPGRADE_TYPES)}")
    cluster = spec.get("rayClusterConfig") or {}
    if upgrade.get("type") == "NewClusterWithIncrementalUpgrade":
        options = upgrade.get("clusterUpgradeOptions")
        if not cluster.get("enableInTreeAutoscaling"):
            errors.append("spec.upgradeStrategy: NewClusterWithIncrementalUpgrade needs the Ray autoscaler "
                          "(rayClusterConfig.enableInTreeAutoscaling: true)")
        if not options:
            errors.append("spec.upgradeStrategy.clusterUpgradeOptions: required for NewClusterWithIncrementalUpgrade")
        else:
            for key in ("stepSizePercent", "maxSurgePercent"):
                if not 0 <= _int(options.get(key), 100) <= 100:
                    errors.append(f"spec.upgradeStrategy.clusterUpgradeOptions.{key}: must be within 0..100")
            if _int(options.get("intervalSeconds"), 0) <= 0:
                errors.append("spec.upgradeStrategy.clusterUpgradeOptions.intervalSeconds: must be > 0")
    if _int(spec.get("rayClusterDeletionDelaySeconds"), 0) < 0:
        errors.append("spec.rayClusterDeletionDelaySeconds: must be non-negative")
    head = cluster.get("headGroupSpec") or {}
    if ((head.get("headService") or {}).get("metadata") or {}).get("name"):
        errors.append("spec.rayClusterConfig.headGroupSpec.headService.metadata.name: must not be set")
    groups = [("headGroupSpec", head)] + [(f"workerGroupSpecs[{i}]", g)
                                          for i, g in enumerate(cluster.get("workerGroupSpecs") or [])]
    for where, group in groups:
        containers = _containers(group)
        if not containers:
            errors.append(f"spec.rayClusterConfig.{where}: needs at least one container")
        params = group.get("rayStartParams") or {}
        if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and group.get("resources"):
            errors.append(f"spec.rayClusterConfig.{where}: resources set both in rayStartParams and resources")
        if "labels" in params:
            errors.append(f"spec.rayClusterConfig.{where}.rayStartParams.labels: use the group's labels field")
        for c_index, container in enumerate(containers):
            for p_index, port in enumerate(container.get("ports") or []):
                if "name" in port and not IANA_SVC_NAME.match(str(port["name"])):
                    errors.append(f"spec.rayClusterConfig.{where}...containers[{c_index}].ports[{p_index}].name: "
                                  f"{port['name']!r} is not an IANA service name (at most 15 characters)")
        if where != "headGroupSpec":
            low, high, now = (_int(group.get("minReplicas"), 0), _int(group.get("maxReplicas"), 2**31 - 1),
                              _int(group.get("replicas"), None))
            if low > high:
                errors.append(f"spec.rayClusterConfig.{where}: minReplicas {low} > maxReplicas {high}")
            if now is not None and not low <= now <= high:
                errors.append(f"spec.rayClusterConfig.{where}.replicas: {now} outside [{low}, {high}]")
    head_ports = {p.get("name"): p.get("containerPort") for c in _containers(head)[:1] for p in c.get("ports") or []}
    if "serve" not in head_ports:
        errors.append("spec.rayClusterConfig.headGroupSpec: the Ray container has no port named 'serve' "
                      "(KubeRay builds the Serve service from it)")


# ---------------------------------------------------------------------------- layer 3: serveConfigV2
def check_serve_config(text, errors: list[str]) -> dict | None:
    from pydantic import ValidationError as PydanticError
    from ray.serve.schema import RayActorOptionsSchema, ServeDeploySchema

    if not isinstance(text, str):
        errors.append("spec.serveConfigV2: missing (a YAML string)")
        return None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        errors.append(f"spec.serveConfigV2: not YAML: {exc}")
        return None
    try:
        ServeDeploySchema.model_validate(config)
    except (PydanticError, TypeError, ValueError) as exc:
        errors.append(f"spec.serveConfigV2: Ray Serve refuses it: {exc}".replace("\n", " ")[:600])
        return None
    known = set(RayActorOptionsSchema.model_fields)
    for a_index, app in enumerate(config.get("applications") or []):
        for d_index, deployment in enumerate(app.get("deployments") or []):
            for key in (deployment.get("ray_actor_options") or {}):
                if key not in known:
                    errors.append(f"spec.serveConfigV2.applications[{a_index}].deployments[{d_index}]."
                                  f"ray_actor_options.{key}: unknown (Ray drops it silently; known: "
                                  f"{', '.join(sorted(known))})")
    for f_index, target in enumerate((config.get("grpc_options") or {}).get("grpc_servicer_functions") or []):
        module, _, attr = str(target).rpartition(".")
        try:
            getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            errors.append(f"spec.serveConfigV2.grpc_options.grpc_servicer_functions[{f_index}]: {target!r} "
                          f"cannot be imported ({exc})")
    return config


# ---------------------------------------------------------------------------- layer 4: this project's configs
def _quantity(value) -> float:
    """A Kubernetes CPU / count quantity as a number ('500m' -> 0.5)."""
    text = str(value)
    try:
        return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        return 0.0  # malformed: the schema layer reports it


def _pod_capacity(group: dict) -> dict[str, float]:
    container = _containers(group)[0] if _containers(group) else {}
    limits = {**((container.get("resources") or {}).get("requests") or {}),
              **((container.get("resources") or {}).get("limits") or {})}
    params = group.get("rayStartParams") or {}
    cpus = _quantity(params["num-cpus"]) if "num-cpus" in params else _quantity(limits.get("cpu", 0))
    gpus = _quantity(params["num-gpus"]) if "num-gpus" in params else _quantity(limits.get("nvidia.com/gpu", 0))
    return {"CPU": cpus, "GPU": gpus, **_custom_resources(params.get("resources"))}


def _custom_resources(value) -> dict[str, float]:
    """``rayStartParams.resources``: a JSON object as a string (KubeRay passes it to ``ray start --resources``)."""
    if not value:
        return {}
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return {}  # malformed: Ray refuses it at start
    return {str(k): float(v) for k, v in parsed.items()} if isinstance(parsed, dict) else {}


def _fits(capacity: dict[str, float], need: dict[str, float]) -> bool:
    return all(capacity.get(name, 0.0) >= amount for name, amount in need.items() if amount)


def _times(capacity: dict[str, float], need: dict[str, float]) -> int:
    """How many of ``need`` one pod of ``capacity`` holds."""
    return int(min((capacity.get(name, 0.0) // amount for name, amount in need.items() if amount), default=1e9))


def check_front_door(where: str, config, replica: dict[str, float], pods: list, errors: list[str]) -> None:
    """``serving.front_door: deployment``: its replicas fit pod groups, and on pods that hold no engine replica (a
    front door beside an engine replica dies with that replica's node and takes its requests' state with it)."""
    from deploy.ray_app import front_door_options

    options = front_door_options(config)
    need = {"CPU": options["ray_actor_options"]["num_cpus"], **options["ray_actor_options"]["resources"]}
    wants = ", ".join(f"{need[k]:g} {k}" for k in need if need[k]) or "nothing"
    hosts = [(name, cap, most) for name, cap, most in pods if _fits(cap, need)]
    if not hosts:
        errors.append(f"{where}: a front door replica (serving.front_door: deployment) needs {wants} on one pod; no "
                      f"pod group offers that ({', '.join(f'{n}: {c}' for n, c, _ in pods)})")
        return
    beside = sorted(name for name, cap, _ in hosts if _fits(cap, replica))
    if beside:
        errors.append(f"{where}: the front door (needs {wants}) can land on pods of {', '.join(beside)}, which also "
                      "hold engine replicas: give it a resource of its own (serving.front_door_resources) that only "
                      "other pods advertise")
    room = sum(_times(cap, need) * most for _, cap, most in hosts)
    if options["num_replicas"] > room:
        errors.append(f"{where}: serving.front_door_replicas is {options['num_replicas']} but the pod groups hold "
                      f"at most {room} front door replicas")


def check_project(doc: dict, serve_config: dict, errors: list[str]) -> None:
    from deploy.ray_app import AppArgs, deployment_options
    from dspark.config import ConfigError
    from dspark.schema import load_engine_config

    cluster = (doc.get("spec") or {}).get("rayClusterConfig") or {}
    pods = [(group.get("groupName", "head"), _pod_capacity(group), _int(group.get("maxReplicas"), 1))
            for group in cluster.get("workerGroupSpecs") or []]
    pods.append(("head", _pod_capacity(cluster.get("headGroupSpec") or {}), 1))
    for a_index, app in enumerate(serve_config.get("applications") or []):
        if not str(app.get("import_path", "")).startswith("deploy.ray_app:"):
            continue
        where = f"spec.serveConfigV2.applications[{a_index}]"
        try:
            args = AppArgs.model_validate(app.get("args") or {})
            path = Path(args.config)
            config = load_engine_config(path if path.is_absolute() else REPO / path)
            options = deployment_options(config)
        except (ConfigError, ValueError) as exc:
            errors.append(f"{where}.args: {exc}")
            continue
        bundles = options["placement_group_bundles"]
        if options["placement_group_strategy"] == "STRICT_PACK":  # the whole replica on one pod
            groups = [{name: sum(b.get(name, 0) for b in bundles) for name in {n for b in bundles for n in b}}]
        else:  # each bundle on a pod of its own choosing; the replica process's bundle counts the replicas
            groups = bundles
        unplaced = [need for need in groups if not any(_fits(cap, need) for _, cap, _ in pods)]
        if unplaced:
            need = unplaced[0]
            wants = ", ".join(f"{need[k]:g} {k}" for k in sorted(need, key=lambda k: (k not in ("CPU", "GPU"), k))
                              if need[k])
            errors.append(f"{where}: one replica of {args.config} needs {wants} on one pod; no pod group offers that "
                          f"({', '.join(f'{n}: {c}' for n, c, _ in pods)})")
            continue
        scaling = config.serving.autoscaling
        wanted = scaling.max_replicas if scaling else config.serving.num_replicas
        room = sum(_times(cap, groups[0]) * most for _, cap, most in pods if _fits(cap, groups[0]))
        if wanted > room:
            errors.append(f"{where}: {args.config} asks for up to {wanted} replicas but the pod groups hold "
                          f"at most {room}")
        if config.serving.front_door == "deployment":
            check_front_door(where, config, groups[0], pods, errors)


# ---------------------------------------------------------------------------- layer 5: exposure
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
GRPC_CAP_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"


def check_exposure(doc: dict, serve_config: dict | None, errors: list[str]) -> None:
    cluster = (doc.get("spec") or {}).get("rayClusterConfig") or {}
    head = cluster.get("headGroupSpec") or {}
    host = str((head.get("rayStartParams") or {}).get("dashboard-host", "0.0.0.0"))  # KubeRay's default
    token = ((cluster.get("authOptions") or {}).get("mode")) == "token"
    if host not in LOOPBACK_HOSTS and not token:
        errors.append(f"spec.rayClusterConfig.headGroupSpec.rayStartParams.dashboard-host: {host!r} exposes Ray's "
                      "job API (code execution) without authentication: bind 127.0.0.1 or set "
                      "rayClusterConfig.authOptions.mode: token")
    groups = [("headGroupSpec", head)] + [(f"workerGroupSpecs[{i}]", g)
                                          for i, g in enumerate(cluster.get("workerGroupSpecs") or [])]
    for where, group in groups:
        for c_index, container in enumerate(_containers(group)[:1]):  # the Ray container
            env = {e.get("name"): e.get("value") for e in container.get("env") or []}
            if not str(env.get(GRPC_CAP_ENV, "")).isdigit():
                errors.append(f"spec.rayClusterConfig.{where}...containers[{c_index}].env: {GRPC_CAP_ENV} unset "
                              "(Serve's gRPC proxy then takes messages up to 2 GiB)")
    if serve_config is None:
        return
    grpc_options = serve_config.get("grpc_options") or {}
    if grpc_options and grpc_options.get("enable_reflection", True):
        errors.append("spec.serveConfigV2.grpc_options.enable_reflection: must be false (reflection lists the "
                      "API to anyone who connects)")
    from deploy.ray_app import AppArgs
    from dspark.config import ConfigError
    from dspark.schema import load_engine_config

    for a_index, app in enumerate(serve_config.get("applications") or []):
        if not str(app.get("import_path", "")).startswith("deploy.ray_app:"):
            continue
        try:
            path = Path(AppArgs.model_validate(app.get("args") or {}).config)
            serving = load_engine_config(path if path.is_absolute() else REPO / path).serving
        except (ConfigError, ValueError):
            continue  # layer 4 reports it
        if not (serving.api_key_file or serving.allow_unauthenticated):
            errors.append(f"spec.serveConfigV2.applications[{a_index}]: {path} has no serving.api_key_file and "
                          "does not say serving.allow_unauthenticated: true (its replicas refuse to start on "
                          "0.0.0.0)")


# ---------------------------------------------------------------------------- entry points
def load_schema(path: Path = DEFAULT_SCHEMA) -> dict:
    return json.loads(Path(path).read_text())


def validate(doc: dict, schema: dict) -> list[str]:
    """Every problem of one RayService document (empty: valid)."""
    errors: list[str] = []
    if not isinstance(doc, dict):
        return ["(root): not a mapping"]
    doc = apply_defaults(copy.deepcopy(doc), schema)
    check_schema({k: v for k, v in doc.items() if k != "status"}, schema, "", errors)
    errors = [e.lstrip(".") for e in errors]
    check_kuberay(doc, errors)
    serve_config = check_serve_config((doc.get("spec") or {}).get("serveConfigV2"), errors)
    if serve_config is not None:
        check_project(doc, serve_config, errors)
    check_exposure(doc, serve_config, errors)
    return errors


def validate_file(path: Path, schema: dict) -> list[str]:
    errors = []
    for index, doc in enumerate(yaml.safe_load_all(Path(path).read_text())):
        if doc is None or (isinstance(doc, dict) and doc.get("kind") != "RayService"):
            continue  # other kinds (Secrets, PVCs) are plain Kubernetes
        errors += [f"document {index}: {e}" for e in validate(doc, schema)]
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifests", nargs="+", type=Path)
    parser.add_argument("--schema", type=Path, default=DEFAULT_SCHEMA, help="RayService v1 openAPIV3 schema (JSON)")
    args = parser.parse_args(argv)
    schema, failed = load_schema(args.schema), 0
    for path in args.manifests:
        errors = validate_file(path, schema)
        failed += bool(errors)
        print(f"{'FAIL' if errors else 'ok'}  {path}")
        for error in errors:
            print(f"      {error}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
