"""The state of one generation request as it moves through the engine."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from enum import Enum

import torch

from dspark.config import SamplingParams
from dspark.decoding.draft_gate import GateState
from dspark.decoding.metrics import SpecMetrics
from dspark.decoding.sources import RowSources


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one engine step emits for one request."""

    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)  # prompt + committed output
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_cached: int = 0  # tokens whose keys/values are in the target cache (all but the anchor)
    microbatch: int = 0  # which of the router's two pipelined micro-batches it belongs to
    wants_speculation: bool = True  # False: the client asked for plain decoding
    speculative: bool = True  # drafted for; False once it decodes without a drafter (e.g. after a drafter failure)
    new_tokens: list[int] = field(default_factory=list)  # committed since the last emit
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    generator: torch.Generator = field(default_factory=torch.Generator)
    gate: GateState | None = None  # the draft gate's record of this request (None: always drafts)
    sources: RowSources | None = None  # its part in choosing lookup or the head (speculative requests)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.generator.manual_seed(seed)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def anchor(self) -> int:
        return self.tokens[-1]

    @property
    def num_uncached(self) -> int:
        return len(self.tokens) - self.num_cached

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def reservation(self) -> int:
        """Tokens this request may ever hold in a cache."""
        return len(self.prompt_ids) + self.params.max_tokens + 1
