"""The Ray Serve application builder: a validated config in, a Serve application out.

    serve run deploy.ray_app:app                      # configs/embedded.yaml (or $DSPARK_CONFIG), HTTP :8000
    serve run deploy.ray_app:app backend=vllm         # the same config with engine.backend: vllm ($DSPARK_BACKEND)
    serve run deploy.ray_app:build_app config=PATH    # another engine config
    serve run configs/serve.yaml                      # the same app, HTTP :8000 and gRPC :9000

With ``serving.front_door: deployment`` the API is served by a deployment of its own (``deploy.ingress``) in front
of the engine replicas, which then serve it no more: a lost engine replica's requests are carried over.

Each replica reserves one placement group: bundle 0 for the replica process (the front door and router; with
the vllm backend on one device also vLLM's engine), then native: one bundle per target shard actor and one for
the drafter actor; vllm with tensor parallelism: one per vLLM Ray worker (``STRICT_PACK`` by default: one node).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

from deploy.ingress import DSparkFrontDoor
from deploy.placement import placement_bundles, replica_cpus, replica_gpus
from deploy.server import DSparkServer, EngineReplica
from dspark.config import ConfigError
from dspark.schema import EngineFileConfig, format_validation_error, load_engine_config

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "embedded.yaml"


class AppArgs(BaseModel):
    """Arguments of ``build_app`` (``serve run deploy.ray_app:build_app key=value ...``)."""

    model_config = ConfigDict(extra="forbid")

    config: str = Field(default_factory=lambda: os.environ.get("DSPARK_CONFIG", str(DEFAULT_CONFIG)),
                        description="Engine config YAML (default: $DSPARK_CONFIG, else configs/embedded.yaml); "
                                    "relative paths are relative to the repository.")
    backend: Literal["native", "vllm"] | None = Field(
        default_factory=lambda: os.environ.get("DSPARK_BACKEND") or None,
        description="Override the config's engine.backend (default: $DSPARK_BACKEND, else the config's).")


def autoscaling_config(config: EngineFileConfig) -> AutoscalingConfig | None:
    spec = config.serving.autoscaling
    if spec is None:
        return None
    if spec.min_replicas > spec.max_replicas:
        raise ConfigError("serving.autoscaling.min_replicas", f"{spec.min_replicas} > max_replicas {spec.max_replicas}")
    policy = AutoscalingPolicy(
        policy_function="deploy.autoscaling:AcceptanceLengthPolicy",
        policy_kwargs={"target_utilisation": spec.target_utilisation, "drain_horizon_s": spec.drain_horizon_s,
                       "hysteresis": spec.hysteresis, "downscale_cycles": spec.downscale_cycles})
    return AutoscalingConfig(min_replicas=spec.min_replicas, max_replicas=spec.max_replicas,
                             initial_replicas=max(spec.min_replicas, 1), metrics_interval_s=spec.metrics_interval_s,
                             look_back_period_s=spec.look_back_period_s, upscale_delay_s=spec.upscale_delay_s,
                             downscale_delay_s=spec.downscale_delay_s, policy=policy)


def max_ongoing(serving) -> int:
    """Requests Serve lets reach one replica at once (the replica admits far fewer into decoding)."""
    return 4 * (serving.max_concurrent_requests + serving.max_queued_requests) + 64


def replica_threads_env(config: EngineFileConfig) -> dict[str, str]:
    """vllm backend: the engine computes in the replica with ``runtime.shard_threads`` threads (0: one per core),
    set through OMP_NUM_THREADS so that every thread of the process (vLLM's worker binds its threads at start,
    the serving loop steps it from another) agrees on the count; Ray would set it to the reserved CPUs.

    vLLM's CPU worker pins its OpenMP threads to the first cores of the node (``VLLM_CPU_OMP_THREADS_BIND=auto``).
    Ray reserves CPUs by count, not by core, so where more than one replica may share a node each would pin to the
    same cores, each with a team of all of them; there the threads are left to the OS scheduler (``nobind``).
    NUMBA_NUM_THREADS too: vLLM's prompt-lookup proposer restores numba's thread count after each proposal, which
    in the OpenMP threading layer sets the stepping thread's OpenMP team to it (by default every core of the node).
    Measured with two replicas on 2 cores, prompt lookup on: a decode step 0.30 s against 0.027 s for one replica
    alone, until both were set."""
    if config.engine.backend != "vllm" or config.runtime.shard_gpus:
        return {}
    cpus = config.runtime.engine_cpus  # pinned: one OpenMP thread per core of its own
    threads = len(cpus) if cpus else config.runtime.shard_threads or os.cpu_count() or 1
    threads = str(max(threads // config.runtime.tp_size, 1))  # tensor parallelism: vLLM's worker processes share them
    env = {"OMP_NUM_THREADS": threads, "NUMBA_NUM_THREADS": threads}
    autoscaling = config.serving.autoscaling
    if (autoscaling.max_replicas if autoscaling else config.serving.num_replicas) > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def deployment_options(config: EngineFileConfig) -> dict:
    serving, runtime = config.serving, config.runtime
    autoscaling = autoscaling_config(config)
    replicas = {"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": serving.num_replicas}
    env = {**runtime.actor_env(vllm_engine=config.engine.backend == "vllm"), **replica_threads_env(config)}
    return {
        "name": "DSparkServer",
        **replicas,
        "ray_actor_options": {"num_cpus": replica_cpus(config), "num_gpus": replica_gpus(config),
                              "runtime_env": {"env_vars": env}},
        "placement_group_bundles": placement_bundles(config),
        "placement_group_strategy": runtime.placement_strategy,
        # the replica bounds its own work (admission by tokens: 429 with Retry-After at once); Serve's bound only
        # has to let those requests, uploads still arriving and /health reach it, and its queue in front of the
        # replicas is bounded too (past it, Serve's own 429)
        "max_ongoing_requests": max_ongoing(serving),
        "max_queued_requests": max_ongoing(serving),
        "backpressure_config": {"status_code": 429, "retry_after_s": 1.0},
        "health_check_period_s": 5,
        "graceful_shutdown_timeout_s": serving.drain_grace_s,  # then carried over by a front door of its own
        "graceful_shutdown_wait_loop_s": min(0.5, serving.drain_grace_s),
    }


def front_door_options(config: EngineFileConfig) -> dict:
    """``serving.front_door: deployment``: the front door's own deployment (a fixed count, anywhere its resources
    allow: on a cluster, the head node or a CPU node, away from the engine replicas it outlives)."""
    serving = config.serving
    return {
        "name": "DSparkFrontDoor",
        "num_replicas": serving.front_door_replicas,
        "ray_actor_options": {"num_cpus": serving.front_door_cpus, "resources": dict(serving.front_door_resources)},
        "max_ongoing_requests": max_ongoing(serving) * max(serving.num_replicas, serving.autoscaling.max_replicas
                                                          if serving.autoscaling else 1),
        "health_check_period_s": 5,
        "graceful_shutdown_timeout_s": 5,
    }


def build_app(args: dict | None = None) -> Application:
    try:
        parsed = AppArgs.model_validate(dict(args or {}))
    except ValidationError as exc:
        raise ConfigError("build_app", format_validation_error(exc)) from None
    path = Path(parsed.config)
    config = load_engine_config(path if path.is_absolute() or path.exists() else REPO / path)
    if parsed.backend:
        config = config.model_copy(update={"engine": config.engine.model_copy(update={"backend": parsed.backend})})
    if config.serving.front_door == "deployment":  # the engine replicas behind a front door of their own
        engine = serve.deployment(EngineReplica).options(**deployment_options(config)).bind(config)
        return DSparkFrontDoor.options(**front_door_options(config)).bind(config, engine)
    return DSparkServer.options(**deployment_options(config)).bind(config)


# `serve run deploy.ray_app:app`: Serve calls this builder with the command line's key=value arguments (none: the
# embedded default). Nothing is built at import time.
app = build_app
