"""The front door of a replica's HTTP API: a pure ASGI middleware that acts before any route runs.

In order, for every HTTP request:
1. every response (errors and streams included) names the replica in ``x-dspark-replica``;
2. headers that steer Ray Serve's proxy (``x-request-disconnect-disabled`` keeps a request running
   after its client left, ``x-request-timeout-seconds`` sets its timeout) are refused with 400: the
   proxy obeys them from any client, so the replica turns such requests away before any work;
3. the API key is checked before the body is read (routes in ``open_paths`` excepted);
4. the body is read here, within ``max_body_bytes`` (413 as soon as it is passed: a declared
   ``Content-Length`` or a chunked body alike) and ``body_timeout_s`` (408: a stalled upload does not
   hold the replica), then handed to the route.
"""

from __future__ import annotations

import asyncio
import time

from starlette.datastructures import MutableHeaders

from deploy.auth import KeyCheck
from deploy.errors import ApiError

REPLICA_HEADER = "x-dspark-replica"
PROXY_STEERING_HEADERS = (b"x-request-disconnect-disabled", b"x-request-timeout-seconds")


class FrontDoor:
    def __init__(self, app, *, replica: str, keys: KeyCheck, open_paths: frozenset[str], max_body_bytes: int,
                 body_timeout_s: float):
        self.app, self.replica, self.keys, self.open_paths = app, replica, keys, open_paths
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(REPLICA_HEADER, self.replica)
            await send(message)

        try:
            receive = await self._admit(scope, receive)
        except ApiError as exc:
            return await exc.response()(scope, receive, send_named)
        if receive is None:  # the client left while sending its body
            return None
        return await self.app(scope, receive, send_named)

    def _path(self, scope) -> str:
        path, root = scope.get("path", "/"), scope.get("root_path", "")
        return (path[len(root):] or "/") if root and path.startswith(root) else path

    async def _admit(self, scope, receive):
        headers = dict(scope.get("headers") or [])
        for name in PROXY_STEERING_HEADERS:
            if name in headers:
                raise ApiError(400, f"header {name.decode()} is not accepted by this server", param=name.decode())
        authorized = self.keys.accepts(headers.get(b"authorization", b"").decode("utf-8", "surrogateescape"))
        scope.setdefault("state", {})["authorized"] = authorized
        if not authorized and self._path(scope) not in self.open_paths:
            raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return receive
        declared = headers.get(b"content-length")
        if declared is not None and not declared.isdigit():
            raise ApiError(400, "Content-Length is not a number", param="content-length")
        if declared is not None and int(declared) > self.max_body_bytes:
            raise ApiError(413, f"request body over {self.max_body_bytes} bytes", code="body_too_large")
        body = await self._read_body(receive)
        if body is None:
            return None
        return _replay(body, receive)

    async def _read_body(self, receive) -> bytes | None:
        chunks, size = [], 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                raise ApiError(408, f"request body not received within {self.body_timeout_s:g} s",
                               code="body_timeout") from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise ApiError(413, f"request body over {self.max_body_bytes} bytes", code="body_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    """A ``receive`` that yields the body read by the front door once, then the client's later messages
    (``http.disconnect``: what cancels a stream whose client left)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
