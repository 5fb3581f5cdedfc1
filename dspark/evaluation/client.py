"""A small client for a DSpark server: HTTP (OpenAI-compatible) or gRPC (dspark.v1).

    dspark client --http http://localhost:8000 "Write a haiku about GPUs" --max-tokens 64
    dspark client --grpc localhost:9000 "Write a haiku about GPUs" --stream

The API key, if the server needs one, comes from --api-key or $DSPARK_API_KEY.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass


class ClientError(RuntimeError):
    """The server refused the request; ``status`` is the HTTP status or the gRPC code name."""

    def __init__(self, status, message: str):
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


@dataclass
class Completion:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    acceptance_length: float


class HttpClient:
    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None, timeout: float = 300):
        self.base_url, self.api_key, self.timeout = base_url.rstrip("/"), api_key, timeout
        self.model = model or self.models()[0]

    def _request(self, path: str, body: dict | None = None):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = exc.reason
            raise ClientError(exc.code, message) from None

    def models(self) -> list[str]:
        with self._request("/v1/models") as response:
            return [m["id"] for m in json.load(response)["data"]]

    def _body(self, prompt: str, chat: bool, **params) -> tuple[str, dict]:
        body = {"model": self.model, **{k: v for k, v in params.items() if v is not None}}
        if chat:
            return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
        return "/v1/completions", {**body, "prompt": prompt}

    def complete(self, prompt: str, chat: bool = True, **params) -> Completion:
        path, body = self._body(prompt, chat, **params)
        with self._request(path, body) as response:
            out = json.load(response)
        choice = out["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return Completion(text, choice["finish_reason"], out["usage"]["prompt_tokens"],
                          out["usage"]["completion_tokens"], out["spec"]["acceptance_length"])

    def stream(self, prompt: str, chat: bool = True, **params) -> Iterator[str]:
        path, body = self._body(prompt, chat, stream=True, **params)
        with self._request(path, body) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ClientError("stream", chunk["error"]["message"])
                for choice in chunk["choices"]:
                    text = choice.get("delta", {}).get("content") if chat else choice.get("text")
                    if text:
                        yield text


class GrpcClient:
    def __init__(self, target: str, api_key: str | None = None, application: str = "dspark", timeout: float = 300):
        import grpc

        from dspark.v1 import serving_pb2_grpc

        self.channel = grpc.insecure_channel(target)
        self.stub = serving_pb2_grpc.DSparkStub(self.channel)
        self.metadata = [("application", application)] + ([("authorization", f"Bearer {api_key}")] if api_key else [])
        self.timeout = timeout

    @staticmethod
    def request(prompt: str, chat: bool = True, max_tokens: int | None = None, temperature: float | None = None,
                top_p: float | None = None, seed: int | None = None, stop: list[str] | None = None):
        from dspark.v1 import serving_pb2 as pb

        # None leaves an optional field unset (the server's default); max_tokens=0 would be sent, and refused
        return pb.GenerateRequest(prompt=prompt, chat=chat, max_tokens=max_tokens, temperature=temperature,
                                  top_p=top_p, seed=seed, stop=stop or [])

    def _call(self, fn, request):
        import grpc

        try:
            return fn(request, metadata=self.metadata, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise ClientError(exc.code().name, exc.details()) from None

    def complete(self, prompt: str, chat: bool = True, **params) -> Completion:
        out = self._call(self.stub.Generate, self.request(prompt, chat, **params))
        return Completion(out.text, out.finish_reason, out.usage.prompt_tokens, out.usage.completion_tokens,
                          out.spec.acceptance_length)

    def stream(self, prompt: str, chat: bool = True, **params) -> Iterator[str]:
        import grpc

        try:
            for chunk in self.stub.GenerateStream(self.request(prompt, chat, **params), metadata=self.metadata,
                                                  timeout=self.timeout):
                if chunk.text:
                    yield chunk.text
        except grpc.RpcError as exc:
            raise ClientError(exc.code().name, exc.details()) from None
