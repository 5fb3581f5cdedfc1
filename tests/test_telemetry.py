"""Telemetry of the serving loop: Prometheus counters, OpenTelemetry spans, the load-aware switch.

The serving loop drives any engine; here an in-process one over the tiny target, so the test
needs no cluster. (The live app's /metrics is checked against `dspark bench` in test_serving.)
"""

from __future__ import annotations

import asyncio
import os

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from actors.serving_loop import ServingLoop
from actors.speculation_switch import SpeculationSwitch
from actors.telemetry import ReplicaTelemetry
from actors.tracing import RequestTracer, make_provider
from dspark.config import ConfigError, SamplingParams
from dspark.decoding.drafter import DSparkDrafter
from dspark.decoding.scheduler import StepCostProfile
from dspark.formats.checkpoint import load_draft

from conftest import FLAT_PROFILE, make_engine

PARAMS = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture()
def engine_factory(tiny_target, tiny_tokenizer, tiny_draft_dir):
    def make(profile=FLAT_PROFILE):
        draft = load_draft(tiny_draft_dir, tiny_target.config).double().bind_target(tiny_target.embed_tokens,
                                                                                     tiny_target.lm_head)
        return make_engine(tiny_target, tiny_tokenizer, DSparkDrafter(draft, 8192, 16, 0), profile=profile,
                           scheduler="full")
    return make


async def run_requests(loop: ServingLoop, prompts: list[list[int]]) -> list[list]:
    async def one(prompt):
        _, queue = loop.submit(prompt, PARAMS)
        events = []
        while True:
            event = await queue.get()
            events.append(event)
            if event.kind in ("finished", "error"):
                return events
    return await asyncio.gather(*(one(p) for p in prompts))


def prometheus(telemetry: ReplicaTelemetry) -> dict[tuple[str, tuple], float]:
    values = {}
    for family in text_string_to_metric_families(telemetry.prometheus_text().decode()):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


def test_counters_and_spans_follow_the_engine(engine_factory, tiny_tokenizer):
    engine = engine_factory()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = ReplicaTelemetry("tiny", use_ray=False)
    loop = ServingLoop(engine, 8, 8, telemetry=telemetry, tracer=RequestTracer(provider))
    prompts = [tiny_tokenizer.encode(t) for t in ("def main():", "import sys", "x = [1, 2, 3]")]
    try:
        results = asyncio.run(run_requests(loop, prompts))
    finally:
        loop.close()
    assert all(r[-1].kind == "finished" for r in results)
    m, values = engine.metrics, prometheus(telemetry)
    assert values[("dspark:spec_decode_num_drafts_total", ())] == m.num_drafts > 0
    assert values[("dspark:spec_decode_num_draft_tokens_total", ())] == m.num_draft_tokens
    assert values[("dspark:spec_decode_num_accepted_tokens_total", ())] == m.num_accepted_tokens
    assert values[("dspark:generation_tokens_total", ())] == m.completion_tokens == 3 * PARAMS.max_tokens
    assert values[("dspark:prompt_tokens_total", ())] == sum(len(p) for p in prompts)
    for pos, count in enumerate(m.accepted_per_pos):
        assert values.get(("dspark:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(pos + 1)),)),
                          0) == count
    assert values[("dspark:request_success_total", (("finished_reason", "length"),))] == 3
    assert values[("dspark:time_to_first_token_seconds_count", ())] == 3
    assert values[("dspark:e2e_request_latency_seconds_count", ())] == 3
    assert values[("dspark:num_requests_running", ())] == 0 and values[("dspark:kv_cache_usage_perc", ())] == 0
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "dspark.request"]
    assert len(roots) == 3 and all(r.attributes["dspark.completion_tokens"] == 12 for r in roots)
    for root in roots:
        children = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
        names = [c.name for c in children]
        assert names.count("prefill") == 1 and "draft" in names and "verify" in names
        assert all(root.start_time <= c.start_time <= c.end_time <= root.end_time for c in children)
        verify = [c for c in children if c.name == "verify"]
        assert sum(c.attributes["dspark.accepted"] + 1 for c in verify) + 1 >= root.attributes[
            "dspark.completion_tokens"]


def test_load_aware_switch_turns_speculation_off_below_break_even_and_probes_again(engine_factory, tiny_tokenizer):
    # plain steps modelled as nearly free: no acceptance length can pay for drafting
    engine = engine_factory(StepCostProfile((1, 64), (1e-7, 1e-6), 0.0))
    switch = SpeculationSwitch(engine, window_steps=5, probe_interval_s=0.0)
    telemetry = ReplicaTelemetry("tiny", use_ray=False)
    loop = ServingLoop(engine, 8, 8, telemetry=telemetry, switch=switch)
    try:
        asyncio.run(run_requests(loop, [tiny_tokenizer.encode("def f(x):")]))
    finally:
        loop.close()
    offs = [d for d in switch.decisions if not d[1]]
    assert offs and all(tau < break_even for _, _, tau, break_even in offs)
    assert any(d[1] for d in switch.decisions[switch.decisions.index(offs[0]):]), "speculation must be probed again"


def test_tracing_exporter_is_validated():
    assert make_provider("none") is None
    assert make_provider("console") is not None
    with pytest.raises(ConfigError, match="serving.tracing"):
        make_provider("zipkin")


def test_grafana_dashboard_queries_only_metrics_the_replicas_export():
    """Every series the shipped dashboard plots is one of ours, under Ray's name, with its kind's suffix."""
    import json
    import re

    from actors.telemetry import METRICS

    from conftest import REPO

    dashboard = json.loads((REPO / "deploy" / "grafana" / "dspark-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    names = set(re.findall(r"ray_dspark_([a-z0-9_]+)", " ".join(exprs)))
    suffix = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    exported = {spec.name + s for spec in METRICS for s in suffix[spec.kind]}
    assert len(exprs) >= 15 and names and names <= exported, names - exported
    kinds = {spec.kind for spec in METRICS if any(n.startswith(spec.name) for n in names)}
    assert kinds == {"counter", "gauge", "histogram"}


def test_the_loop_steps_the_engine_on_the_cores_it_is_given(engine_factory, tiny_tokenizer):
    """runtime.engine_cpus: the loop thread (which steps the engine, and whose OpenMP threads inherit its cores) runs
    on the given cores; the rest of the process keeps its own; a core the node lacks is refused by name."""
    before = os.sched_getaffinity(0)
    loop = ServingLoop(engine_factory(), 8, 8, cpus=[0])
    try:
        results = asyncio.run(run_requests(loop, [tiny_tokenizer.encode("def main():")]))
        assert os.sched_getaffinity(loop._thread.native_id) == {0}
    finally:
        loop.close()
    assert results[0][-1].kind == "finished" and os.sched_getaffinity(0) == before
    with pytest.raises(ConfigError, match="runtime.engine_cpus"):
        ServingLoop(engine_factory(), 8, 8, cpus=[os.cpu_count()])
