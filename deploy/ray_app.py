"""The Ray Serve application builder: a validated config in, a Serve application out.

    serve run deploy.ray_app:app                      # configs/embedded.yaml (or $DSPARK_CONFIG), HTTP :8000
    serve run deploy.ray_app:build_app config=PATH    # another engine config
    serve run configs/serve.yaml                      # the same app, HTTP :8000 and gRPC :9000

Each replica reserves one placement group: bundle 0 for the ingress/router process, then one
bundle per target shard and one for the drafter (``STRICT_PACK`` by default: one node).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

from actors.router import replica_bundles
from deploy.server import DSparkServer
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


def replica_cpus(config: EngineFileConfig) -> float:
    """CPUs of the replica process: the router's; with the vllm backend also the target's (its engine runs there)."""
    cpus = config.serving.router_cpus
    if config.engine.backend == "vllm":
        cpus += config.runtime.tp_size * config.runtime.shard_cpus
    return cpus


def replica_threads_env(config: EngineFileConfig) -> dict[str, str]:
    """vllm backend: the engine computes in the replica with ``runtime.shard_threads`` threads (0: one per core),
    set through OMP_NUM_THREADS so that every thread of the process (vLLM's worker binds its threads at start,
    the serving loop steps it from another) agrees on the count; Ray would set it to the reserved CPUs."""
    if config.engine.backend != "vllm":
        return {}
    return {"OMP_NUM_THREADS": str(config.runtime.shard_threads or os.cpu_count() or 1)}


def deployment_options(config: EngineFileConfig) -> dict:
    serving, runtime = config.serving, config.runtime
    autoscaling = autoscaling_config(config)
    replicas = {"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": serving.num_replicas}
    return {
        "name": "DSparkServer",
        **replicas,
        "ray_actor_options": {"num_cpus": replica_cpus(config),
                              "runtime_env": {"env_vars": {**runtime.actor_env(), **replica_threads_env(config)}}},
        # native: the router's bundle, then the target shards' and the drafter's; vllm: its engine runs in the replica
        "placement_group_bundles": [{"CPU": replica_cpus(config)},
                                    *(replica_bundles(config) if config.engine.backend == "native" else [])],
        "placement_group_strategy": runtime.placement_strategy,
        # the replica bounds its own work (admission by tokens: 429 with Retry-After at once); Serve's bound only
        # has to let those requests, uploads still arriving and /health reach it, and its queue in front of the
        # replicas is bounded too (past it, Serve's own 429)
        "max_ongoing_requests": max_ongoing(serving),
        "max_queued_requests": max_ongoing(serving),
        "backpressure_config": {"status_code": 429, "retry_after_s": 1.0},
        "health_check_period_s": 5,
        "graceful_shutdown_timeout_s": 5,
        "graceful_shutdown_wait_loop_s": 0.5,
    }


def build_app(args: dict | None = None) -> Application:
    try:
        parsed = AppArgs.model_validate(dict(args or {}))
    except ValidationError as exc:
        raise ConfigError("build_app", format_validation_error(exc)) from None
    path = Path(parsed.config)
    config = load_engine_config(path if path.is_absolute() or path.exists() else REPO / path)
    return DSparkServer.options(**deployment_options(config)).bind(config)


# `serve run deploy.ray_app:app`: Serve calls this builder with the command line's key=value arguments (none: the
# embedded default). Nothing is built at import time.
app = build_app
