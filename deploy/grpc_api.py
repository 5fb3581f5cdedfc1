"""The dspark.v1 gRPC API (and grpc.health.v1) of one replica, as methods Serve's gRPC proxy calls.

A mixin of ``DSparkServer``: it uses the replica's ``keys``, ``adapter``, ``loop`` and ``tokenizer``.
Requests go through the same adapter as HTTP (``RequestAdapter.from_grpc`` turns them into the OpenAI
models), so bounds and errors agree; an error's details name its field, trailers carry its type, field,
code and ``retry-after-ms``; anything unexpected is INTERNAL with no detail beyond its type (never a
traceback). A client whose deadline passes cancels the call: Serve's proxy cancels the handler, which
cancels the request.
"""

from __future__ import annotations

import logging

from grpc_health.v1 import health_pb2

from deploy.errors import ApiError
from deploy.generation import Generation
from deploy.openai_protocol import SpecStats
from deploy.text_stream import TextStream
from dspark.v1 import serving_pb2 as pb

log = logging.getLogger("dspark.server")


def _usage(generation: Generation, final) -> pb.Usage:
    return pb.Usage(prompt_tokens=generation.prompt_tokens, completion_tokens=final.metrics.completion_tokens)


def _spec(final) -> pb.SpecStats:
    return pb.SpecStats(**SpecStats.from_metrics(final.metrics).model_dump())


def _internal(exc: Exception) -> ApiError:
    log.error("gRPC request failed: %s", type(exc).__name__)  # no request content in logs
    return ApiError(500, f"internal server error ({type(exc).__name__})")


class GrpcApi:
    async def _grpc_start(self, request: pb.GenerateRequest, grpc_context) -> tuple[Generation, object]:
        self.keys.check(dict(grpc_context.invocation_metadata()).get("authorization"))
        prepared = await self.adapter.prepare(self.adapter.from_grpc(request))
        return await Generation.start(self.loop, prepared), prepared.params

    async def Generate(self, request: pb.GenerateRequest, grpc_context) -> pb.GenerateResponse:  # noqa: N802
        try:
            generation, params = await self._grpc_start(request, grpc_context)
            stream, final = TextStream(self.tokenizer, params.stop), None
            async for event in generation.events():
                stream.add(event.token_ids, final=event.kind == "finished")
                final = event
            return pb.GenerateResponse(text=stream.text, token_ids=stream.token_ids, finish_reason=final.finish_reason,
                                       usage=_usage(generation, final), spec=_spec(final))
        except ApiError as exc:
            exc.apply_to(grpc_context)
            return pb.GenerateResponse()
        except Exception as exc:  # noqa: BLE001  (a bug: INTERNAL, never the traceback)
            _internal(exc).apply_to(grpc_context)
            return pb.GenerateResponse()

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context):  # noqa: N802
        try:
            generation, params = await self._grpc_start(request, grpc_context)
            stream = TextStream(self.tokenizer, params.stop)
            async for event in generation.events():
                finished = event.kind == "finished"
                before = len(stream.token_ids)
                delta = stream.add(event.token_ids, final=finished)
                new_ids = stream.token_ids[before:]
                if finished:
                    yield pb.GenerateChunk(text=delta, token_ids=new_ids, finish_reason=event.finish_reason,
                                           usage=_usage(generation, event), spec=_spec(event))
                elif delta or new_ids:
                    yield pb.GenerateChunk(text=delta, token_ids=new_ids)
        except ApiError as exc:
            # Serve's proxy applies a streaming context's status only with a message or an exception:
            # raise, so that a stream cut short ends with this status (UNAVAILABLE...), never a silent OK
            exc.apply_to(grpc_context)
            raise RuntimeError(exc.message) from None
        except Exception as exc:  # noqa: BLE001  (a bug: INTERNAL, never the traceback)
            error = _internal(exc)
            error.apply_to(grpc_context)
            raise RuntimeError(error.message) from None

    def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse:  # noqa: N802
        serving = self.loop.state == "ok"
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING)
