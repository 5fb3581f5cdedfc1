"""Replica telemetry: vLLM-named speculative-decoding counters, latency histograms, gauges.

Every metric is kept twice from the same updates: in a per-replica ``prometheus_client``
registry (rendered as Prometheus text at the ingress, ``GET /metrics``) and as a Ray metric
(``ray.util.metrics``, exported by every Ray node's metrics agent for a cluster-wide
Prometheus). Names follow vLLM's with the prefix ``dspark:`` instead of ``vllm:``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Counter as PCounter
from prometheus_client import Gauge as PGauge
from prometheus_client import Histogram as PHistogram

from dspark.decoding.metrics import SpecMetrics

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
ACCEPTANCE_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # without the "dspark:" prefix
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


METRICS = (
    MetricSpec("spec_decode_num_drafts", "counter", "Request-rounds that verified at least one draft token."),
    MetricSpec("spec_decode_num_draft_tokens", "counter", "Draft tokens sent to verification (after the scheduler)."),
    MetricSpec("spec_decode_num_drafted_tokens", "counter", "Draft tokens produced by the drafter (before the "
                                                            "confidence scheduler)."),
    MetricSpec("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted by verification."),
    MetricSpec("spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted draft tokens by block position "
                                                                     "(1-based).", ("position",)),
    MetricSpec("spec_decode_verify_steps", "counter", "Request-rounds through the target (prefill included)."),
    MetricSpec("spec_decode_drafter_fallbacks", "counter", "Request-rounds decoded without drafts after a drafter "
                                                           "failure."),
    MetricSpec("spec_decode_drafter_failures", "counter", "Drafter actor failures (died or timed out)."),
    MetricSpec("spec_decode_draft_skips", "counter", "Request-rounds the draft gate decoded without drafting "
                                                     "(the request's recent drafts were below break-even)."),
    MetricSpec("spec_decode_feature_bytes", "counter", "Target hidden-state bytes sent to the drafter actor over "
                                                       "the collective channel (gloo / NCCL; vllm backend, "
                                                       "engine.vllm_drafter 'actor')."),
    MetricSpec("spec_decode_source_drafts", "counter", "Request-rounds that verified a draft, by draft source (head: "
                                                       "the DSpark head; lookup: prompt lookup; engine.draft_sources)",
               ("source",)),
    MetricSpec("spec_decode_source_draft_tokens", "counter", "Draft tokens sent to verification, by source.",
               ("source",)),
    MetricSpec("spec_decode_source_accepted_tokens", "counter", "Draft tokens accepted, by source.", ("source",)),
    MetricSpec("spec_decode_source_accepted_tokens_per_pos", "counter", "Accepted draft tokens by source and block "
                                                                        "position (1-based).", ("source", "position")),
    MetricSpec("target_restarts", "counter", "Restarts of the replica's target shards (and drafter) after a "
                                             "target failure; the failed step's requests got a retryable error."),
    MetricSpec("spec_decode_acceptance_length", "histogram", "Per-request acceptance length (completion tokens / "
                                                             "verify steps).", buckets=ACCEPTANCE_BUCKETS),
    MetricSpec("prompt_tokens", "counter", "Prompt tokens of admitted requests."),
    MetricSpec("generation_tokens", "counter", "Generated tokens."),
    MetricSpec("request_success", "counter", "Finished requests by finish reason.", ("finished_reason",)),
    MetricSpec("request_errors", "counter", "Requests that ended with an error, by kind.", ("kind",)),
    MetricSpec("e2e_request_latency_seconds", "histogram", "Request latency, submission to last token.",
               buckets=LATENCY_BUCKETS),
    MetricSpec("time_to_first_token_seconds", "histogram", "Submission to first token.", buckets=LATENCY_BUCKETS),
    MetricSpec("inter_token_latency_seconds", "histogram", "Time between token deliveries, per token.",
               buckets=ITL_BUCKETS),
    MetricSpec("engine_phase_seconds", "counter", "The engine's step timeline by phase, seconds. Native engine: "
                                                  "draft (waiting for the drafter), schedule, verify (target pass "
                                                  "and acceptance), step (all). vLLM engine: step (all), target "
                                                  "(vLLM's own work), draft (waiting for drafts), drafter (the draft "
                                                  "pass), transport (features to the drafter actor), overlap (vLLM's "
                                                  "work while the actor drafted), worker_state (tensor "
                                                  "parallelism: reading rank 0's proposer counters after each "
                                                  "step).", ("phase",)),
    MetricSpec("num_requests_running", "gauge", "Requests being decoded."),
    MetricSpec("num_requests_waiting", "gauge", "Requests accepted but waiting for a batch slot or KV blocks."),
    MetricSpec("kv_cache_usage_perc", "gauge", "Fraction of the target KV cache's blocks in use or reserved."),
    MetricSpec("speculation_enabled", "gauge", "1 while this replica speculates, 0 while the load-aware switch "
                                               "has turned speculation off."),
)


class ReplicaTelemetry:
    def __init__(self, model_name: str, use_ray: bool = True):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._prom, self._ray = {}, {}
        for spec in METRICS:
            labels = ("model_name", *spec.labels)
            full = f"dspark:{spec.name}"
            if spec.kind == "counter":
                self._prom[spec.name] = PCounter(full, spec.description, labels, registry=self.registry)
            elif spec.kind == "gauge":
                self._prom[spec.name] = PGauge(full, spec.description, labels, registry=self.registry)
            else:
                self._prom[spec.name] = PHistogram(full, spec.description, labels, registry=self.registry,
                                                   buckets=spec.buckets)
        if use_ray:
            self._make_ray_metrics()
        self._last = SpecMetrics()
        self._last_timings: dict[str, float] = {}
        self._last_sources: dict[str, dict] = {}

    def _make_ray_metrics(self) -> None:
        from ray.util import metrics

        for spec in METRICS:
            tags = ("model_name", *spec.labels)
            name = f"dspark_{spec.name}"  # Ray prefixes "ray_"; colons are not allowed there
            if spec.kind == "counter":
                metric = metrics.Counter(name, spec.description, tag_keys=tags)
            elif spec.kind == "gauge":
                metric = metrics.Gauge(name, spec.description, tag_keys=tags)
            else:
                metric = metrics.Histogram(name, spec.description, boundaries=list(spec.buckets), tag_keys=tags)
            self._ray[spec.name] = metric

    # ------------------------------------------------------------------ updates
    def _tags(self, **labels) -> dict[str, str]:
        return {"model_name": self.model_name, **{k: str(v) for k, v in labels.items()}}

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        if value <= 0:
            return
        tags = self._tags(**labels)
        self._prom[name].labels(**tags).inc(value)
        if name in self._ray:
            self._ray[name].inc(value, tags=tags)

    def set(self, name: str, value: float, **labels) -> None:
        tags = self._tags(**labels)
        self._prom[name].labels(**tags).set(value)
        if name in self._ray:
            self._ray[name].set(value, tags=tags)

    def observe(self, name: str, value: float, **labels) -> None:
        tags = self._tags(**labels)
        self._prom[name].labels(**tags).observe(value)
        if name in self._ray:
            self._ray[name].observe(value, tags=tags)

    def record_engine(self, metrics: SpecMetrics) -> None:
        """Fold the engine's cumulative counters in (deltas since the last call)."""
        last = self._last
        self.inc("spec_decode_num_drafts", metrics.num_drafts - last.num_drafts)
        self.inc("spec_decode_num_draft_tokens", metrics.num_draft_tokens - last.num_draft_tokens)
        self.inc("spec_decode_num_drafted_tokens", metrics.num_drafted_tokens - last.num_drafted_tokens)
        self.inc("spec_decode_num_accepted_tokens", metrics.num_accepted_tokens - last.num_accepted_tokens)
        self.inc("spec_decode_verify_steps", metrics.verify_steps - last.verify_steps)
        self.inc("spec_decode_drafter_fallbacks", metrics.drafter_fallbacks - last.drafter_fallbacks)
        self.inc("spec_decode_draft_skips", metrics.draft_skips - last.draft_skips)
        self.inc("spec_decode_drafter_failures", metrics.drafter_failures - last.drafter_failures)
        self.inc("spec_decode_feature_bytes", metrics.feature_bytes - last.feature_bytes)
        self.inc("generation_tokens", metrics.completion_tokens - last.completion_tokens)
        for pos, count in enumerate(metrics.accepted_per_pos):
            before = last.accepted_per_pos[pos] if pos < len(last.accepted_per_pos) else 0
            self.inc("spec_decode_num_accepted_tokens_per_pos", count - before, position=pos + 1)
        self._last = SpecMetrics().merge(metrics)  # a copy

    def record_sources(self, sources: dict[str, dict]) -> None:
        """Fold the proposer's per-source counters in (``StepDrafterStats.sources`` as dicts; deltas)."""
        for source, now in sources.items():
            last = self._last_sources.get(source, {})
            self.inc("spec_decode_source_drafts", now["drafts"] - last.get("drafts", 0), source=source)
            self.inc("spec_decode_source_draft_tokens", now["drafted_tokens"] - last.get("drafted_tokens", 0),
                     source=source)
            self.inc("spec_decode_source_accepted_tokens", now["accepted_tokens"] - last.get("accepted_tokens", 0),
                     source=source)
            before = last.get("accepted_per_pos", [])
            for pos, count in enumerate(now["accepted_per_pos"]):
                self.inc("spec_decode_source_accepted_tokens_per_pos", count - (before[pos] if pos < len(before)
                                                                                 else 0),
                         source=source, position=pos + 1)
        self._last_sources = {source: dict(now, accepted_per_pos=list(now["accepted_per_pos"]))
                              for source, now in sources.items()}

    def record_timings(self, timings: dict[str, float]) -> None:
        """Fold the engine's cumulative step timeline in (``engine.timings``, seconds by phase; deltas)."""
        for phase, seconds in timings.items():
            self.inc("engine_phase_seconds", seconds - self._last_timings.get(phase, 0.0), phase=phase)
        self._last_timings = dict(timings)

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)
