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
import time
from collections import deque
from dataclasses import dataclass

from actors.speculation_switch import SpeculationSwitch
from actors.telemetry import ReplicaTelemetry
from actors.tracing import RequestTracer
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


@dataclass
class _Timing:
    submitted: float
    last: float = 0.0  # last token delivery (0: none yet)
    remaining: int = 0  # tokens still owed (for autoscaling demand)


class ServingLoop:
    def __init__(self, engine: Engine, max_running: int, max_queued: int,
                 telemetry: ReplicaTelemetry | None = None, switch: SpeculationSwitch | None = None,
                 tracer: RequestTracer | None = None, window_s: float = 10.0):
        self.engine, self.telemetry, self.switch, self.tracer = engine, telemetry, switch, tracer
        if tracer is not None:
            engine.on_phase = tracer.phase
        self.window_s = window_s
        self._timing: dict[int, _Timing] = {}
        self._window: deque = deque()  # (time, completion tokens, request-rounds, steps, step seconds)
        self._last_tau, self._last_step = None, None  # last measured acceptance length and step time
        self.max_running, self.max_queued = max_running, max_queued
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._submissions: deque = deque()
        self._cancels: deque = deque()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self.step_errors = 0
        self.telemetry_interval_s = 0.25
        self._telemetry_at, self._telemetry_due = 0.0, False
        self.recovering = False  # the target is being restarted: new requests get Unavailable at once
        self._broken: Exception | None = None  # recovery failed: the health check reports it
        self._thread = threading.Thread(target=self._run, name="dspark-serving-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ handler side (event loop)
    @property
    def alive(self) -> bool:
        """The loop thread is running and the replica is not broken (the replica's health check)."""
        return self._thread.is_alive() and self._broken is None

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               speculate: bool = True) -> tuple[int, asyncio.Queue]:
        if self.recovering:
            raise Unavailable("replica is restarting its target after a failure; retry")
        with self._lock:
            if len(self._streams) >= self.max_running + self.max_queued:
                raise Overloaded(retry_after_s=1.0)
            request_id = next(self._ids)
            queue: asyncio.Queue = asyncio.Queue()
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
            self._submissions.append((request_id, prompt_ids, params, speculate))
            self._timing[request_id] = _Timing(time.monotonic(), remaining=params.max_tokens)
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
        self._observe(request_id, event, final)
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
                self._timing.pop(request_id, None)
            if self.tracer is not None:
                self.tracer.finish(request_id, "cancelled")
            if self.telemetry is not None:
                self.telemetry.inc("request_errors", kind="Cancelled")
        while self._submissions:
            request_id, prompt_ids, params, speculate = self._submissions.popleft()
            with self._lock:
                alive = request_id in self._streams
            if not alive:  # cancelled before it was admitted
                continue
            try:
                self.engine.add_request(prompt_ids, params, request_id=request_id, speculate=speculate)
            except ConfigError as exc:
                self._emit(request_id, Event("error", [], error=exc), final=True)
                continue
            self._emit(request_id, Event("accepted", [], prompt_tokens=len(prompt_ids)))

    def _observe(self, request_id: int, event: Event, final: bool) -> None:
        """Per-request latencies and outcomes (time to first token, inter-token latency, e2e)."""
        timing = self._timing.pop(request_id, None) if final else self._timing.get(request_id)
        if timing is None:
            return
        now, tel = time.monotonic(), self.telemetry
        if self.tracer is not None:
            if event.kind == "accepted":
                self.tracer.start(request_id, event.prompt_tokens, timing.remaining)
            elif final:
                m = event.metrics
                self.tracer.finish(request_id, event.finish_reason or event.kind,
                                   m.completion_tokens if m else 0, m.verify_steps if m else 0)
        if event.token_ids:
            timing.remaining -= len(event.token_ids)
            if tel is not None:
                if not timing.last:
                    tel.observe("time_to_first_token_seconds", now - timing.submitted)
                else:
                    for _ in event.token_ids:
                        tel.observe("inter_token_latency_seconds", (now - timing.last) / len(event.token_ids))
            timing.last = now
        if tel is None:
            return
        if event.kind == "accepted":
            tel.inc("prompt_tokens", event.prompt_tokens)
        elif event.kind == "finished":
            tel.observe("e2e_request_latency_seconds", now - timing.submitted)
            tel.inc("request_success", finished_reason=event.finish_reason or "unknown")
            if event.metrics is not None and event.metrics.verify_steps:
                tel.observe("spec_decode_acceptance_length",
                            event.metrics.completion_tokens / event.metrics.verify_steps)
        elif event.kind == "error":
            tel.inc("request_errors", kind=type(event.error).__name__)

    def _after_step(self) -> None:
        engine, now = self.engine, time.monotonic()
        m = engine.metrics
        self._window.append((now, m.completion_tokens, m.verify_steps, engine.num_steps, engine.timings["step"]))
        while len(self._window) > 1 and self._window[1][0] < now - self.window_s:
            self._window.popleft()  # keep one sample at or before the window's start
        if self.switch is not None:
            self.switch.update()
        self._telemetry_due = True
        if now - self._telemetry_at >= self.telemetry_interval_s or not engine.has_unfinished():
            self._record_telemetry(now)

    def _record_telemetry(self, now: float) -> None:
        """Engine counters and gauges into the exporters: every ``telemetry_interval_s`` while decoding and once
        when the loop goes idle, not after every step (some twenty metric updates: about a millisecond per
        step on the decode loop's critical path)."""
        engine, m = self.engine, self.engine.metrics
        self._telemetry_at, self._telemetry_due = now, False
        if self.telemetry is not None:
            tel = self.telemetry
            tel.record_engine(m)
            tel.set("num_requests_running", len(engine.running))
            tel.set("num_requests_waiting", len(engine.waiting) + len(self._submissions))
            alloc = engine.allocator
            tel.set("kv_cache_usage_perc", 1.0 - alloc.num_free_blocks / alloc.usable_blocks)
            tel.set("speculation_enabled", float(engine.speculation_enabled and engine.drafter is not None))

    def autoscaling_stats(self) -> dict[str, float]:
        """What the autoscaling policy reads (see ``deploy/autoscaling.py``), over the last window.

        Empty until the replica has decoded anything (the policy then holds); an idle replica
        keeps its last measured acceptance length and step time and reports zero demand."""
        now = time.monotonic()
        window = list(self._window)
        with self._lock:
            outstanding = float(sum(t.remaining for t in self._timing.values()))
        rate = 0.0
        if len(window) >= 2 and window[-1][2] > window[0][2]:
            (t0, tok0, rounds0, steps0, sec0), (_, tok1, rounds1, steps1, sec1) = window[0], window[-1]
            self._last_tau = (tok1 - tok0) / (rounds1 - rounds0)
            self._last_step = (sec1 - sec0) / max(steps1 - steps0, 1)
            rate = (tok1 - tok0) / max(now - t0, 1e-3)  # decays while the replica idles
        if self._last_tau is None:
            return {}
        return {"acceptance_length": self._last_tau, "step_seconds": self._last_step,
                "batch_slots": float(self.engine.config.max_num_seqs),
                "outstanding_tokens": outstanding, "token_rate": rate}

    def _run(self) -> None:
        while not self._stop:
            with self._lock:
                idle = not (self._submissions or self._cancels)
            if idle and not self.engine.has_unfinished():
                if self._telemetry_due:
                    self._record_telemetry(time.monotonic())
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            self._drain()
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
                self._after_step()
            except Exception as exc:  # the target (or its actors) failed: fail in-flight requests, retryable
                self.step_errors += 1
                self._telemetry_due = True
                log.exception("engine step failed; failing %d in-flight requests", len(self.engine.requests))
                self._fail_all(Unavailable(f"replica failed during decoding ({type(exc).__name__}); retry"))
                self._recover()
                continue
            for out in outputs:
                if out.finished:
                    request = self.engine.requests.pop(out.request_id)
                    self._emit(out.request_id, Event("finished", out.new_token_ids, out.finish_reason,
                                                     metrics=request.metrics), final=True)
                elif out.new_token_ids:
                    self._emit(out.request_id, Event("tokens", out.new_token_ids))
        if self._telemetry_due:  # closing: what the last steps counted still reaches the exporters
            self._record_telemetry(time.monotonic())

    def _recover(self) -> None:
        """Restart the target (and drafter) actors; meanwhile submissions are refused as retryable."""
        restart = getattr(self.engine, "restart_target", None)
        if restart is None:
            return
        self.recovering = True
        self._fail_queued(Unavailable("replica is restarting its target after a failure; retry"))
        try:
            start = time.monotonic()
            restart()
            log.warning("target restarted in %.1f s", time.monotonic() - start)
            if self.telemetry is not None:
                self.telemetry.inc("target_restarts")
        except Exception as exc:  # the replica cannot recover itself: let Serve replace it
            log.exception("target restart failed; reporting the replica unhealthy")
            self._broken = exc
        finally:
            self.recovering = False

    def _fail_queued(self, error: Exception) -> None:
        """Requests submitted but not yet admitted by the engine."""
        while self._submissions:
            request_id = self._submissions.popleft()[0]
            self._emit(request_id, Event("error", [], error=error), final=True)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self.engine.requests.pop(request_id, None)
            self._emit(request_id, Event("error", [], error=error), final=True)
