"""API keys: where the key comes from, how a request presents it, and when a server may run without one.

What stays open without a key (documented in docs/api.md, "Authentication"):
- ``GET /health``: liveness only (``{"status": ...}``); the details (actor pids, KV state, counters)
  need the key;
- gRPC ``grpc.health.v1.Health/Check``;
- ``GET /metrics`` only with ``serving.metrics_need_key: false`` (default: it needs the key).
Everything else (``/v1/*``, ``/openapi.json``, ``/docs``, ``dspark.v1.DSpark/*``) needs
``Authorization: Bearer <key>`` (the scheme is case-insensitive; a bare key is refused).

A server with no key refuses to start unless its HTTP proxy binds a loopback address or the config
says ``serving.allow_unauthenticated: true`` (the embedded demo does).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

from deploy.errors import ApiError
from dspark.config import ConfigError
from dspark.schema import ServingSpec

OPEN_PATHS = frozenset({"/health"})
CHALLENGE = "missing or invalid API key (send 'Authorization: Bearer <key>')"


def read_api_key(spec: ServingSpec) -> str | None:
    """The key from ``api_key_file`` (which must exist and be non-empty), else from ``api_key_env``."""
    if spec.api_key_file:
        path = Path(os.path.expanduser(spec.api_key_file))
        if not path.is_file():
            raise ConfigError("serving.api_key_file", f"{path} does not exist")
        key = path.read_text().strip()
        if not key:
            raise ConfigError("serving.api_key_file", f"{path} is empty (an empty key would turn authentication "
                                                      "off; remove api_key_file for that)")
        return key
    return os.environ.get(spec.api_key_env, "").strip() or None


def is_loopback(host: str | None) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except (TypeError, ValueError):
        return False


def require_key_or_consent(spec: ServingSpec, key: str | None, http_host: str | None) -> None:
    """Refuse to serve without a key on a non-loopback address unless the config allows it explicitly."""
    if key is None and not spec.allow_unauthenticated and not is_loopback(http_host):
        raise ConfigError("serving.api_key_file", f"no API key is configured and HTTP listens on {http_host!r}: set "
                                                  f"serving.api_key_file or ${spec.api_key_env}, bind 127.0.0.1, or "
                                                  "set serving.allow_unauthenticated: true to serve openly")


class KeyCheck:
    """Compares a presented ``Authorization`` value with the key in constant time (no key: everything passes)."""

    def __init__(self, key: str | None):
        self._key = key.encode() if key else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def accepts(self, authorization: str | None) -> bool:
        if self._key is None:
            return True
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return False
        return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), self._key)

    def check(self, authorization: str | None) -> None:
        if not self.accepts(authorization):
            raise ApiError(401, CHALLENGE, code="invalid_api_key")
