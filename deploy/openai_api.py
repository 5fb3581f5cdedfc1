"""The OpenAI-compatible HTTP API of one replica, built per replica by ``build_http_app(replica)``.

Routes only translate: the front door (``deploy.front_door``) has already checked the key and read the
body within its limits; the request adapter validates and tokenises; ``Generation`` relays the tokens.
"""

from __future__ import annotations

import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from deploy.auth import OPEN_PATHS
from deploy.errors import ApiError, install_handlers
from deploy.front_door import FrontDoor
from deploy.generation import Generation
from deploy.openai_protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, SpecStats
from deploy.request_adapter import PreparedRequest
from deploy.text_stream import TextStream

if TYPE_CHECKING:
    from deploy.server import DSparkServer

ERROR_RESPONSES = {code: {"model": ErrorResponse, "description": text} for code, text in (
    (400, "invalid request"), (401, "missing or invalid API key"), (404, "unknown model"),
    (408, "request body not received in time"), (413, "prompt or body too long"),
    (429, "replica at capacity; see Retry-After"), (500, "server bug; the request was aborted"),
    (503, "replica unavailable; retry (see Retry-After)"), (504, "request deadline exceeded"))}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def build_http_app(replica: DSparkServer | None) -> FastAPI:
    """The replica's FastAPI app (``replica`` None: the routes and schema only, for documentation and tests)."""
    api = FastAPI(title="DSpark serving API", version="1", docs_url="/docs", redoc_url=None,
                  description="OpenAI-compatible completions with DSpark speculative decoding.")
    install_handlers(api)
    if replica is not None:
        spec = replica.spec
        open_paths = OPEN_PATHS | ({"/metrics"} if not spec.metrics_need_key else set())
        api.add_middleware(FrontDoor, replica=replica.replica_id, keys=replica.keys, open_paths=open_paths,
                           max_body_bytes=spec.max_body_bytes, body_timeout_s=spec.body_timeout_s)

    @api.get("/health", summary="Liveness (open); with the API key, the replica's details")
    async def health(request: Request) -> JSONResponse:
        state = replica.loop.state
        body = {"status": state}
        if request.scope.get("state", {}).get("authorized", False):
            body.update(await _maybe_awaited(replica.health_details()))
        return JSONResponse(body, status_code=200 if state == "ok" else 503)

    @api.get("/metrics", summary="Prometheus metrics of this replica (no request content)",
             response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse((await _maybe_awaited(replica.telemetry.prometheus_text())).decode(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/v1/models", summary="The served model")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": replica.config.name, "object": "model",
                                            "created": replica.created, "owned_by": "dspark"}]}

    @api.post("/v1/completions", summary="Text completion (OpenAI-compatible)", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest):
        return await _respond(replica, await replica.adapter.prepare(body))

    @api.post("/v1/chat/completions", summary="Chat completion (OpenAI-compatible, the target's chat template)",
              responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest):
        return await _respond(replica, await replica.adapter.prepare(body))

    return api


async def _maybe_awaited(value):
    """A replica serving the API itself answers at once; a front door in its own deployment asks an engine replica
    (``deploy.ingress``)."""
    return await value if inspect.isawaitable(value) else value


async def _respond(replica: DSparkServer, request: PreparedRequest):
    generation = await Generation.start(replica.loop, request)
    chat, name = request.chat, replica.config.name
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    base = {"id": ident, "created": int(time.time()), "model": name}
    stream = TextStream(replica.tokenizer, request.params.stop)
    if not request.stream:
        final = None
        async for event in generation.events():
            stream.add(event.token_ids, final=event.kind == "finished")
            final = event
        choice = ({"index": 0, "message": {"role": "assistant", "content": stream.text}} if chat
                  else {"index": 0, "text": stream.text, "logprobs": None})
        choice["finish_reason"] = final.finish_reason
        return {**base, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": _usage(generation.prompt_tokens, final.metrics.completion_tokens),
                "spec": SpecStats.from_metrics(final.metrics).model_dump()}
    return _Stream(_sse(generation, base, stream, chat, request.include_usage), generation,
                   media_type="text/event-stream")


class _Stream(StreamingResponse):
    """A stream that cancels its request however the response ends: a client that leaves before the first
    chunk leaves a generator that never started, whose own ``finally`` would never run."""

    def __init__(self, content, generation: Generation, **kwargs):
        super().__init__(content, **kwargs)
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.cancel()


async def _sse(generation: Generation, base: dict, stream: TextStream, chat: bool,
               include_usage: bool) -> AsyncIterator[str]:
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, finish: str | None, first: bool = False, **extra) -> str:
        if chat:
            message = {"role": "assistant", "content": delta} if first else (
                {"content": delta} if delta is not None else {})
            choices = [{"index": 0, "delta": message, "finish_reason": finish}]
        else:
            choices = [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}]
        return f"data: {json.dumps({**base, 'object': kind, 'choices': choices, **extra})}\n\n"

    first = True
    try:
        async for event in generation.events():
            finished = event.kind == "finished"
            delta = stream.add(event.token_ids, final=finished)
            if delta or first:
                yield chunk(delta, None, first)
                first = False
            if finished:
                spec = SpecStats.from_metrics(event.metrics).model_dump()
                usage = _usage(generation.prompt_tokens, event.metrics.completion_tokens)
                yield chunk(None, event.finish_reason, spec=spec, **({} if include_usage else {"usage": usage}))
                if include_usage:
                    yield f"data: {json.dumps({**base, 'object': kind, 'choices': [], 'usage': usage})}\n\n"
    except ApiError as exc:  # headers are sent: report in-band, as OpenAI does
        yield f"data: {json.dumps(exc.body)}\n\n"
    yield "data: [DONE]\n\n"
