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
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

import ray

from actors.admission import Admission, AdmissionLimits, Overloaded
from actors.speculation_switch import SpeculationSwitch
from actors.telemetry import ReplicaTelemetry
from actors.tracing import RequestTracer
from dspark.config import ConfigError, SamplingParams
from dspark.decoding.engine import Engine
from dspark.decoding.metrics import SpecMetrics

log = logging.getLogger(__name__)


__all__ = ["DeadlineExceeded", "Event", "InternalError", "Overloaded", "ServingLoop", "Unavailable"]


class Unavailable(Exception):
    """The replica cannot serve this request now (its target failed); safe to retry."""


class DeadlineExceeded(Exception):
    """The request ran past its deadline and was aborted."""


class InternalError(Exception):
    """A step failed for a reason other than an actor failure (a server bug); the request was aborted."""


def is_actor_failure(exc: BaseException) -> bool:
    """A dead or unreachable actor, or a call past its deadline (a hung actor). A ``RayTaskError`` (the actor's
    method raised, the actor lives on) is not one."""
    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                            ray.exceptions.ObjectLostError, ray.exceptions.ActorUnavailableError))


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
    deadline: float
    prompt_tokens: int
    max_tokens: int
    last: float = 0.0  # last token delivery (0: none yet)
    delivered: int = 0

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.delivered


def _check_cores(cpus: set[int]) -> None:
    """``runtime.engine_cpus`` must be cores a thread of this process may run on (a container's cpuset may hold
    fewer than the node's): tried on a thread of its own, refused by name before the loop starts."""
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("runtime.engine_cpus", "pinning threads to cores needs Linux (os.sched_setaffinity)")
    failure: list[OSError] = []

    def attempt() -> None:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            failure.append(exc)

    probe = threading.Thread(target=attempt, name="dspark-engine-cpus-check")
    probe.start()
    probe.join()
    if failure:
        raise ConfigError("runtime.engine_cpus", f"cores {sorted(cpus)} are not available to this process "
                                                 f"({failure[0].strerror}; the node has {os.cpu_count()} cores)")


