"""Admission of one replica: requests are counted, and weighed in tokens, before any work is done.

A request asks for ``prompt + max_tokens`` tokens of KV cache and ``max_tokens`` tokens of
decoding time. ``Admission.check`` refuses at once (``Overloaded``, with a ``Retry-After``
estimate) when admitting it would pass any of:

- the request bound: ``max_running + max_queued`` requests in flight;
- the KV bound: the tokens reserved by every request in flight, plus this one, within the KV
  cache plus ``max_queued_tokens`` of queue (requests past the cache wait for a slot);
- the time bound: at the replica's measured decode throughput, the tokens still owed to every
  request in flight plus this one's ``max_tokens`` would take longer than ``request_timeout_s``
  (the request would miss its deadline anyway; known once the replica has decoded for a while).

The counts live here; ``ServingLoop`` calls ``admit`` and ``release`` under its lock and
``progress`` as tokens are delivered.
"""

from __future__ import annotations

from dataclasses import dataclass


class Overloaded(Exception):
    """The replica is at a bound; retry after ``retry_after_s``."""

    def __init__(self, reason: str, retry_after_s: float):
        super().__init__(f"server busy ({reason}), retry after {retry_after_s:.0f} s")
        self.reason, self.retry_after_s = reason, retry_after_s

    def __reduce__(self):  # crosses processes intact (a front door in its own deployment relays it)
        return Overloaded, (self.reason, self.retry_after_s)


@dataclass(frozen=True)
class AdmissionLimits:
    max_requests: int  # running + queued
    kv_tokens: int  # tokens the KV cache holds
    max_queued_tokens: int  # reserved tokens allowed past the KV cache (waiting for a slot)
    request_timeout_s: float  # a request's deadline from submission

    @property
    def max_reserved_tokens(self) -> int:
        return self.kv_tokens + self.max_queued_tokens


MIN_RETRY_S, MAX_RETRY_S = 1.0, 60.0


class Admission:
    def __init__(self, limits: AdmissionLimits):
        self.limits = limits
        self.reserved = 0  # prompt + max_tokens of every request in flight
        self.owed = 0  # new tokens still owed to requests in flight
        self.count = 0
        self.rate: float | None = None  # measured decode throughput, tokens per busy second
        self.refused: dict[str, int] = {"requests": 0, "kv_tokens": 0, "deadline": 0}

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise ``Overloaded`` if this request may not be admitted now."""
        lim, rate = self.limits, self.rate
        if self.count >= lim.max_requests:
            self._refuse("requests", self._drain_s(max_tokens))
        demand = prompt_tokens + max_tokens
        if self.reserved + demand > lim.max_reserved_tokens and self.count:
            self._refuse("kv_tokens", self._drain_s(self.reserved + demand - lim.max_reserved_tokens))
        if rate and self.count and (self.owed + max_tokens) / rate > lim.request_timeout_s:
            self._refuse("deadline", (self.owed + max_tokens) / rate - lim.request_timeout_s)

    def admit(self, prompt_tokens: int, max_tokens: int) -> None:
        self.check(prompt_tokens, max_tokens)
        self.count += 1
        self.reserved += prompt_tokens + max_tokens
        self.owed += max_tokens

    def progress(self, new_tokens: int) -> None:
        self.owed -= new_tokens

    def release(self, prompt_tokens: int, max_tokens: int, delivered: int) -> None:
        self.count -= 1
        self.reserved -= prompt_tokens + max_tokens
        self.owed -= max_tokens - delivered

    def _drain_s(self, tokens: int) -> float:
        """Seconds until ``tokens`` tokens of work drain at the measured rate (a guess before any measurement)."""
        return tokens / self.rate if self.rate else MIN_RETRY_S

    def _refuse(self, reason: str, wait_s: float) -> None:
        self.refused[reason] += 1
        raise Overloaded(reason, min(max(wait_s, MIN_RETRY_S), MAX_RETRY_S))
