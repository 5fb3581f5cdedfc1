"""OpenAI-compatible request and response models (the subset this server implements).

Requests validate strictly: a field this server does not know is an error naming it, and a
known OpenAI feature it does not implement (``n > 1``, ``logprobs``, penalties) is refused
instead of silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from dspark.config import MAX_SEED, MAX_STOPS, MAX_TEMPERATURE, MAX_TOP_K
from dspark.decoding.metrics import SpecMetrics


def _unicode(value: str) -> str:
    """JSON may carry lone UTF-16 surrogates (``"\\ud800"``); they are not text and cannot be tokenised."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains a lone surrogate (not valid Unicode)") from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text = Field(description="Model name, as listed by GET /v1/models.")
    max_tokens: int | None = Field(None, ge=1, description="Maximum new tokens (default: the server's).")
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens (newer clients).")
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="Keep the k most likely tokens (0: off). Extension.")
    stop: Text | list[Text] | None = Field(None, description=f"Up to {MAX_STOPS} stop strings.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Seed of the request's random generator.")
    stream: bool = Field(False, description="Stream server-sent events.")
    stream_options: dict[str, bool] | None = Field(None, description="{'include_usage': true} adds a usage chunk.")
    speculation: bool = Field(True, description="Extension: false decodes this request without drafting (plain "
                                                "decoding on the same server, e.g. as a baseline).")
    n: int = Field(1, ge=1, le=1, description="Only one choice per request is supported.")
    user: Text | None = Field(None, description="Ignored; accepted for compatibility.")
    logprobs: bool | int | None = Field(None, description="Not supported; must be unset or false.")
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported; must be 0.")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported; must be 0.")

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value):
        if value:
            raise ValueError("logprobs are not supported")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value):
        if value and set(value) - {"include_usage"}:
            raise ValueError(f"unknown stream_options {sorted(set(value) - {'include_usage'})}")
        return value

    @property
    def new_tokens(self) -> int | None:
        return self.max_tokens or self.max_completion_tokens


class CompletionRequest(_Request):
    prompt: Text | list[int] = Field(description="Text, or token ids, to complete (special tokens spelled in the "
                                                 "text are parsed: the whole prompt is the caller's).")
    echo: bool = Field(False, description="Not supported; must be false.")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list) and not value or value == "":
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value):
        if value:
            raise ValueError("echo is not supported")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"] = Field(description="Author of the message.")
    content: Text = Field(description="Message text (always text: a special token spelled in it is not parsed).")
    name: Text | None = Field(None, description="Ignored; accepted for compatibility.")


MAX_MESSAGES = 256


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES,
                                        description=f"The conversation so far (at most {MAX_MESSAGES} messages).")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecStats(BaseModel):
    """Speculative-decoding statistics of one request (an extension field of the responses)."""

    acceptance_length: float = Field(description="Committed tokens per target verify pass.")
    verify_steps: int
    draft_tokens: int = Field(description="Draft tokens sent to verification.")
    accepted_tokens: int
    accepted_per_position: list[int]
    lookup_drafts: int = Field(0, description="Of the verified drafts, those prompt lookup drafted "
                                              "(engine.draft_sources); the rest the DSpark head.")
    lookup_draft_tokens: int = Field(0, description="Of draft_tokens, prompt lookup's.")
    lookup_accepted_tokens: int = Field(0, description="Of accepted_tokens, prompt lookup's.")

    @classmethod
    def from_metrics(cls, m: SpecMetrics) -> SpecStats:
        return cls(**m.request_summary())


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