class ServingLoop:
    def __init__(self, engine: Engine, max_running: int, max_queued: int,
                 telemetry: ReplicaTelemetry | None = None, switch: SpeculationSwitch | None = None,
                 tracer: RequestTracer | None = None, window_s: float = 10.0, max_queued_tokens: int | None = None,
                 request_timeout_s: float = 600.0, cpus: list[int] | None = None):
        """``max_queued_tokens``: reserved tokens (prompt + max_tokens) admitted past the KV cache (default: one
        KV cache's worth); ``request_timeout_s``: each request's deadline from submission; ``cpus``: the cores the
        loop thread steps the engine on (``runtime.engine_cpus``: an engine computing in this process; the OpenMP
        threads it starts inherit them), None: the process's."""
        self.engine, self.telemetry, self.switch, self.tracer = engine, telemetry, switch, tracer
        self.cpus = set(cpus) if cpus else None
        if self.cpus is not None:
            _check_cores(self.cpus)
        alloc = engine.allocator
        kv_tokens = alloc.usable_blocks * alloc.block_size
        self.admission = Admission(AdmissionLimits(
            max_running + max_queued, kv_tokens, kv_tokens if max_queued_tokens is None else max_queued_tokens,
            request_timeout_s))
        if tracer is not None:
            engine.on_phase = tracer.phase
        self.window_s = window_s
        self._timing: dict[int, _Timing] = {}
        self._window: deque = deque()  # (time, completion tokens, request-rounds, steps, step seconds)
        self._last_tau, self._last_step = None, None  # last measured acceptance length and step time
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._submissions: deque = deque()
        self._cancels: deque = deque()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._closed = False  # set (under the lock) once the loop fails everything it holds and takes no more
        self.step_errors = 0
        self.telemetry_interval_s = 0.25
        self._telemetry_at, self._telemetry_due = 0.0, False
        self.recovering = False  # the target is being restarted: new requests get Unavailable at once
        self._broken: BaseException | None = None  # recovery failed or the thread died: the health check reports it
        self.target_restarts = 0
        self.internal_errors = 0
        self.deadlines_exceeded = 0
        self._step_started: float | None = None  # monotonic start of the step in progress (None: between steps)
        self._snapshot: dict = {}
        self._publish()
        self._thread = threading.Thread(target=self._run, name="dspark-serving-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ handler side (event loop)
    @property
    def alive(self) -> bool:
        """The loop thread is running and the replica is not broken (the replica's health check)."""
        return self._thread.is_alive() and self._broken is None

    @property
    def state(self) -> str:
        """``ok``, ``recovering`` (restarting its actors), ``stalled`` (a step ran past twice the target's
        deadline: the deadline itself did not act) or ``broken`` (the loop is gone: the replica must be replaced)."""
        if not self.alive:
            return "broken"
        if self.recovering:
            return "recovering"
        started = self._step_started
        if started is not None and time.monotonic() - started > self.stall_after_s:
            return "stalled"
        return "ok"

    @property
    def stall_after_s(self) -> float:
        timeout = getattr(getattr(self.engine, "target", None), "timeout_s", None)
        return 2 * timeout + 10 if timeout else math.inf

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def snapshot(self) -> dict:
        """The loop's counters as of its last step boundary (safe to read from any thread)."""
        return self._snapshot

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               speculate: bool = True) -> tuple[int, asyncio.Queue]:
        """Admit a request (or raise ``Overloaded`` / ``Unavailable`` at once)."""
        event_loop = asyncio.get_running_loop()
        now = time.monotonic()
        deadline = now + self.admission.limits.request_timeout_s
        with self._lock:  # the loop thread sets _closed under this lock before it fails what it holds
            if self._closed or not self.alive:
                raise Unavailable("replica's serving loop stopped; retry (the replica is being replaced)")
            if self.recovering:
                raise Unavailable("replica is restarting its target after a failure; retry")
            self.admission.admit(len(prompt_ids), params.max_tokens)
            request_id = next(self._ids)
            queue: asyncio.Queue = asyncio.Queue()
            self._streams[request_id] = (event_loop, queue)
            self._submissions.append((request_id, prompt_ids, params, speculate))
            self._timing[request_id] = _Timing(now, deadline, len(prompt_ids), params.max_tokens)
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
            if final:
                self._release(request_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, event)

    def _drain(self) -> None:
        while self._cancels:
            request_id = self._cancels.popleft()
            with self._lock:
                if self._streams.pop(request_id, None) is None:  # finished meanwhile, or cancelled twice
                    continue
                self._release(request_id)
            self._abort(request_id)
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

    def _abort(self, request_id: int) -> None:
        """Stop the engine's work on a request (its KV blocks are free) and forget it."""
        self.engine.abort(request_id)
        self.engine.requests.pop(request_id, None)

    def _release(self, request_id: int) -> None:
        """The request left the replica (under the lock): its admission counts are given back."""
        timing = self._timing.pop(request_id, None)
        if timing is not None:
            self.admission.release(timing.prompt_tokens, timing.max_tokens, timing.delivered)

    def _observe(self, request_id: int, event: Event, final: bool) -> None:
        """Per-request latencies and outcomes (time to first token, inter-token latency, e2e)."""
        timing = self._timing.get(request_id)
        if timing is None:
            return
        now, tel = time.monotonic(), self.telemetry
        if self.tracer is not None:
            if event.kind == "accepted":
                self.tracer.start(request_id, event.prompt_tokens, timing.max_tokens)
            elif final:
                m = event.metrics
                self.tracer.finish(request_id, event.finish_reason or event.kind,
                                   m.completion_tokens if m else 0, m.verify_steps if m else 0)
        if event.token_ids:
            with self._lock:
                timing.delivered += len(event.token_ids)
                self.admission.progress(len(event.token_ids))
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
        with self._lock:  # autoscaling_stats copies the window from Serve's threads
            self._window.append((now, m.completion_tokens, m.verify_steps, engine.num_steps, engine.timings["step"]))
            while len(self._window) > 1 and self._window[1][0] < now - self.window_s:
                self._window.popleft()  # keep one sample at or before the window's start
            (_, tok0, _, _, sec0), (_, tok1, _, _, sec1) = self._window[0], self._window[-1]
        if sec1 - sec0 > 1.0:  # decode throughput while stepping (what admission's time bound divides by)
            self.admission.rate = (tok1 - tok0) / (sec1 - sec0)
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
            tel.record_timings(engine.timings)
            sources = getattr(engine, "draft_sources", None)
            if sources:
                tel.record_sources(sources)
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
        with self._lock:
            window = list(self._window)
            outstanding = float(sum(t.remaining for t in self._timing.values()))
        rate = 0.0
        if len(window) >= 2 and window[-1][2] > window[0][2]:
            (t0, tok0, rounds0, steps0, sec0), (_, tok1, rounds1, steps1, sec1) = window[0], window[-1]
            self._last_tau = (tok1 - tok0) / (rounds1 - rounds0)
            self._last_step = (sec1 - sec0) / max(steps1 - steps0, 1)
            # over the whole window even while the replica's history is shorter (its first requests): a rate over
            # the few seconds since the first step would read a warm-up request as a burst of demand
            rate = (tok1 - tok0) / max(now - t0, self.window_s)  # decays while the replica idles
        if self._last_tau is None:
            return {}
        return {"acceptance_length": self._last_tau, "step_seconds": self._last_step,
                "batch_slots": float(self.engine.config.max_num_seqs),
                "outstanding_tokens": outstanding, "token_rate": rate}

    def _run(self) -> None:
        try:
            if self.cpus is not None:
                os.sched_setaffinity(0, self.cpus)  # this thread, before it starts its OpenMP threads
            self._serve()
        except BaseException as exc:  # a bug outside a step: the replica cannot serve; its health check says so
            self._broken = exc
            log.exception("the serving loop died; failing every request and reporting the replica unhealthy")
            self._fail_everything(Unavailable("replica's serving loop stopped; retry"))
            raise
        self._fail_everything(Unavailable("replica is shutting down; retry"))  # closed: nothing left waiting

    def _serve(self) -> None:
        while not self._stop:
            with self._lock:
                idle = not (self._submissions or self._cancels)
            if idle and not self.engine.has_unfinished():
                if self._telemetry_due:
                    self._record_telemetry(time.monotonic())
                self._publish()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            self._drain()
            self._expire()
            if not self.engine.has_unfinished():
                continue
            self._step_started = time.monotonic()
            try:
                outputs = self.engine.step()
                self._after_step()
            except Exception as exc:
                self._on_step_failure(exc)
                continue
            finally:
                self._step_started = None
            for out in outputs:
                if out.finished:
                    request = self.engine.requests.pop(out.request_id)
                    self._emit(out.request_id, Event("finished", out.new_token_ids, out.finish_reason,
                                                     metrics=request.metrics), final=True)
                elif out.new_token_ids:
                    self._emit(out.request_id, Event("tokens", out.new_token_ids))
            self._publish()
        if self._telemetry_due:  # closing: what the last steps counted still reaches the exporters
            self._record_telemetry(time.monotonic())

    def _on_step_failure(self, exc: Exception) -> None:
        self.step_errors += 1
        self._telemetry_due = True
        if is_actor_failure(exc):  # a dead or hung actor: fail in-flight requests as retryable, restart the actors
            log.error("engine step failed (%s: %s); failing %d in-flight requests and restarting the actors",
                      type(exc).__name__, exc, len(self.engine.requests))
            self._fail_all(Unavailable(f"replica failed during decoding ({type(exc).__name__}); retry"))
            self._recover()
        else:  # a bug: the actors are fine; the requests of this step cannot be trusted
            self.internal_errors += 1
            log.exception("engine step failed; failing %d in-flight requests", len(self.engine.requests))
            self._fail_all(InternalError(f"internal error during decoding ({type(exc).__name__})"))
            self.engine.reset_transient_state()
        self._publish()

    def _expire(self) -> None:
        """Abort requests past their deadline (queued or decoding)."""
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, timing in self._timing.items() if timing.deadline < now]
        for request_id in expired:
            self.deadlines_exceeded += 1
            self._abort(request_id)
            self._emit(request_id, Event("error", [], error=DeadlineExceeded("request deadline exceeded")),
                       final=True)
        if expired:  # a queued (not yet admitted) one: its submission is dropped
            with self._lock:
                self._submissions = deque(s for s in self._submissions if s[0] not in expired)

    def _publish(self) -> None:
        """Counters for handlers (``snapshot``), taken on the loop thread between steps."""
        engine, alloc = self.engine, self.engine.allocator
        with self._lock:
            in_flight, admission = len(self._streams), self.admission
            reserved, owed = admission.reserved, admission.owed
        self._snapshot = {
            "in_flight": in_flight, "running": len(engine.running), "waiting": len(engine.waiting),
            "kv_free_blocks": alloc.num_free_blocks, "kv_total_blocks": alloc.usable_blocks,
            "reserved_tokens": reserved, "owed_tokens": owed,
            "decode_tokens_per_s": round(admission.rate, 1) if admission.rate else None,
            "refused": dict(admission.refused), "step_errors": self.step_errors,
            "internal_errors": self.internal_errors, "target_restarts": self.target_restarts,
            "deadlines_exceeded": self.deadlines_exceeded,
        }

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
            self.target_restarts += 1
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
            self._abort(request_id)
            self._emit(request_id, Event("error", [], error=error), final=True)

    def _fail_everything(self, error: Exception) -> None:
        """The loop is going away: every request it holds, admitted or not, gets ``error``; no more are taken."""
        with self._lock:
            self._closed = True
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._emit(request_id, Event("error", [], error=error), final=True)
