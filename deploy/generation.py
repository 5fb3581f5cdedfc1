"""The bridge from request handlers (asyncio) to the replica's ``ServingLoop`` (a thread): submit a prepared
request, wait for its admission, relay its token events, and turn every failure into an ``ApiError``.
Both protocols' handlers use it; a handler that stops listening (client gone) cancels its request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from actors.serving_loop import DeadlineExceeded, Event, InternalError, Overloaded, ServingLoop, Unavailable
from deploy.errors import ApiError
from deploy.request_adapter import PreparedRequest
from dspark.config import ConfigError


@dataclass
class Generation:
    """One admitted request: iterate ``events()`` for its tokens up to ``finished``."""

    loop: ServingLoop
    request_id: int
    queue: object  # asyncio.Queue[Event]
    prompt_tokens: int

    @classmethod
    async def start(cls, loop: ServingLoop, request: PreparedRequest) -> Generation:
        """Submit; return once the engine has accepted the request (or raise its refusal as an ``ApiError``)."""
        try:
            request_id, queue = loop.submit(request.prompt_ids, request.params, request.speculate)
        except Overloaded as exc:
            raise ApiError(429, str(exc), code="overloaded", retry_after_s=exc.retry_after_s) from None
        except Unavailable as exc:
            raise ApiError(503, str(exc), code="unavailable", retry_after_s=2.0) from None
        try:
            event: Event = await queue.get()
        except BaseException:  # the client left while the request waited for admission
            loop.cancel(request_id)
            raise
        if event.kind == "error":
            raise event_error(event)
        return cls(loop, request_id, queue, len(request.prompt_ids))

    async def events(self) -> AsyncIterator[Event]:
        """The request's token events up to and including ``finished``; cancels the request if abandoned."""
        done = False
        try:
            while True:
                event: Event = await self.queue.get()
                if event.kind == "error":
                    done = True
                    raise event_error(event)
                yield event
                if event.kind == "finished":
                    done = True
                    return
        finally:
            if not done:
                self.loop.cancel(self.request_id)

    def cancel(self) -> None:
        self.loop.cancel(self.request_id)


def event_error(event: Event) -> ApiError:
    error = event.error
    if isinstance(error, ConfigError):
        status = 413 if error.field == "prompt" and "context" in error.message else 400
        return ApiError(status, str(error), param=error.field)
    if isinstance(error, Unavailable):
        return ApiError(503, str(error), code="unavailable", retry_after_s=1.0)
    if isinstance(error, DeadlineExceeded):
        return ApiError(504, str(error), code="deadline_exceeded")
    if isinstance(error, InternalError):
        return ApiError(500, str(error), code="internal_error")
    return ApiError(500, f"internal error ({type(error).__name__})", code="internal_error")
