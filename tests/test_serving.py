"""The served application on real Ray Serve: official openai client, gRPC stub, auth, limits, cancellation."""

from __future__ import annotations

import json
import threading

import grpc
import openai
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dspark.builder import build_engine
from dspark.config import SamplingParams
from dspark.loader import encode_prompt
from dspark.v1 import serving_pb2 as pb
from dspark.v1 import serving_pb2_grpc

from conftest import GRPC, HTTP, KEY, RAY_METRICS_PORT, benchmark_prompts, deploy_app, get_health, wait_for

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
MAX_CONCURRENT, MAX_QUEUED = 4, 2


@pytest.fixture(scope="module")
def served(serve_instance, tmp_path_factory):
    """The embedded default behind Serve's HTTP (8000) and gRPC (9000) proxies, with an API key."""
    key_file = tmp_path_factory.mktemp("secret") / "api-key"
    key_file.write_text(KEY + "\n")
    with deploy_app(
            tmp_path_factory.mktemp("config"),
            serving={"load_aware_speculation": False, "api_key_file": str(key_file),
                     "max_concurrent_requests": MAX_CONCURRENT, "max_queued_requests": MAX_QUEUED,
                     "max_tokens_limit": 64, "max_prompt_tokens": 512},
            # deterministic blocks for the bench comparison: no prefix trimming, and no draft gate (its break-even
            # comes from each engine's own measured costs, so the Ray router and an in-process engine gate
            # differently)
            engine={"max_num_seqs": MAX_CONCURRENT, "scheduler": "full", "draft_gate": False}) as config:
        yield config


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{HTTP}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(served):
    return build_engine(served, backend="native")


@pytest.fixture(scope="module")
def stub(served):
    channel = grpc.insecure_channel(GRPC)
    yield serving_pb2_grpc.DSparkStub(channel), channel
    channel.close()


AUTH = (("application", "dspark"), ("authorization", f"Bearer {KEY}"))


def prompts(n: int) -> list[str]:
    return benchmark_prompts("gsm8k", n // 2) + benchmark_prompts("humaneval", n - n // 2)


def reference(engine, text: str, chat: bool, max_tokens: int) -> list[int]:
    prompt = encode_prompt(engine.tokenizer, text, chat=chat)
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].token_ids


def scrape(name_prefix: str = "dspark:") -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{HTTP}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(name_prefix):
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
                values[(sample.name, labels)] = sample.value
    return values


