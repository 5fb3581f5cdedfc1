"""The ingress of one serving replica: OpenAI-compatible HTTP and the dspark.v1 gRPC API.

Each replica owns a ``Router`` (its target shard actors and drafter actor live in the
replica's placement group, bundles 1..n) driven by a ``ServingLoop`` thread. HTTP and gRPC
handlers only translate: validate, submit, relay events, map errors to status codes.
Prompts and API keys are never logged.
"""


import functools
import hmac
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import torch
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.exceptions import RayServeException
from ray.util import get_current_placement_group
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.router import Router
from actors.serving_loop import Event, Overloaded, ServingLoop, Unavailable
from actors.speculation_switch import SpeculationSwitch
from actors.telemetry import ReplicaTelemetry
from actors.tracing import RequestTracer, make_provider
from deploy.openai_protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, SpecStats, _Request
from deploy.text_stream import TextStream
from dspark.config import ConfigError, SamplingParams
from dspark.prepare import default_target_dir, prepare_target
from dspark.schema import EngineFileConfig, ServingSpec, sampling_from_values
from dspark.v1 import serving_pb2 as pb

log = logging.getLogger("dspark.server")
MAX_BODY_BYTES = 4 << 20


class ApiError(Exception):
    """An error with its HTTP status and OpenAI error body; ``grpc_code`` for the gRPC API."""

    GRPC = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
            404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
            429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        headers = {"Retry-After": f"{max(int(self.retry_after_s + 0.999), 1)}"} if self.retry_after_s else None
        body = {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


def read_api_key(spec: ServingSpec) -> str | None:
    if spec.api_key_file:
        path = Path(os.path.expanduser(spec.api_key_file))
        if not path.is_file():
            raise ConfigError("serving.api_key_file", f"{path} does not exist")
        return path.read_text().strip() or None
    return os.environ.get(spec.api_key_env) or None


def _usage(prompt_tokens: int, final: Event) -> dict:
    completion = final.metrics.completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def _pb_usage(prompt_tokens: int, final: Event) -> pb.Usage:
    return pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=final.metrics.completion_tokens)


def _pb_spec(final: Event) -> pb.SpecStats:
    return pb.SpecStats(**SpecStats.from_metrics(final.metrics).model_dump())


def check_key(expected: str | None, presented: str | None) -> None:
    if expected is None:
        return
    token = (presented or "").removeprefix("Bearer ").strip()
    if not token or not hmac.compare_digest(token.encode(), expected.encode()):
        raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")


async def authorize(request: Request) -> None:
    """Runs before the body is parsed: an unauthenticated caller learns nothing about validation."""
    check_key(request.app.state.api_key, request.headers.get("authorization"))
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")


ERROR_RESPONSES = {code: {"model": ErrorResponse, "description": text} for code, text in (
    (400, "invalid request"), (401, "missing or invalid API key"), (404, "unknown model"),
    (413, "prompt or body too long"), (429, "replica at capacity; see Retry-After"),
    (503, "replica unavailable; retry"))}

REPLICA_HEADER = "x-dspark-replica"


@functools.cache
def replica_id() -> str:
    """This Serve replica's id ("local" outside a replica)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:
        return "local"


class ReplicaHeader:
    """Pure ASGI middleware: every HTTP response names the replica that produced it (errors and
    streams included), so a client or a test can tell which replica a request met."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(REPLICA_HEADER, replica_id())
            await send(message)

        await self.app(scope, receive, send_named)


api = FastAPI(title="DSpark serving API", version="1",
              description="OpenAI-compatible completions with DSpark speculative decoding.")
api.state.api_key = None
api.add_middleware(ReplicaHeader)


@api.exception_handler(ApiError)
async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return ApiError(exc.status_code, str(exc.detail)).response()


@api.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    log.error("request failed: %s", type(exc).__name__)  # no request content in logs
    return JSONResponse({"error": {"message": "internal server error", "type": "server_error", "param": None,
                                   "code": None}}, status_code=500)


@api.exception_handler(RequestValidationError)
async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    item = exc.errors()[0]
    if item.get("type") == "json_invalid":
        return ApiError(400, "request body is not valid JSON").response()
    param = ".".join(str(p) for p in item["loc"][1:]) or None
    message = item["msg"]
    return ApiError(400, f"{param}: {message}" if param else message, param=param).response()


