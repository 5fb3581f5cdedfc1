"""The target: shard actors and the router's handle on them (native backend), or vLLM's engine (vllm backend).

A replica's target runs as ``tp_size`` ``TargetShard`` actors. Each holds its tensor-parallel
slice of the model (``dspark.model.tensor_parallel``), read from the checkpoint slice by slice
(``dspark.formats.target_checkpoint``: no shard ever holds the whole target), and of the KV cache; the router keeps the
block tables and sends every verify pass as one ``VerifyBatch`` to all shards. Shard 0
returns the verification result (tokens and counts: small) and pushes the committed
positions' fused hidden states straight to the drafter over the feature channel.
"""

from __future__ import annotations

import os
import threading
import time

import ray
import torch

from actors.collective import (
    FeatureChannel,
    StoreHost,
    TransportCounters,
    all_reduce_fn,
    device_placement,
    join_group,
    node_id,
    resolve_backend,
)
from actors.serialization import register_tensor_serializer
from dspark.config import DecoderConfig
from dspark.decoding.kv_cache import AttentionMetadata, BlockAllocator
from dspark.decoding.target_runner import TargetRunner, VerifyBatch, VerifyOutput, to_device
from dspark.formats.target_checkpoint import CheckpointReader, ShardSpec, load_target, read_target_config
from dspark.model.target_model import DTYPES
from dspark.schema import EngineFileConfig


