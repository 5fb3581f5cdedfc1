"""The router of one serving replica: request state and the step loop over remote actors.

A ``Router`` is the in-process ``Engine`` (admission, continuous batching, confidence
scheduling, commit, stop conditions, emission: the same code) driving remote executors:
``RemoteTarget`` (the tensor-parallel shard actors) and ``RemoteDrafter`` (the draft actor).
It runs wherever its owner runs: in a driver, in a Ray Serve replica, or as ``RouterActor``.
The actors it creates are owned by it and die with it (fate-sharing).

Step: ``Engine.step``, unchanged (schedule -> draft gate -> draft -> schedule the verified prefix
-> verify -> commit -> emit); the router only supplies the executors and asks for a group's next
draft as soon as its round commits, so the draft call's Ray overhead overlaps the router's own
bookkeeping. With ``pipeline: true`` the running requests are split into two micro-batches:
while the target verifies one, the drafter drafts the other, so neither actor waits for the
other (the overlap the disaggregated design exists for; it pays when target and drafter do not
share the same cores). Greedy outputs are the same either way.

Drafter failure: a draft call that raises or exceeds ``drafter_timeout_s`` turns the affected
requests into plain target decoding (still exactly the target's output); the router replaces
the actor in the background and new requests speculate again once it is up.
"""

from __future__ import annotations

import json
import logging

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.collective import feature_source
from actors.draft_actor import DraftWorker, RemoteDrafter
from actors.serialization import register_tensor_serializer
from actors.target_actor import RemoteTarget, TargetShard
from dspark.config import ConfigError
from dspark.decoding.engine import Engine
from dspark.decoding.request import Request, RequestOutput
from dspark.formats.checkpoint import draft_config_from_json
from dspark.formats.target_checkpoint import read_target_config
from dspark.loader import load_tokenizer
from dspark.model.tensor_parallel import check_divisible
from dspark.schema import EngineFileConfig

log = logging.getLogger("dspark")


def replica_bundles(config: EngineFileConfig) -> list[dict[str, float]]:
    """Placement group bundles of one replica's actors: the target shards, then the drafter."""
    rt = config.runtime

    def bundle(cpus: float, gpus: float, custom: dict[str, float]) -> dict[str, float]:
        return {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **custom}

    shards = [bundle(rt.shard_cpus, rt.shard_gpus, rt.target_resources) for _ in range(rt.tp_size)]
    drafter = [bundle(rt.drafter_cpus, rt.drafter_gpus, rt.drafter_resources)] if _speculates(config) else []
    return shards + drafter


def _speculates(config: EngineFileConfig) -> bool:
    return config.engine.speculate and bool(config.draft.path)


