"""OpenTelemetry traces of requests: one span per request, child spans per decoding phase.

``dspark.decoding.request`` spans the request from submission to its last token. The engine reports
each phase of each step once for its whole batch (``Engine.on_phase``); every request in that
batch gets a child span with the phase's real start and end: ``prefill``, ``draft``,
``transport`` (the drafter receiving the target's hidden states; Ray path only) and
``verify`` (attributes: draft tokens verified and accepted). The exporter is chosen by
config: ``none`` (no tracing, no overhead), ``console``, or ``otlp`` (needs the
``opentelemetry-exporter-otlp`` package; endpoint from the config or OTEL_* variables).
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from dspark.config import ConfigError


def make_provider(exporter: str, endpoint: str | None = None, service: str = "dspark") -> TracerProvider | None:
    if exporter == "none":
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigError("serving.tracing", "'otlp' needs the opentelemetry-exporter-otlp package") from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint) if endpoint
                                                       else OTLPSpanExporter()))
    else:
        raise ConfigError("serving.tracing", f"unknown exporter {exporter!r} (none, console, otlp)")
    return provider


class RequestTracer:
    def __init__(self, provider: TracerProvider):
        self.tracer = provider.get_tracer("dspark")
        self._spans: dict[int, trace.Span] = {}

    def start(self, request_id: int, prompt_tokens: int, max_tokens: int) -> None:
        span = self.tracer.start_span("dspark.request", attributes={
            "dspark.request_id": request_id, "dspark.prompt_tokens": prompt_tokens, "dspark.max_tokens": max_tokens})
        self._spans[request_id] = span

    def phase(self, name: str, start_ns: int, end_ns: int, request_ids: list[int], per_request: dict[str, list]):
        for i, request_id in enumerate(request_ids):
            parent = self._spans.get(request_id)
            if parent is None:
                continue
            attrs = {f"dspark.{key}": values[i] for key, values in per_request.items() if key != "prefill"}
            label = "prefill" if per_request.get("prefill", [False] * len(request_ids))[i] else name
            span = self.tracer.start_span(label, context=trace.set_span_in_context(parent), start_time=start_ns,
                                          attributes=attrs)
            span.end(end_time=max(end_ns, start_ns))

    def finish(self, request_id: int, outcome: str, completion_tokens: int = 0, verify_steps: int = 0) -> None:
        span = self._spans.pop(request_id, None)
        if span is None:
            return
        span.set_attribute("dspark.outcome", outcome)
        span.set_attribute("dspark.completion_tokens", completion_tokens)
        span.set_attribute("dspark.verify_steps", verify_steps)
        if verify_steps:
            span.set_attribute("dspark.acceptance_length", completion_tokens / verify_steps)
        span.end()
