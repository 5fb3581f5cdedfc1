"""Collective groups between a replica's actors, and the hidden-state channel built on one.

Groups are plain ``torch.distributed`` process groups (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on GPU) created straight from a ``TCPStore``, never the process-global
default group: a target shard belongs to its tensor-parallel group AND (rank 0) to a
two-member channel group with the drafter, and that channel is rebuilt when a drafter is
replaced. (``ray.util.collective``'s torch backend keeps one default group per process, which
allows neither.) Rendezvous: the hosting actor opens a store on a free port and returns its
address; every member then joins concurrently.

Measured on this machine (see ``benchmarks/transport.py``): a gloo send/recv between two
actors moves a verify step's hidden states one to two orders of magnitude faster than Ray
Direct Transport's gloo path or the object store, so the channel uses it.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dspark.config import ConfigError

FEATURE_TAG = 7


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (unit tests of this module)
        return "127.0.0.1"


def node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray): what ``GET /health`` names for each actor."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001  (a driver without a node: unknown)
        return None


def device_placement() -> str:
    """Where this actor computes: ``"cpu"``, or ``"<node id>/gpu<ids>"`` for the GPUs Ray gave it."""
    import ray

    context = ray.get_runtime_context()
    gpus = context.get_accelerator_ids().get("GPU", [])
    return f"{context.get_node_id()}/gpu{','.join(map(str, gpus))}" if gpus else "cpu"


def feature_source(shard_placements: list[str], drafter_placement: str, configured: int | None = None) -> int:
    """The target shard that sends hidden states to the drafter.

    Every shard holds the full hidden states after its all-reduce, so any can send. NCCL refuses
    two ranks of one communicator on the same GPU, so with a drafter sharing a GPU with a shard
    (fractional GPUs on a full 8-GPU node) the sender must be another shard.
    """
    if configured is not None:
        return configured  # validated against tp_size by RuntimeSpec
    if drafter_placement == "cpu":
        return 0
    for rank, placement in enumerate(shard_placements):
        if placement != drafter_placement:
            return rank
    raise ConfigError("runtime.drafter_gpus", "every target shard shares the drafter's GPU and NCCL cannot connect "
                                              "two ranks on one GPU: give the drafter a GPU of its own")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    if backend == "auto":
        return "nccl" if torch.device(device).type == "cuda" else "gloo"
    return backend


class StoreHost:
    """The rendezvous store of one group, kept alive by the member that hosts it."""

    def __init__(self, world: int, timeout_s: float):
        self.store = dist.TCPStore(node_ip(), 0, world, True, datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)

    @property
    def address(self) -> tuple[str, int]:
        return node_ip(), self.store.port


def join_group(address: tuple[str, int], rank: int, world: int, backend: str, timeout_s: float,
               host: StoreHost | None = None) -> dist.ProcessGroup:
    """Join a group; blocks until all ``world`` members have joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = host.store if host is not None else dist.TCPStore(address[0], address[1], world, False, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world)
    if backend != "gloo":
        raise ValueError(f"unknown collective backend {backend!r}")
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def all_reduce_fn(group: dist.ProcessGroup):
    """A summing all-reduce over ``group`` for ``dspark.model.tensor_parallel.RowParallelLinear``."""

    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        group.allreduce([tensor]).wait()
        return tensor

    return all_reduce


@dataclass
class TransportCounters:
    messages: int = 0
    bytes: int = 0
    rows: int = 0
    seconds: float = 0.0  # time spent blocked in the transport by this side

    def as_dict(self) -> dict[str, float]:
        return {"messages": self.messages, "bytes": self.bytes, "rows": self.rows, "seconds": self.seconds}

    def __add__(self, other: TransportCounters) -> TransportCounters:
        return TransportCounters(self.messages + other.messages, self.bytes + other.bytes, self.rows + other.rows,
                                 self.seconds + other.seconds)


@dataclass
class FeatureChannel:
    """Rank 0 (target shard 0) sends packed committed-position features to rank 1 (the drafter).

    Each message is a header ``[rows, width]`` then the ``[rows, width]`` payload. Sends are
    non-blocking (the target goes on verifying); the tensors stay referenced until delivered. A gloo send's
    ``Work`` never reports completion by itself (``is_completed()`` stays False until ``wait()``), so the sender
    learns delivery from the protocol: :meth:`delivered` releases the oldest messages once the peer has received
    them (their ``wait()`` then returns at once).
    """

    group: dist.ProcessGroup
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")
    counters: TransportCounters = field(default_factory=TransportCounters)
    _in_flight: list = field(default_factory=list)

    def send(self, features: torch.Tensor) -> None:
        # features: [rows, width]
        start = time.perf_counter()
        payload = features.to(self.dtype).contiguous()
        header = torch.tensor(payload.shape, dtype=torch.long, device=self.device)
        for tensor in (header, payload):
            self._in_flight.append((self.group.send([tensor], 1, FEATURE_TAG), tensor))
        self._count(payload, time.perf_counter() - start)

    def recv(self) -> torch.Tensor:  # [rows, width]
        start = time.perf_counter()
        header = torch.empty(2, dtype=torch.long, device=self.device)
        self.group.recv([header], 0, FEATURE_TAG).wait()
        rows, width = header.tolist()
        payload = torch.empty(rows, width, dtype=self.dtype, device=self.device)
        self.group.recv([payload], 0, FEATURE_TAG).wait()
        self._count(payload, time.perf_counter() - start)
        return payload

    @property
    def undelivered(self) -> int:
        """Messages sent and not yet released by :meth:`delivered`."""
        return len(self._in_flight) // 2

    def delivered(self, through: int) -> None:
        """The peer has received every message up to the ``through``-th sent (``counters.messages`` when a call it
        answers was made): release their buffers."""
        done = max(len(self._in_flight) // 2 - (self.counters.messages - through), 0)  # the oldest ones
        for work, _ in self._in_flight[: 2 * done]:  # header and payload of each
            work.wait()  # delivered: returns at once
        del self._in_flight[: 2 * done]

    def _count(self, payload: torch.Tensor, seconds: float) -> None:
        self.counters.messages += 1
        self.counters.rows += payload.shape[0]
        self.counters.bytes += payload.numel() * payload.element_size()
        self.counters.seconds += seconds

