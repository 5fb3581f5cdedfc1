"""One request adapter for both protocols: a request in, prompt token ids and sampling parameters out.

HTTP bodies arrive as the OpenAI models of ``deploy.openai_protocol``; a gRPC ``GenerateRequest`` is
turned into the same models (``from_grpc``), so both protocols have one schema, one set of bounds and
the same error, naming the same field. Cheap limits act first (message size, character and id counts),
then tokenisation runs on a worker thread, off the event loop that streams every other request.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from jinja2 import TemplateError
from pydantic import ValidationError

from deploy.errors import ApiError, from_validation
from deploy.openai_protocol import ChatCompletionRequest, CompletionRequest, _Request
from dspark.config import ConfigError, SamplingParams
from dspark.loader import encode_chat
from dspark.schema import EngineFileConfig, sampling_from_values
from dspark.v1 import serving_pb2 as pb


@dataclass(frozen=True)
class PreparedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    speculate: bool
    chat: bool
    stream: bool = False
    include_usage: bool = False


class RequestAdapter:
    def __init__(self, config: EngineFileConfig, tokenizer, vocab_size: int):
        self.name, self.spec, self.tokenizer, self.vocab_size = config.name, config.serving, tokenizer, vocab_size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ gRPC -> the OpenAI models
    def from_grpc(self, request: pb.GenerateRequest) -> CompletionRequest | ChatCompletionRequest:
        size = request.ByteSize()
        if size > self.spec.max_body_bytes:
            raise ApiError(413, f"message of {size} bytes is over {self.spec.max_body_bytes} bytes",
                           code="message_too_large")
        if len(request.prompt_token_ids) > self.spec.max_prompt_tokens:  # before the ids are copied
            raise self._too_long(len(request.prompt_token_ids))
        if request.prompt and request.prompt_token_ids:
            raise ApiError(400, "prompt: set prompt or prompt_token_ids, not both", param="prompt")
        if request.chat and request.prompt_token_ids:
            raise ApiError(400, "chat: needs a text prompt, not prompt_token_ids", param="chat")
        fields = {"model": self.name, "stop": list(request.stop)}
        for name in ("max_tokens", "temperature", "top_p", "seed", "speculation"):
            if request.HasField(name):
                fields[name] = getattr(request, name)
        if request.top_k:
            fields["top_k"] = request.top_k
        try:
            if request.chat:
                return ChatCompletionRequest.model_validate(
                    {**fields, "messages": [{"role": "user", "content": request.prompt}]})
            return CompletionRequest.model_validate(
                {**fields, "prompt": list(request.prompt_token_ids) or request.prompt})
        except ValidationError as exc:
            error = from_validation(exc)
            if error.param == "messages.0.content":  # gRPC's chat turn is its prompt field
                error = ApiError(400, error.message.replace("messages.0.content", "prompt"), param="prompt")
            raise error from None

    # ------------------------------------------------------------------ both protocols
    async def prepare(self, body: CompletionRequest | ChatCompletionRequest) -> PreparedRequest:
        if body.model != self.name:
            raise ApiError(404, f"model '{body.model}' does not exist; this server serves '{self.name}'",
                           param="model", code="model_not_found")
        params = self._params(body)
        chat = isinstance(body, ChatCompletionRequest)
        if chat:
            messages = [{"role": m.role, "content": m.content} for m in body.messages]
            self._check_chars(sum(len(m["content"]) for m in messages), "messages")
            prompt_ids = await self._tokenize(encode_chat, self.tokenizer, messages)
        elif isinstance(body.prompt, str):
            self._check_chars(len(body.prompt), "prompt")
            prompt_ids = await self._tokenize(lambda text: list(self.tokenizer.encode(text)), body.prompt)
        else:
            prompt_ids = body.prompt
        self._check_ids(prompt_ids)
        return PreparedRequest(prompt_ids, params, body.speculation, chat, body.stream,
                               bool(body.stream_options and body.stream_options.get("include_usage")))

    def _params(self, body: _Request) -> SamplingParams:
        spec = self.spec
        max_tokens = body.new_tokens or min(spec.default_max_tokens, spec.max_tokens_limit)
        if max_tokens > spec.max_tokens_limit:
            raise ApiError(400, f"max_tokens: {max_tokens} exceeds this server's limit of {spec.max_tokens_limit}",
                           param="max_tokens")
        try:
            return sampling_from_values(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                        top_k=body.top_k, seed=body.seed, stop=list(body.stop or []))
        except ConfigError as exc:
            raise ApiError(400, str(exc), param=exc.field) from None

    def _check_chars(self, chars: int, field: str) -> None:
        limit = self.spec.prompt_char_limit
        if chars > limit:
            raise ApiError(413, f"{field}: {chars} characters exceed this server's limit of {limit}",
                           param=field, code="context_length_exceeded")

    def _too_long(self, tokens: int) -> ApiError:
        return ApiError(413, f"prompt: {tokens} tokens exceed this server's limit of {self.spec.max_prompt_tokens}",
                        param="prompt", code="context_length_exceeded")

    def _check_ids(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        if len(prompt_ids) > self.spec.max_prompt_tokens:
            raise self._too_long(len(prompt_ids))
        if not all(0 <= t < self.vocab_size for t in prompt_ids):
            raise ApiError(400, f"prompt: token ids must be in [0, {self.vocab_size})", param="prompt")

    async def _tokenize(self, fn, *args) -> list[int]:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except ConfigError as exc:
            raise ApiError(400, str(exc), param=exc.field) from None
        except TemplateError as exc:  # the chat template refuses the conversation (e.g. the order of roles)
            raise ApiError(400, f"messages: the model's chat template refuses them ({exc})",
                           param="messages") from None
