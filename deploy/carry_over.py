"""Carry-over: the front door's view of the engine replicas when it runs as its own deployment
(``serving.front_door: deployment``), with what a lost replica's requests need to go on elsewhere.

``RemoteLoop`` offers the request handlers what a replica's ``ServingLoop`` offers them (``submit``, ``cancel``,
``state``: ``deploy.generation`` drives either), over a streaming Serve handle to the engine deployment's
``EngineReplica.generate_events`` (``deploy.server``). It keeps each request's prompt and every token already sent
to its client. When the replica decoding a request is lost (its node removed, its process killed, its drain's grace
period run out: the stream breaks with a Ray actor error, or the replica reports itself unavailable), the request is
re-submitted to a live replica as the prompt plus the tokens sent, for the tokens still owed, and its new tokens
follow the old ones on the same client stream: no gap, no repeated token, the ``accepted`` event of the new attempt
swallowed. The output so far is a prefix of the target's own output, so the result is still exactly the target's:
greedy decoding continues as an undisturbed run would (the target's argmax of the same context), and a sampled
continuation is drawn from the target's distribution given that prefix (a seeded request's draws restart from its
seed on the new replica, so its text is not the undisturbed run's).

Bounded: at most ``limit`` carry-overs per request and not past ``max_tokens`` of prompt plus tokens sent (the
state kept per request); beyond, the request fails with the retryable 503 it would get without a carry-over. A
request whose replica refuses it before admitting it (429 at a bound, 400 on a bad request) gets that answer.
The final event's counters are the last attempt's, with ``completion_tokens`` counting every token sent.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import replace

import ray

from actors.serving_loop import Event, Unavailable
from dspark.config import SamplingParams

log = logging.getLogger("dspark.carry_over")


def replica_lost(exc: BaseException) -> bool:
    """The stream broke because its replica is gone or unreachable (not because its method raised)."""
    return isinstance(exc, ray.exceptions.RayError) and not isinstance(exc, ray.exceptions.RayTaskError)


class RemoteLoop:
    def __init__(self, engine, limit: int, max_tokens: int, on_carry_over=None):
        """``engine``: a Serve handle to the engine deployment; ``on_carry_over()``: called once per carry-over
        (the front door's counter)."""
        self.engine = engine.options(stream=True)
        self.limit, self.max_tokens, self.on_carry_over = limit, max_tokens, on_carry_over
        self.carry_overs = 0
        self._ids = itertools.count()
        self._tasks: dict[int, asyncio.Task] = {}

    @property
    def state(self) -> str:
        return "ok"  # the front door answers; each engine replica's state is in its /health details

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               speculate: bool = True) -> tuple[int, asyncio.Queue]:
        """Start the request on an engine replica; its events arrive on the returned queue (``accepted`` first,
        or an ``error`` with the replica's refusal)."""
        request_id, queue = next(self._ids), asyncio.Queue()
        task = asyncio.get_running_loop().create_task(self._relay(list(prompt_ids), params, speculate, queue))
        self._tasks[request_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(request_id, None))
        return request_id, queue

    def cancel(self, request_id: int) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()  # closes the stream: the engine replica cancels the request

    async def _relay(self, prompt_ids: list[int], params: SamplingParams, speculate: bool,
                     queue: asyncio.Queue) -> None:
        sent: list[int] = []  # tokens already on their way to the client
        admitted, carried = False, 0
        while True:
            owed = params if not sent else replace(params, max_tokens=params.max_tokens - len(sent))
            try:
                async for event in self.engine.generate_events.remote(prompt_ids + sent, owed, speculate):
                    if event.kind == "accepted":
                        if not admitted:
                            admitted = True
                            queue.put_nowait(event)
                        continue
                    if event.kind == "error" and admitted and isinstance(event.error, Unavailable):
                        raise _Lost(str(event.error))  # its replica is shutting down or broke: carry over
                    if event.kind in ("tokens", "finished"):
                        sent.extend(event.token_ids)
                    if event.kind == "finished" and event.metrics is not None:
                        event = replace(event, prompt_tokens=len(prompt_ids),
                                        metrics=replace(event.metrics, completion_tokens=len(sent)))
                    queue.put_nowait(event)
                    if event.kind in ("finished", "error"):
                        return
                lost = "the replica's stream ended before the request finished"
            except asyncio.CancelledError:
                raise
            except _Lost as exc:
                lost = str(exc)
            except Exception as exc:  # noqa: BLE001  (anything else is the request's error, reported once)
                if not replica_lost(exc):
                    log.exception("front door: a request failed")
                    queue.put_nowait(Event("error", [], error=exc))
                    return
                lost = f"{type(exc).__name__}"
            if carried >= self.limit or len(prompt_ids) + len(sent) > self.max_tokens:
                queue.put_nowait(Event("error", [], error=Unavailable(
                    f"the request's replica was lost ({lost}) and it was carried over {carried} times "
                    f"(serving.carry_over_limit {self.limit}); retry")))
                return
            carried += 1
            self.carry_overs += 1
            if self.on_carry_over is not None:
                self.on_carry_over()
            log.warning("front door: replica lost (%s) %s; carrying the request over with %d tokens sent "
                        "(carry-over %d of %d)", lost, "mid-request" if admitted else "before admission",
                        len(sent), carried, self.limit)


class _Lost(Exception):
    """The replica reported itself unavailable after admitting the request."""