class Router(Engine):
    def __init__(self, config: EngineFileConfig, placement=None, bundle_offset: int = 0):
        """``placement``: a ready placement group holding ``replica_bundles(config)`` from bundle
        ``bundle_offset`` on (a Serve replica passes its own); None creates one for this router.
        ``auto`` dtypes are chosen here, on the node its placement group packs the actors on."""
        config, choices = config.with_concrete_dtypes(config.runtime.shard_gpus > 0, config.runtime.drafter_gpus > 0)
        register_tensor_serializer()  # the verify and draft calls' tensors travel as numpy arrays
        self.file_config, rt = config, config.runtime
        target_path = config.resolve(config.target.path)
        if not target_path.is_dir():
            raise ConfigError("target.path", f"{target_path} is not a directory (run `dspark prepare`?)")
        engine_cfg = config.engine.to_core(config.target.dtype)
        full_config = read_target_config(target_path)
        check_divisible(full_config, rt.tp_size, rt.expert_parallel)
        layers: tuple[int, ...] = ()
        if _speculates(config):
            draft_path = config.resolve(config.draft.path)
            if not (draft_path / "config.json").is_file():
                raise ConfigError("draft.path", f"{draft_path} has no config.json")
            layers = draft_config_from_json(json.loads((draft_path / "config.json").read_text())).target_layer_ids
        self._own_placement = placement is None
        if placement is None:
            placement = placement_group(replica_bundles(config), strategy=rt.placement_strategy)
            try:
                ray.get(placement.ready(), timeout=rt.collective_timeout_s)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(placement)
                free = ray.available_resources()
                raise RuntimeError(f"no room for a replica's actors {replica_bundles(config)} within "
                                   f"{rt.collective_timeout_s} s (free: {free})") from None
        self.placement, self.bundle_offset = placement, bundle_offset
        self.shards, self.drafter, self._pending_drafter = [], None, None
        self.actor_pids: dict = {"target_shards": [], "drafter": None}  # for operators (GET /health)
        self.actor_nodes: dict = {"target_shards": [], "drafter": None}  # the Ray node of each (GET /health)
        self.drafter_restarts = 0
        self.feature_shard = 0  # the shard with the feature channel (set on connect)
        self._admitted = 0
        try:
            target, drafter = self._start_actors(full_config, layers)
            super().__init__(target, load_tokenizer(target_path, config.target.trust_remote_code), drafter,
                             engine_cfg, layers)
        except BaseException:
            self.shutdown()
            raise
        self.feature_layers = layers
        self.dtypes = {part: c.as_dict() for part, c in choices.items()}
        for part, choice in choices.items():
            log.info("%s dtype %s (%s)", part, choice.dtype, choice.reason)

    # ------------------------------------------------------------------ actors
    def _start_actors(self, full_config, layers: tuple[int, ...]) -> tuple[RemoteTarget, RemoteDrafter | None]:
        config, rt = self.file_config, self.file_config.runtime
        self.shards = [
            TargetShard.options(num_cpus=rt.shard_cpus, num_gpus=rt.shard_gpus, runtime_env=self._env(),
                                scheduling_strategy=self._bundle(rank)).remote(config, rank, layers)
            for rank in range(rt.tp_size)
        ]
        address = ray.get(self.shards[0].tp_address.remote())
        ray.get([shard.join_tp.remote(address) for shard in self.shards])
        target = RemoteTarget(config, self.shards, full_config)
        self.actor_pids = {"target_shards": ray.get([shard.pid.remote() for shard in self.shards]), "drafter": None}
        self.actor_nodes = {"target_shards": ray.get([shard.node.remote() for shard in self.shards]), "drafter": None}
        if not _speculates(config):
            return target, None
        actor = self._new_drafter_actor()
        self.drafter = RemoteDrafter(actor, 0, rt.drafter_timeout_s)  # known to shutdown() from here on
        self._connect(actor)
        self.drafter.block_size = ray.get(actor.block_size.remote())
        return target, self.drafter

    def _bundle(self, index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.placement,
                                                placement_group_bundle_index=self.bundle_offset + index)

    def _new_drafter_actor(self):
        rt = self.file_config.runtime
        return DraftWorker.options(num_cpus=rt.drafter_cpus, num_gpus=rt.drafter_gpus, runtime_env=self._env(),
                                   scheduling_strategy=self._bundle(rt.tp_size)).remote(self.file_config)

    def _env(self) -> dict:
        return {"env_vars": self.file_config.runtime.actor_env()}

    def _connect(self, actor) -> None:
        """Open a feature channel between the feature shard and a drafter actor."""
        placements = ray.get([shard.placement.remote() for shard in self.shards] + [actor.placement.remote()])
        self.feature_shard = feature_source(placements[:-1], placements[-1], self.file_config.runtime.feature_shard)
        sender = self.shards[self.feature_shard]
        address = ray.get(sender.open_channel.remote())
        ray.get([sender.join_channel.remote(address), actor.join_channel.remote(address)],
                timeout=self.file_config.runtime.collective_timeout_s)
        self.actor_pids["drafter"], self.actor_nodes["drafter"] = ray.get([actor.pid.remote(), actor.node.remote()])

    def _recover_drafter(self) -> None:
        """After a failure: replace the actor in the background, reconnect once it is up."""
        if self._pending_drafter is None:
            ray.get(self.shards[self.feature_shard].drop_channel.remote())
            ray.kill(self.drafter.actor, no_restart=True)
            self._drafts.clear()
            for request in self.running:  # their context lived in the dead actor: finish without drafts
                request.speculative = False
            actor = self._new_drafter_actor()
            self._pending_drafter = (actor, actor.ping.remote())
            self.metrics.drafter_failures += 1
            return
        actor, ping = self._pending_drafter
        ready, _ = ray.wait([ping], timeout=0)
        if not ready:
            return
        self._pending_drafter = None
        try:
            ray.get(ping)
            self._connect(actor)
        except ray.exceptions.RayError:
            self.drafter.actor = actor  # so that the next attempt kills this one
            return self._recover_drafter()
        self.drafter = RemoteDrafter(actor, self.drafter.block_size, self.drafter.timeout_s)
        self.drafter_restarts += 1

    def restart_target(self) -> None:
        """After a target failure, once every in-flight request has been failed: replace the replica's
        shards and drafter in the same placement group (weights reload; the cost table is kept)."""
        self._kill_actors()
        self._drafts.clear()
        if self.has_unfinished() or self.allocator.num_free_blocks != self.allocator.usable_blocks:
            raise RuntimeError("restart_target needs every request finished first")
        self.target, self.drafter = self._start_actors(self.target.config, self.feature_layers)
        self.allocator = self.target.allocator

    def kill_drafter(self) -> None:
        """Fault injection for tests and drills."""
        ray.kill(self.drafter.actor, no_restart=True)

    # ------------------------------------------------------------------ the step
    # ``Engine.step`` is the round; the router only says who executes it: the target pass runs on the shard
    # actors (``RemoteTarget``), the draft pass on the drafter actor (``RemoteDrafter``), and a group's next
    # draft is asked for as soon as its round commits (``overlap_drafts``), so the draft call overlaps the
    # router's bookkeeping and, with ``pipeline: true``, the verification of the other micro-batch.
    overlap_drafts = True

    def step(self) -> list[RequestOutput]:
        if self.drafter is not None and not self.drafter.available:
            self._recover_drafter()
        if self.drafter is not None:  # the feature shard releases what the drafter has received
            self.target.features_delivered = self.drafter.received
        return super().step()

    def _schedule(self):
        prefill, decode = super()._schedule()
        groups = 2 if self.file_config.runtime.pipeline else 1
        for request in prefill:  # alternate new requests between the micro-batches
            request.microbatch = self._admitted % groups
            self._admitted += 1
        return prefill, decode

    def _group(self, request: Request) -> int:
        return request.microbatch

    def _on_draft(self, draft) -> None:
        if self.on_phase is not None:  # tracing: the feature transfer inside the draft call, then the draft
            recv_ns = int(self.drafter.last_timing.get("recv_s", 0.0) * 1e9)
            self.on_phase("transport", draft.start_ns, draft.start_ns + recv_ns,
                          [r.request_id for r in draft.drafting], {})
        super()._on_draft(draft)

    # ------------------------------------------------------------------ telemetry
    def transport_stats(self) -> dict:
        """Feature-channel counters of both ends (bytes that did NOT go through the object store)."""
        sender = ray.get(self.shards[self.feature_shard].stats.remote())
        receiver = ray.get(self.drafter.actor.stats.remote()) if self.drafter and self.drafter.available else None
        return {"target": sender, "drafter": receiver, "drafter_restarts": self.drafter_restarts,
                "object_store_feature_bytes": self.target.returned_feature_bytes}

    def _kill_actors(self) -> None:
        for actor in [*self.shards, *([self.drafter.actor] if self.drafter else [])]:
            ray.kill(actor, no_restart=True)
        if self._pending_drafter is not None:
            ray.kill(self._pending_drafter[0], no_restart=True)
        self.shards, self.drafter, self._pending_drafter = [], None, None
        self.actor_pids = {"target_shards": [], "drafter": None}  # same schema while restarting
        self.actor_nodes = {"target_shards": [], "drafter": None}

    def shutdown(self) -> None:
        self._kill_actors()
        if self._own_placement and self.placement is not None:
            remove_placement_group(self.placement)
            self.placement = None


RouterActor = ray.remote(Router)