@ray.remote
class TargetShard:
    def __init__(self, config: EngineFileConfig, rank: int, feature_layers: tuple[int, ...]):
        runtime = config.runtime
        register_tensor_serializer()
        torch.set_num_threads(runtime.shard_threads or os.cpu_count() or 1)  # Ray's default is 1 per CPU reserved
        self.config, self.rank, self.world = config, rank, runtime.tp_size
        self.feature_layers = feature_layers
        use_gpu = runtime.shard_gpus > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
        self.backend = resolve_backend(runtime.backend, self.device)
        path = config.resolve(config.target.path)
        self._all_reduce = None  # bound in join_tp, once the group exists
        reader = CheckpointReader(path)
        shard = ShardSpec(rank, self.world, runtime.expert_parallel)
        self.model = load_target(path, config.target.dtype, shard, lambda t: self._all_reduce(t), reader,
                                 config.target.fp8_mode(on_gpu=self.device.type == "cuda"), self.device)
        self.checkpoint_bytes_read = reader.bytes_read  # this shard's slice only
        self.full_config: DecoderConfig = read_target_config(path)
        self.runner: TargetRunner | None = None
        self.channel: FeatureChannel | None = None
        self._tp_host = StoreHost(self.world, runtime.collective_timeout_s) if rank == 0 and self.world > 1 else None
        self._channel_host: StoreHost | None = None
        self.channel_errors = 0
        self.run_seconds = 0.0  # compute time of verify passes (incl. the collective all-reduces)

    # ---------------------------------------------------------------- set-up
    def tp_address(self) -> tuple[str, int] | None:
        return self._tp_host.address if self._tp_host else None

    def join_tp(self, address: tuple[str, int] | None) -> None:
        """Join the tensor-parallel group that sums the shards' partial outputs (all shards call this together)."""
        if self.world > 1:
            group = join_group(address, self.rank, self.world, self.backend,
                               self.config.runtime.collective_timeout_s, self._tp_host)
            self._all_reduce = all_reduce_fn(group)
        engine = self.config.engine
        cache = self.model.make_cache(engine.kv_cache_tokens, engine.kv_block_size)
        self.runner = TargetRunner(self.model, cache, self.feature_layers, engine.verification)

    def open_channel(self) -> tuple[str, int]:
        """Host the rendezvous of a new feature channel to a (new) drafter (the feature shard only)."""
        self.channel = None
        self._channel_host = StoreHost(2, self.config.runtime.collective_timeout_s)
        return self._channel_host.address

    def join_channel(self, address: tuple[str, int]) -> None:
        group = join_group(address, 0, 2, self.backend, self.config.runtime.collective_timeout_s,
                           self._channel_host)
        self.channel = FeatureChannel(group, DTYPES[self.config.target.dtype], self.device)

    def drop_channel(self) -> None:
        """The drafter is gone: stop sending (undelivered messages are abandoned)."""
        self.channel, self._channel_host = None, None

    # ---------------------------------------------------------------- work
    def run(self, batch: VerifyBatch, delivered: int = 0) -> VerifyOutput | None:
        """One verify pass; ``delivered``: the feature messages the drafter has received so far (the router learns
        it from the drafter's answers), whose buffers the channel can now release."""
        start = time.perf_counter()
        output = self.runner.run(batch.to(self.device))
        self.run_seconds += time.perf_counter() - start
        if self.channel is not None:
            self.channel.delivered(delivered)
            if bool(batch.want_features.any()):
                try:
                    self.channel.send(output.packed_features(batch.want_features.to(self.device)))
                except RuntimeError:  # the drafter died mid-transfer; the router notices on its side
                    self.channel_errors += 1
                    self.drop_channel()
        if self.rank != 0:
            return None
        result = output.result
        return VerifyOutput(type(result)(result.tokens.cpu(), result.num_accepted.cpu()), output.kept.cpu(), None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        self.runner.forward(input_ids.to(self.device), positions.to(self.device),
                            to_device(meta, self.device))

    def stats(self) -> dict:
        counters = self.channel.counters if self.channel else TransportCounters()
        return {"rank": self.rank, "channel": counters.as_dict(), "channel_errors": self.channel_errors,
                "undelivered": self.channel.undelivered if self.channel else 0,
                "run_seconds": self.run_seconds, "checkpoint_bytes_read": self.checkpoint_bytes_read}

    def ping(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str | None:
        return node_id()

    def placement(self) -> str:
        return device_placement()


class RemoteTarget:
    """The router's view of its shard actors, with ``TargetRunner``'s interface."""

    def __init__(self, config: EngineFileConfig, shards: list, full_config: DecoderConfig):
        engine = config.engine
        self.shards, self.config = shards, full_config
        self.timeout_s = config.runtime.target_timeout_s  # a pass past it: the shards count as hung
        num_blocks = max(engine.kv_cache_tokens // engine.kv_block_size, 1) + 1  # as PagedKVCache
        self.allocator = BlockAllocator(num_blocks, engine.kv_block_size)
        self.returned_feature_bytes = 0  # hidden-state bytes that came back through Ray (0 by design)
        self.features_delivered = 0  # feature messages the drafter has received (the router sets it), for shard.run

    def run(self, batch: VerifyBatch) -> VerifyOutput:
        arg = ray.put(batch) if len(self.shards) > 1 else batch  # one serialisation for all shards
        output = ray.get([shard.run.remote(arg, self.features_delivered) for shard in self.shards],
                         timeout=self.timeout_s)[0]
        if output.features is not None:
            self.returned_feature_bytes += output.features.numel() * output.features.element_size()
        return output

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        ray.get([shard.forward.remote(input_ids, positions, meta) for shard in self.shards], timeout=self.timeout_s)


def vllm_target(config: EngineFileConfig, placement=None, drafter_bundle: int | None = None):
    """The vllm backend's target: vLLM's engine in this process (``dspark.integrations.vllm_0_32.engine.VllmEngine``)
    and, with ``engine.vllm_drafter: actor``, our DSpark head in a drafter actor beside it (bundle
    ``drafter_bundle`` of ``placement``, the replica's placement group), fed the hidden states over the feature
    channel. Built by ``dspark.builder.build_engine``, the one builder.

    Built on a thread of its own that ends once the engine is built (:func:`on_own_thread`), so that the OpenMP thread
    pool its loading, profiling and warm-up created ends with it: the serving loop's thread, which steps the engine,
    then holds the process's only pool. libgomp counts the threads of every pool in the process; past the number of
    CPUs it spins only ~1,000 iterations before putting a worker to sleep, so every one of a forward pass's hundreds
    of parallel regions would wake its worker with a futex. ``python -m benchmarks.engine_thread`` (2 cores, bf16,
    batch 1): stepping from a second thread 0.63x of stepping from the building thread; 0.94x after building on a
    thread that ended."""
    return on_own_thread(lambda: _vllm_target(config, placement, drafter_bundle))


def on_own_thread(fn):
    """``fn()`` on a new thread that ends when it returns: its result, or its exception raised here."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="dspark-own-thread")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _vllm_target(config: EngineFileConfig, placement, drafter_bundle: int | None):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from actors.draft_actor import DrafterHostFactory
    from dspark.builder import build_engine

    strategy = None
    if placement is not None and drafter_bundle is not None:
        strategy = PlacementGroupSchedulingStrategy(placement_group=placement,
                                                    placement_group_bundle_index=drafter_bundle)
    concrete = config.with_concrete_dtypes(target_on_gpu=torch.cuda.is_available())[0]
    return build_engine(config, backend="vllm", drafter_host=DrafterHostFactory(concrete, strategy))