def _speculation(request: pb.GenerateRequest) -> bool:
    return request.speculation if request.HasField("speculation") else True


@serve.deployment
@serve.ingress(api)
class DSparkServer:
    def __init__(self, config: EngineFileConfig):
        self.config, self.spec = config, config.serving
        self.api_key = read_api_key(config.serving)
        api.state.api_key = self.api_key
        self.replica_id = replica_id()
        if config.resolve(config.target.path) == default_target_dir():
            prepare_target()  # the embedded default converts itself on first start (no-op when cached)
        placement = get_current_placement_group()
        torch.set_num_threads(config.runtime.router_threads)  # the router only batches; actors compute
        # The loop thread and the request handlers share the GIL; with CPython's default 5 ms switch interval a
        # handler formatting a chunk can hold the next step back for up to 5 ms (per token at concurrency 1).
        sys.setswitchinterval(0.0005)
        self.router = Router(config, placement=placement, bundle_offset=1 if placement else 0)
        self.tokenizer = self.router.tokenizer
        self.telemetry = ReplicaTelemetry(config.name)
        switch = (SpeculationSwitch(self.router, probe_interval_s=self.spec.speculation_probe_interval_s)
                  if self.spec.load_aware_speculation else None)
        provider = make_provider(self.spec.tracing, self.spec.otlp_endpoint, service=f"dspark/{config.name}")
        self.loop = ServingLoop(self.router, self.spec.max_concurrent_requests, self.spec.max_queued_requests,
                                telemetry=self.telemetry, switch=switch,
                                tracer=RequestTracer(provider) if provider else None)
        self.created = int(time.time())

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Read by Serve every ``metrics_interval_s`` for ``deploy.autoscaling.AcceptanceLengthPolicy``."""
        return self.loop.autoscaling_stats()

    def check_health(self) -> None:
        if not self.loop.alive:
            raise RuntimeError("serving loop stopped")

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.close()
            self.router.shutdown()

    # ------------------------------------------------------------------ shared
    def _authorize(self, presented: str | None) -> None:
        check_key(self.api_key, presented)

    def _check_model(self, model: str) -> None:
        if model != self.config.name:
            raise ApiError(404, f"model '{model}' does not exist; this server serves '{self.config.name}'",
                           param="model", code="model_not_found")

    def _params(self, max_tokens: int | None, temperature, top_p, top_k, seed, stop) -> SamplingParams:
        max_tokens = max_tokens or min(self.spec.default_max_tokens, self.spec.max_tokens_limit)
        if max_tokens > self.spec.max_tokens_limit:
            raise ApiError(400, f"max_tokens: {max_tokens} exceeds this server's limit of "
                                f"{self.spec.max_tokens_limit}", param="max_tokens")
        try:
            return sampling_from_values(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                        seed=seed, stop=list(stop or []))
        except ConfigError as exc:
            raise ApiError(400, str(exc), param=exc.field) from None

    def _check_prompt(self, prompt_ids: list[int]) -> list[int]:
        if not prompt_ids:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        if len(prompt_ids) > self.spec.max_prompt_tokens:
            raise ApiError(413, f"prompt: {len(prompt_ids)} tokens exceed this server's limit of "
                                f"{self.spec.max_prompt_tokens}", param="prompt", code="context_length_exceeded")
        return prompt_ids

    def _chat_prompt(self, messages: list[dict]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self._check_prompt(list(self.tokenizer.encode(text, add_special_tokens=False)))

    async def _start(self, prompt_ids: list[int], params: SamplingParams,
                     speculate: bool = True) -> tuple[int, object]:
        """Submit; wait until the engine has accepted (or refused) the request."""
        try:
            request_id, queue = self.loop.submit(prompt_ids, params, speculate)
        except Overloaded as exc:
            raise ApiError(429, str(exc), code="overloaded", retry_after_s=exc.retry_after_s) from None
        except Unavailable as exc:
            raise ApiError(503, str(exc), code="unavailable", retry_after_s=2.0) from None
        try:
            event: Event = await queue.get()
        except BaseException:
            self.loop.cancel(request_id)
            raise
        if event.kind == "error":
            raise self._event_error(event)
        return request_id, queue

    @staticmethod
    def _event_error(event: Event) -> ApiError:
        if isinstance(event.error, ConfigError):
            status = 413 if event.error.field == "prompt" and "context" in event.error.message else 400
            return ApiError(status, str(event.error), param=event.error.field)
        if isinstance(event.error, Unavailable):
            return ApiError(503, str(event.error), code="unavailable", retry_after_s=1.0)
        return ApiError(503, "internal error; retry", code="unavailable", retry_after_s=1.0)

    async def _events(self, request_id: int, queue) -> AsyncIterator[Event]:
        """The request's token events up to and including ``finished``; cancels it if abandoned."""
        done = False
        try:
            while True:
                event: Event = await queue.get()
                if event.kind == "error":
                    done = True
                    raise self._event_error(event)
                yield event
                if event.kind == "finished":
                    done = True
                    return
        finally:
            if not done:
                self.loop.cancel(request_id)

    # ------------------------------------------------------------------ HTTP
    @api.get("/health", summary="Liveness and readiness (no authentication)")
    async def health(self) -> dict:
        alloc = self.router.allocator
        return {"status": "ok", "replica": self.replica_id, "actors": self.router.actor_pids,
                "in_flight": self.loop.in_flight, "kv_free_blocks": alloc.num_free_blocks,
                "kv_total_blocks": alloc.usable_blocks, "speculation_enabled": self.router.speculation_enabled,
                "dtypes": self.router.dtypes,
                "autoscaling": self.loop.autoscaling_stats()}

    @api.get("/metrics", summary="Prometheus metrics of this replica (no authentication, no request content)",
             response_class=PlainTextResponse)
    async def metrics(self) -> PlainTextResponse:
        return PlainTextResponse(self.telemetry.prometheus_text().decode(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/v1/models", summary="The served model", dependencies=[Depends(authorize)])
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.config.name, "object": "model", "created": self.created,
                                            "owned_by": "dspark"}]}

    @api.post("/v1/completions", summary="Text completion (OpenAI-compatible)", dependencies=[Depends(authorize)],
              responses=ERROR_RESPONSES)
    async def completions(self, body: CompletionRequest):
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = self._check_prompt(list(self.tokenizer.encode(body.prompt)))
        else:
            prompt_ids = self._check_prompt(body.prompt)
        return await self._respond(body, prompt_ids, chat=False)

    @api.post("/v1/chat/completions", summary="Chat completion (OpenAI-compatible, the target's chat template)",
              dependencies=[Depends(authorize)], responses=ERROR_RESPONSES)
    async def chat_completions(self, body: ChatCompletionRequest):
        self._check_model(body.model)
        prompt_ids = self._chat_prompt([{"role": m.role, "content": m.content} for m in body.messages])
        return await self._respond(body, prompt_ids, chat=True)

    async def _respond(self, body: _Request, prompt_ids: list[int], chat: bool):
        params = self._params(body.new_tokens, body.temperature, body.top_p, body.top_k, body.seed, body.stop)
        request_id, queue = await self._start(prompt_ids, params, body.speculation)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        base = {"id": ident, "created": int(time.time()), "model": self.config.name}
        stream = TextStream(self.tokenizer, params.stop)
        if not body.stream:
            final = None
            async for event in self._events(request_id, queue):
                stream.add(event.token_ids, final=event.kind == "finished")
                final = event
            text = stream.text
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                      else {"index": 0, "text": text, "logprobs": None})
            choice["finish_reason"] = final.finish_reason
            return {**base, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                    "usage": _usage(len(prompt_ids), final), "spec": SpecStats.from_metrics(final.metrics).model_dump()}
        include_usage = bool(body.stream_options and body.stream_options.get("include_usage"))
        return StreamingResponse(self._sse(request_id, queue, base, stream, chat, len(prompt_ids), include_usage),
                                 media_type="text/event-stream")

    async def _sse(self, request_id, queue, base, stream: TextStream, chat: bool, prompt_tokens: int,
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
            async for event in self._events(request_id, queue):
                finished = event.kind == "finished"
                delta = stream.add(event.token_ids, final=finished)
                if delta or first:
                    yield chunk(delta, None, first)
                    first = False
                if finished:
                    spec = SpecStats.from_metrics(event.metrics).model_dump()
                    usage = _usage(prompt_tokens, event)
                    yield chunk(None, event.finish_reason, spec=spec, **({} if include_usage else {"usage": usage}))
                    if include_usage:
                        yield f"data: {json.dumps({**base, 'object': kind, 'choices': [], 'usage': usage})}\n\n"
        except ApiError as exc:  # headers are sent: report in-band, as OpenAI does
            yield f"data: {json.dumps(json.loads(exc.response().body))}\n\n"
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ gRPC (dspark.v1.DSpark, grpc.health.v1)
    def _grpc_request(self, request: pb.GenerateRequest, grpc_context) -> tuple[list[int], SamplingParams]:
        metadata = dict(grpc_context.invocation_metadata())
        self._authorize(metadata.get("authorization"))
        if request.prompt and request.prompt_token_ids:
            raise ApiError(400, "set prompt or prompt_token_ids, not both", param="prompt")
        if request.prompt_token_ids:
            if request.chat:
                raise ApiError(400, "chat needs a text prompt", param="chat")
            prompt_ids = self._check_prompt(list(request.prompt_token_ids))
        elif request.chat:
            prompt_ids = self._chat_prompt([{"role": "user", "content": request.prompt}])
        else:
            prompt_ids = self._check_prompt(list(self.tokenizer.encode(request.prompt)) if request.prompt else [])
        params = self._params(request.max_tokens or None,
                              request.temperature if request.HasField("temperature") else None,
                              request.top_p if request.HasField("top_p") else None, request.top_k or None,
                              request.seed if request.HasField("seed") else None, list(request.stop))
        return prompt_ids, params

    @staticmethod
    def _grpc_fail(grpc_context, exc: ApiError) -> None:
        grpc_context.set_code(ApiError.GRPC.get(exc.status, grpc.StatusCode.INTERNAL))
        detail = exc.message + (f" (retry after {exc.retry_after_s:g} s)" if exc.retry_after_s else "")
        grpc_context.set_details(detail)
        if exc.retry_after_s:
            grpc_context.set_trailing_metadata([("retry-after-ms", str(int(exc.retry_after_s * 1000)))])

    async def Generate(self, request: pb.GenerateRequest, grpc_context) -> pb.GenerateResponse:  # noqa: N802
        try:
            prompt_ids, params = self._grpc_request(request, grpc_context)
            request_id, queue = await self._start(prompt_ids, params, _speculation(request))
            stream, final = TextStream(self.tokenizer, params.stop), None
            async for event in self._events(request_id, queue):
                stream.add(event.token_ids, final=event.kind == "finished")
                final = event
            return pb.GenerateResponse(text=stream.text, token_ids=stream.token_ids, finish_reason=final.finish_reason,
                                       usage=_pb_usage(len(prompt_ids), final), spec=_pb_spec(final))
        except ApiError as exc:
            self._grpc_fail(grpc_context, exc)
            return pb.GenerateResponse()

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context):  # noqa: N802
        try:
            prompt_ids, params = self._grpc_request(request, grpc_context)
            request_id, queue = await self._start(prompt_ids, params, _speculation(request))
            stream = TextStream(self.tokenizer, params.stop)
            async for event in self._events(request_id, queue):
                finished = event.kind == "finished"
                before = len(stream.token_ids)
                delta = stream.add(event.token_ids, final=finished)
                new_ids = stream.token_ids[before:]
                if finished:
                    yield pb.GenerateChunk(text=delta, token_ids=new_ids, finish_reason=event.finish_reason,
                                           usage=_pb_usage(len(prompt_ids), event), spec=_pb_spec(event))
                elif delta or new_ids:
                    yield pb.GenerateChunk(text=delta, token_ids=new_ids)
        except ApiError as exc:
            # Serve's proxy applies a streaming context's status only with a message or an exception:
            # raise, so that a stream cut short ends with this status (UNAVAILABLE...), never a silent OK
            self._grpc_fail(grpc_context, exc)
            raise RuntimeError(exc.message) from None

    def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:  # noqa: N802
        alive = self.loop.alive
        status = health_pb2.HealthCheckResponse.SERVING if alive else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

