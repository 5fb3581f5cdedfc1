"""The serving loop: a router's step loop on its own thread, fed by asyncio request handlers.

Request handlers (HTTP, gRPC) live on an asyncio event loop; the router is synchronous and
not thread-safe. ``ServingLoop`` owns the router from one background thread: handlers
``submit`` (admission control happens right there: over the concurrency and queue bounds
they get ``Overloaded`` at once), then read a per-request ``asyncio.Queue`` of events. The
thread drains submissions and cancellations between steps, so a client that goes away has
its request aborted and its KV cache freed at the next step boundary.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass

from dspark.config import ConfigError, SamplingParams
from dspark.engine import Engine
from dspark.metrics import SpecMetrics

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The replica is at its concurrency and queue bounds; retry after ``retry_after_s``."""

    def __init__(self, retry_after_s: float):
        super().__init__(f"server busy, retry after {retry_after_s:g} s")
        self.retry_after_s = retry_after_s


class Unavailable(Exception):
    """The replica cannot serve this request now (its target failed); safe to retry."""


@dataclass
class Event:
    """What a request's queue carries: accepted, tokens, finished, or an error."""

    kind: str  # "accepted" | "tokens" | "finished" | "error"
    token_ids: list[int]
    finish_reason: str | None = None
    error: Exception | None = None
    metrics: SpecMetrics | None = None
    prompt_tokens: int = 0


class ServingLoop:
    def __init__(self, engine: Engine, max_running: int, max_queued: int):
        self.engine = engine
        self.max_running, self.max_queued = max_running, max_queued
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._submissions: deque = deque()
        self._cancels: deque = deque()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self.step_errors = 0
        self._thread = threading.Thread(target=self._run, name="dspark-serving-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ handler side (event loop)
    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> tuple[int, asyncio.Queue]:
        with self._lock:
            if len(self._streams) >= self.max_running + self.max_queued:
                raise Overloaded(retry_after_s=1.0)
            request_id = next(self._ids)
            queue: asyncio.Queue = asyncio.Queue()
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
            self._submissions.append((request_id, prompt_ids, params))
        self._wake.set()
        return request_id, queue

    def cancel(self, request_id: int) -> None:
        with self._lock:
            if request_id in self._streams:
                self._cancels.append(request_id)
        self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ loop side (thread)
    def _emit(self, request_id: int, event: Event, final: bool = False) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, event)

    def _drain(self) -> None:
        while self._cancels:
            request_id = self._cancels.popleft()
            self.engine.abort(request_id)
            if request_id in self.engine.requests:
                self.engine.requests.pop(request_id)
            with self._lock:
                self._streams.pop(request_id, None)
        while self._submissions:
            request_id, prompt_ids, params = self._submissions.popleft()
            with self._lock:
                alive = request_id in self._streams
            if not alive:  # cancelled before it was admitted
                continue
            try:
                self.engine.add_request(prompt_ids, params, request_id=request_id)
            except ConfigError as exc:
                self._emit(request_id, Event("error", [], error=exc), final=True)
                continue
            self._emit(request_id, Event("accepted", [], prompt_tokens=len(prompt_ids)))

    def _run(self) -> None:
        while not self._stop:
            with self._lock:
                idle = not (self._submissions or self._cancels)
            if idle and not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            self._drain()
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # the target (or its actors) failed: fail in-flight requests, retryable
                self.step_errors += 1
                log.exception("engine step failed; failing %d in-flight requests", len(self.engine.requests))
                self._fail_all(Unavailable(f"replica failed during decoding ({type(exc).__name__}); retry"))
                continue
            for out in outputs:
                if out.finished:
                    request = self.engine.requests.pop(out.request_id)
                    self._emit(out.request_id, Event("finished", out.new_token_ids, out.finish_reason,
                                                     metrics=request.metrics), final=True)
                elif out.new_token_ids:
                    self._emit(out.request_id, Event("tokens", out.new_token_ids))

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self.engine.requests.pop(request_id, None)
            self._emit(request_id, Event("error", [], error=error), final=True)
