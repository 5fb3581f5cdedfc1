"""Errors of the front door: one ``ApiError`` type, rendered as OpenAI's JSON error body (HTTP) or as a
gRPC status whose details name the field (gRPC).

| HTTP | gRPC | when |
|---|---|---|
| 400 | INVALID_ARGUMENT | a field is invalid (``param`` names it) |
| 401 | UNAUTHENTICATED | the API key is missing or wrong |
| 404 | NOT_FOUND | unknown model or route |
| 408 | DEADLINE_EXCEEDED | the request body did not arrive in time |
| 413 | RESOURCE_EXHAUSTED | the body, message or prompt is over its limit (never retry as is) |
| 429 | RESOURCE_EXHAUSTED | the replica is at a bound; ``Retry-After`` / ``retry-after-ms`` says when to retry |
| 500 | INTERNAL | a server bug (logged; the request was aborted, nothing else) |
| 503 | UNAVAILABLE | a replica actor failed or hung; retryable, with ``Retry-After`` |
| 504 | DEADLINE_EXCEEDED | the request ran past its deadline and was aborted |
"""

from __future__ import annotations

import json
import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("dspark.server")


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: any text a client sent (a lone surrogate included) renders."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class ApiError(Exception):
    """An error with its HTTP status and OpenAI error body; its gRPC status from ``GRPC``."""

    GRPC = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
            404: grpc.StatusCode.NOT_FOUND, 408: grpc.StatusCode.DEADLINE_EXCEEDED,
            413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
            500: grpc.StatusCode.INTERNAL, 503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             408: "timeout", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
             503: "service_unavailable", 504: "timeout"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    @property
    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    @property
    def retry_after_header(self) -> str | None:
        return f"{max(int(self.retry_after_s + 0.999), 1)}" if self.retry_after_s else None

    def response(self) -> JSONResponse:
        retry = self.retry_after_header
        return AsciiJSONResponse(self.body, status_code=self.status, headers={"Retry-After": retry} if retry else None)

    # ------------------------------------------------------------------ gRPC
    @property
    def grpc_code(self) -> grpc.StatusCode:
        return self.GRPC.get(self.status, grpc.StatusCode.INTERNAL)

    @property
    def grpc_details(self) -> str:
        """The message, with the field named first (as the HTTP error's ``param``) and the retry delay."""
        named = self.message if not self.param or self.message.startswith(f"{self.param}:") else \
            f"{self.param}: {self.message}"
        return named + (f" (retry after {self.retry_after_s:.0f} s)" if self.retry_after_s else "")

    @property
    def grpc_trailers(self) -> list[tuple[str, str]]:
        trailers = [("dspark-error-type", self.TYPES.get(self.status, "invalid_request_error"))]
        if self.param:
            trailers.append(("dspark-error-param", self.param))
        if self.code:
            trailers.append(("dspark-error-code", self.code))
        if self.retry_after_s:
            trailers.append(("retry-after-ms", str(int(self.retry_after_s * 1000))))
        return trailers

    def apply_to(self, grpc_context) -> None:
        grpc_context.set_code(self.grpc_code)
        grpc_context.set_details(self.grpc_details.encode("ascii", "backslashreplace").decode())
        grpc_context.set_trailing_metadata(self.grpc_trailers)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def validation_error(errors: list[dict], skip: int = 0) -> ApiError:
    """The first pydantic error as a 400 naming its field (``skip``: leading ``loc`` parts, FastAPI's 'body')."""
    item = errors[0]
    if item.get("type") == "json_invalid":
        return ApiError(400, "request body is not valid JSON")
    path = []
    for part in item["loc"][skip:]:
        if isinstance(part, str) and ("[" in part or part in _UNION_TAGS):  # which branch of a union: not a field
            break
        path.append(str(part))
    param = ".".join(path) or None
    message = item["msg"]
    return ApiError(400, f"{param}: {message}" if param else message, param=param)


def from_validation(exc: ValidationError) -> ApiError:
    return validation_error(exc.errors(include_input=False))


def install_handlers(api: FastAPI) -> None:
    """Every error an HTTP route can meet, as an OpenAI error body (never a stack trace)."""

    @api.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail)).response()

    @api.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors()), skip=1).response()

    @api.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.error("request failed: %s", type(exc).__name__)  # no request content in logs
        return ApiError(500, "internal server error").response()