def test_prometheus_counters_match_dspark_bench(served, engine):
    """Per-position acceptance from the live app's counters equals `dspark bench`'s own computation."""
    from dspark.evaluation.bench import run_prompts, summarise

    texts = prompts(4)
    before = scrape()
    for text in texts:  # one at a time, like the bench (batch 1)
        response = requests.post(f"{HTTP}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                                 json={"model": MODEL, "messages": [{"role": "user", "content": text}],
                                       "max_tokens": 32, "temperature": 0}, timeout=120)
        assert response.status_code == 200
    after = scrape()

    def delta(name, **labels):
        key = (f"dspark:{name}", tuple(sorted((k, str(v)) for k, v in labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    bench = summarise(run_prompts(engine, [encode_prompt(engine.tokenizer, t, chat=True) for t in texts],
                                  SamplingParams(max_tokens=32, temperature=0.0)), len(texts))
    drafts = delta("spec_decode_num_drafts_total")
    assert drafts == bench["num_drafts"] > 0
    assert delta("spec_decode_num_accepted_tokens_total") == bench["num_accepted_tokens"]
    assert delta("generation_tokens_total") == bench["completion_tokens"]
    rates = [delta("spec_decode_num_accepted_tokens_per_pos_total", position=k + 1) / drafts
             for k in range(len(bench["acceptance_rate_per_pos"]))]
    assert rates == pytest.approx(bench["acceptance_rate_per_pos"])
    assert all(1 >= a >= b >= 0 for a, b in zip(rates, rates[1:]))  # sane: non-increasing along the block
    assert delta("request_success_total", finished_reason="length") + delta(
        "request_success_total", finished_reason="stop") == len(texts)
    assert after[("dspark:time_to_first_token_seconds_count", ())] >= len(texts)
    assert 0 <= after[("dspark:kv_cache_usage_perc", ())] <= 1 and after[("dspark:speculation_enabled", ())] == 1
    # the same series reach Ray's metrics agent (what a cluster-wide Prometheus scrapes) as ray_dspark_*
    wanted = {name.replace("dspark:", "ray_dspark_"): value for (name, labels), value in after.items()
              if name.startswith("dspark:spec_decode_num_") and name.endswith("_total")
              for name in [name + "".join(f"|{k}={v}" for k, v in labels)]}
    assert len(wanted) >= 4 + len(rates)
    # Ray's agent exports every ~10 s; one replica's worker then has exactly these values
    wait_for(lambda: ray_exported(MODEL), 90, f"Ray's metrics agent to export {wanted}",
             until=lambda exported: any(series == wanted for series in exported.values()), interval_s=2)


def test_the_replica_reports_what_the_autoscaling_policy_reads(served):
    """The native replica feeds the acceptance-length policy (``deploy.autoscaling``) its five statistics from the
    requests it served (the live autoscaling test runs on the vLLM backend)."""
    from deploy.autoscaling import METRICS, ReplicaStats

    for text in prompts(2):
        response = requests.post(f"{HTTP}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                                 json={"model": MODEL, "messages": [{"role": "user", "content": text}],
                                       "max_tokens": 32, "temperature": 0}, timeout=120)
        assert response.status_code == 200
    stats = ReplicaStats(*(float(get_health()["autoscaling"][m]) for m in METRICS))
    assert stats.acceptance_length > 1.0, stats  # full blocks every round: drafts were accepted
    assert stats.batch_slots == MAX_CONCURRENT and stats.step_seconds > 0 and stats.token_rate > 0, stats
    assert stats.capacity > stats.token_rate, stats  # a full batch outruns one request at a time


def ray_exported(model: str) -> dict[str, dict[str, float]]:
    """Per Ray worker: the ray_dspark_spec_decode_num_*_total series of ``model`` from the node's metrics agent."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"http://127.0.0.1:{RAY_METRICS_PORT}/metrics", timeout=30).text
    workers: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name.startswith("ray_dspark_spec_decode_num_") and sample.name.endswith("_total") and \
                    labels.get("model_name") == model:
                extra = "".join(f"|{k}={labels[k]}" for k in sorted(labels) if k == "position")
                workers.setdefault(labels["WorkerId"], {})[sample.name + extra] = sample.value
    return workers


def test_openai_client_greedy_equals_in_process(client, engine):
    for text in prompts(2):
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                              max_tokens=24, temperature=0)
        expected = reference(engine, text, chat=True, max_tokens=24)
        assert chat.choices[0].message.content == engine.tokenizer.decode(expected, skip_special_tokens=True)
        assert chat.usage.completion_tokens == len(expected)
        spec = chat.model_extra["spec"]  # a verify pass commits its accepted drafts + 1 (fewer at max_tokens)
        assert spec["acceptance_length"] == pytest.approx(chat.usage.completion_tokens / spec["verify_steps"])
        assert spec["verify_steps"] <= chat.usage.completion_tokens <= spec["verify_steps"] + spec["accepted_tokens"]
        assert spec["accepted_tokens"] == sum(spec["accepted_per_position"]) > 0  # drafts accepted: tau > 1
        completion = client.completions.create(model=MODEL, prompt=text, max_tokens=16, temperature=0)
        expected = reference(engine, text, chat=False, max_tokens=16)
        assert completion.choices[0].text == engine.tokenizer.decode(expected, skip_special_tokens=True)


def test_openai_streaming_equals_non_streaming(client):
    text = prompts(1)[0]
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                           max_tokens=24, temperature=0).choices[0].message.content
    pieces, finish = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                                max_tokens=24, temperature=0, stream=True):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole and finish == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=text, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == client.completions.create(model=MODEL, prompt=text, max_tokens=12,
                                                 temperature=0).choices[0].text


def test_sse_wire_format_ends_with_done(served):
    response = requests.post(f"{HTTP}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, stream=True,
                             json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True, "seed": 1})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 4


def test_grpc_unary_and_streaming_equal_in_process(stub, engine):
    dspark, channel = stub
    text = prompts(1)[0]
    expected = reference(engine, text, chat=True, max_tokens=20)
    request = pb.GenerateRequest(prompt=text, chat=True, max_tokens=20, temperature=0.0)
    unary = dspark.Generate(request, metadata=AUTH, timeout=120)
    assert list(unary.token_ids) == expected and unary.finish_reason == "length"
    assert unary.usage.completion_tokens == 20 and unary.spec.verify_steps < 20  # drafts accepted: fewer passes
    chunks = list(dspark.GenerateStream(request, metadata=AUTH, timeout=120))
    assert [t for c in chunks for t in c.token_ids] == expected
    assert "".join(c.text for c in chunks) == unary.text and chunks[-1].finish_reason == "length"
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                       metadata=(("application", "dspark"),), timeout=30)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_bad_input_is_invalid_argument(stub):
    dspark, _ = stub
    for request in (pb.GenerateRequest(prompt="", max_tokens=4),
                    pb.GenerateRequest(prompt="hi", max_tokens=1000),
                    pb.GenerateRequest(prompt="hi", max_tokens=4, temperature=-1.0),
                    # the bounds HTTP has (these restarted the drafter or the replica before)
                    pb.GenerateRequest(prompt="hi", max_tokens=4, temperature=50.0),
                    pb.GenerateRequest(prompt="hi", max_tokens=4, seed=2**64 - 1),
                    pb.GenerateRequest(prompt="hi", max_tokens=4, top_k=2**32 - 1),
                    pb.GenerateRequest(prompt="hi", max_tokens=4, stop=[""]),
                    pb.GenerateRequest(prompt_token_ids=[1, 2, 10**9], max_tokens=4)):
        with pytest.raises(grpc.RpcError) as err:
            dspark.Generate(request, metadata=AUTH, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert err.value.details()


def test_authentication_on_both_protocols(served, stub):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY + "x"}):
        response = requests.post(f"{HTTP}/v1/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(f"{HTTP}/v1/models", timeout=30).status_code == 401
    assert requests.get(f"{HTTP}/health", timeout=30).status_code == 200  # stays open
    ok = requests.post(f"{HTTP}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert ok.status_code == 200
    dspark, _ = stub
    for metadata in ((("application", "dspark"),), (("application", "dspark"), ("authorization", "Bearer no"))):
        with pytest.raises(grpc.RpcError) as err:
            dspark.Generate(pb.GenerateRequest(prompt="Hi", max_tokens=2), metadata=metadata, timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert dspark.Generate(pb.GenerateRequest(prompt="Hi", max_tokens=2), metadata=AUTH, timeout=60).token_ids


@pytest.mark.parametrize("body,status,param", [
    ({"model": MODEL, "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "Hi", "max_tokens": 65}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "Hi", "temperature": 5}, 400, "temperature"),
    ({"model": MODEL, "prompt": "Hi", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "Hi", "top_k": 2**63}, 400, "top_k"),
    ({"model": MODEL, "prompt": "Hi", "seed": 2**64 - 1}, 400, "seed"),
    ({"model": MODEL, "prompt": "Hi", "stop": [""]}, 400, "stop"),
    ({"model": MODEL, "prompt": "Hi", "n": 2}, 400, "n"),
    ({"model": MODEL, "prompt": "Hi", "logprobs": True}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "Hi", "unknown_field": 1}, 400, "unknown_field"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": [5, -1]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "word " * 600}, 413, "prompt"),
    ({"model": "gpt-4", "prompt": "Hi"}, 404, "model"),
    ({"prompt": "Hi"}, 400, "model"),
])
def test_bad_requests_get_openai_errors(served, body, status, param):
    response = requests.post(f"{HTTP}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                             timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_malformed_body_and_unknown_route(served):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    response = requests.post(f"{HTTP}/v1/completions", data="{not json", headers=auth, timeout=30)
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    assert requests.get(f"{HTTP}/v1/nothing", headers=auth, timeout=30).status_code == 404


def test_overload_gets_429_with_retry_after(served):
    body = {"model": MODEL, "prompt": "Count from one to one hundred:", "max_tokens": 24, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    statuses, lock = [], threading.Lock()

    def call():
        with requests.post(f"{HTTP}/v1/completions", json=body, headers=headers, stream=True, timeout=120) as r:
            with lock:
                statuses.append((r.status_code, r.headers.get("Retry-After")))
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=call) for _ in range(MAX_CONCURRENT + MAX_QUEUED + 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    refused = [s for s in statuses if s[0] == 429]
    assert refused and all(int(retry) >= 1 for _, retry in refused)
    assert sum(s[0] == 200 for s in statuses) >= MAX_CONCURRENT
    assert {s[0] for s in statuses} <= {200, 429}


def test_cancelled_streams_free_the_kv_cache(served):
    headers = {"Authorization": f"Bearer {KEY}"}
    start = get_health()
    assert start["dtypes"] == {part: {"dtype": "bfloat16", "reason": "configured"} for part in ("target", "draft")}
    assert start["in_flight"] == 0
    body = {"model": MODEL, "prompt": "Tell me a long story about a dragon.", "max_tokens": 64, "stream": True}
    for _ in range(50):
        response = requests.post(f"{HTTP}/v1/completions", json=body, headers=headers, stream=True, timeout=60)
        assert response.status_code == 200
        next(response.iter_lines())  # the first chunk arrived: the request holds KV blocks
        response.close()  # the client goes away mid-stream
    wait_for(get_health, 120, f"the KV cache freed (nothing in flight, {start['kv_free_blocks']} free blocks)",
             until=lambda health: health["in_flight"] == 0 and health["kv_free_blocks"] == start["kv_free_blocks"],
             interval_s=0.5)
