"""The DSpark drafter actor and the router's handle on it.

``DraftWorker`` holds the draft head, its own copy of the target's embedding and LM head, the
per-sequence context cache and one random generator per request. The context rows (fused
target hidden states) arrive from target shard 0 over the feature channel; the router only
says which requests each message belongs to. Draft tokens, confidences and the (sparse)
draft distributions go back to the router as an ordinary actor result.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field

import ray
import torch

from actors.collective import FeatureChannel, TransportCounters, device_placement, join_group, resolve_backend
from actors.serialization import register_tensor_serializer
from dspark.decoding.drafter import DraftInputs, DSparkDrafter
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

    started: list[tuple[int, int, int]]  # (request id, cache reservation in tokens, seed)
    released: list[int]
    ingest: list[tuple[list[int], list[int]]]  # per feature message, in send order: request ids, rows each
    inputs: DraftInputs
    temperature: torch.Tensor  # [B]
    top_p: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B]


@ray.remote
class DraftWorker:
    def __init__(self, config: EngineFileConfig):
        runtime = config.runtime
        register_tensor_serializer()
        torch.set_num_threads(runtime.drafter_threads or os.cpu_count() or 1)  # Ray's default is 1 per CPU reserved
        use_gpu = runtime.drafter_gpus > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
        self.config = config
        target_cfg, embed, lm_head = load_target_head(config.resolve(config.target.path), config.target.dtype)
        draft = load_draft(config.resolve(config.draft.path), target_cfg, DTYPES[config.draft.dtype])
        draft.bind_target(embed.to(self.device), lm_head.to(self.device))
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

    def placement(self) -> str:
        return device_placement()


@dataclass
class RemoteDrafter:
    """The router's ``Drafter``: batches start/release/ingest bookkeeping into the next draft call.

    ``result`` returns None when the actor died or timed out; the engine then decodes those
    requests without drafts, and the router replaces the actor.
    """

    actor: object
    block_size: int
    timeout_s: float
    available: bool = True
    last_timing: dict = field(default_factory=dict)  # the actor's recv_s / draft_s of the last call
    _started: list = field(default_factory=list)
    _released: list = field(default_factory=list)
    _ingest: list = field(default_factory=list)

    def can_start(self, request: Request) -> bool:
        return True  # same token budget as the target's cache, whose reservation is checked first

    def start(self, request: Request) -> None:
        seed = request.params.seed if request.params.seed is not None else secrets.randbits(62)
        self._started.append((request.request_id, request.reservation, seed + 1))

    def release(self, request: Request) -> None:
        self._released.append(request.request_id)

    def commit(self, request_ids: list[int], kept: list[int], features: torch.Tensor | None) -> None:
        self._ingest.append((request_ids, kept))

    def submit(self, requests: list[Request], sampling: SamplingTensors):
        call = DraftCall(self._started, self._released, self._ingest, DraftInputs.from_requests(requests),
                         sampling.temperature, sampling.top_p, sampling.top_k)
        self._started, self._released, self._ingest = [], [], []
        return self.actor.propose.remote(call)

    def result(self, ref) -> DraftProposal | None:
        try:
            proposal, self.last_timing = ray.get(ref, timeout=self.timeout_s)
            return proposal
        except (ray.exceptions.RayError, TimeoutError):
            self.available = False
            return None

    def round_seconds(self) -> float:
        return ray.get(self.actor.round_seconds.remote())
