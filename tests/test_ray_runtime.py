"""The distributed runtime: target shard actors, drafter actor and router on a real local Ray cluster."""

from __future__ import annotations

import time

import pytest

from actors.collective import feature_source
from actors.router import Router, replica_bundles
from dspark.builder import build_engine
from dspark.config import ConfigError, SamplingParams
from dspark.dtype_choice import choose_dtype
from dspark.loader import encode_prompt
from dspark.schema import EngineFileConfig
from dspark.training.prepare import prepare_target

from conftest import benchmark_prompts, embedded_exact, wait_for

GREEDY = SamplingParams(max_tokens=32, temperature=0.0)


def tiny_config(target_dir, draft_dir, engine=None, **runtime) -> EngineFileConfig:
    return EngineFileConfig(
        target={"path": str(target_dir), "dtype": "float64"},
        draft={"path": str(draft_dir), "dtype": "float64"},
        engine={"max_num_seqs": 8, "kv_cache_tokens": 8192, "scheduler": "full", **(engine or {})},
        runtime={"shard_threads": 1, "drafter_threads": 1, **runtime},
    )


@pytest.fixture(scope="module")
def tiny_prompts(tiny_tokenizer):
    texts = benchmark_prompts("humaneval", 6) + benchmark_prompts("gsm8k", 6)
    return [tiny_tokenizer.encode(t)[:48] for t in texts]


@pytest.fixture(scope="module")
def in_process_greedy(tiny_target_dir, tiny_draft_dir, tiny_prompts):
    engine = build_engine(tiny_config(tiny_target_dir, tiny_draft_dir), speculate=False, backend="native")
    return [r.token_ids for r in engine.generate(tiny_prompts, GREEDY)]


def run_router(config, prompts, params=GREEDY):
    router = Router(config)
    try:
        results = router.generate(prompts, params)
        return router, [r.token_ids for r in results], router.transport_stats()
    finally:
        router.shutdown()


@pytest.mark.parametrize("tp_size,pipeline", [(1, False), (2, False), (1, True), (2, True)])
def test_ray_path_equals_in_process_greedy(ray_cluster, tiny_target_dir, tiny_draft_dir, tiny_prompts,
                                           in_process_greedy, tp_size, pipeline):
    config = tiny_config(tiny_target_dir, tiny_draft_dir, tp_size=tp_size, pipeline=pipeline)
    router, outputs, _ = run_router(config, tiny_prompts)
    assert outputs == in_process_greedy
    assert router.metrics.num_drafts > 0, "the drafter actor must have drafted"


@pytest.mark.parametrize("runtime", [{}, {"tp_size": 2, "feature_shard": 1}], ids=["tp1", "tp2-from-shard1"])
def test_hidden_states_travel_by_the_collective_channel(ray_cluster, tiny_target_dir, tiny_draft_dir, tiny_prompts,
                                                        in_process_greedy, runtime):
    config = tiny_config(tiny_target_dir, tiny_draft_dir, **runtime)
    router = Router(config)
    try:
        results = router.generate(tiny_prompts, GREEDY)
        assert [r.token_ids for r in results] == in_process_greedy
        assert router.feature_shard == runtime.get("feature_shard", 0)
        stats = router.transport_stats()
        width = len(router.feature_layers) * router.target.config.hidden_size
    finally:
        router.shutdown()
    sent, received = stats["target"]["channel"], stats["drafter"]["channel"]
    # every committed position's fused hidden states, less each request's final round (never drafted again)
    committed = sum(len(r.prompt_ids) + len(r.token_ids) - 1 for r in results)
    assert sent["rows"] == committed
    assert sent["bytes"] == sent["rows"] * width * 8  # float64
    assert 0 < received["rows"] <= sent["rows"] and received["bytes"] == received["rows"] * width * 8
    # what the shard actors return to the router carries no hidden states
    assert stats["object_store_feature_bytes"] == 0 and stats["target"]["channel_errors"] == 0
    assert stats["target"]["rank"] == router.feature_shard
    # the shard releases each message once the drafter has answered a call made after it: only the last few stay
    assert sent["messages"] > 10 and stats["target"]["undelivered"] <= 4, (sent, stats["target"]["undelivered"])


@pytest.mark.parametrize("pipeline", [False, True])
def test_draft_gate_runs_on_the_ray_path(ray_cluster, tiny_target_dir, tiny_draft_dir, tiny_prompts,
                                         in_process_greedy, pipeline):
    """The router runs the engine's round: the gate holds the random head's blocks back there too."""
    config = tiny_config(tiny_target_dir, tiny_draft_dir, engine={"draft_gate": True}, pipeline=pipeline)
    router = Router(config)
    try:
        assert router.gate is not None and router.gate.break_even > 0
        ids = [router.add_request(p, GREEDY) for p in tiny_prompts]
        while router.has_unfinished():
            router.step()
        results = [router.result(i) for i in ids]
    finally:
        router.shutdown()
    assert [r.token_ids for r in results] == in_process_greedy  # held-back rounds change nothing decoded
    skips = [r.metrics.draft_skips for r in results]
    assert router.metrics.draft_skips == sum(skips) > 0
    assert all(r.metrics.draft_skips > 0 for r in results if r.metrics.verify_steps >= 8), skips
    # a held-back round is a verify step without a draft: drafts + skips + prefill = verify steps per request
    for r in results:
        assert r.metrics.num_drafts + r.metrics.draft_skips + 1 <= r.metrics.verify_steps
    # the first requests drafted before being held back; once the server's pooled record shows the head below
    # break-even, a new greedy request drafts its first round and then backs off (DraftGate.new_state)
    assert results[0].metrics.num_drafts > 0 and all(r.metrics.num_drafts > 0 for r in results)


def test_auto_dtype_is_chosen_by_the_router_and_reaches_its_actors(ray_cluster, tiny_target_dir, tiny_draft_dir,
                                                                   tiny_prompts):
    config = tiny_config(tiny_target_dir, tiny_draft_dir)
    config = config.model_copy(update={part: getattr(config, part).model_copy(update={"dtype": "auto"})
                                       for part in ("target", "draft")})
    router = Router(config)
    try:
        expected = choose_dtype().dtype  # this machine's answer (the choice itself: tests/test_dtype_choice.py)
        assert {part: d["dtype"] for part, d in router.dtypes.items()} == {"target": expected, "draft": expected}
        assert router.file_config.target.dtype == router.file_config.draft.dtype == expected  # what the actors load
        out = router.generate(tiny_prompts[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert all(len(r.token_ids) == 8 for r in out) and router.metrics.num_drafts > 0
    finally:
        router.shutdown()


def test_feature_source_avoids_the_drafters_gpu():
    # 8 shards on 8 GPUs with the drafter on GPU 0 (fractional): NCCL cannot pair ranks on one GPU
    shards = [f"node/gpu{i}" for i in range(8)]
    assert feature_source(shards, "node/gpu0") == 1
    assert feature_source(shards, "node/gpu5") == 0
    assert feature_source(["cpu", "cpu"], "cpu") == 0
    assert feature_source(shards, "node/gpu0", configured=3) == 3
    with pytest.raises(ConfigError, match="runtime.drafter_gpus"):
        feature_source(["node/gpu0"], "node/gpu0")
    with pytest.raises(ValueError, match="feature_shard 2 is not a shard"):
        tiny_config("t", "d", tp_size=2, feature_shard=2)


@pytest.mark.parametrize("pipeline", [False, True])
def test_killing_the_drafter_mid_stream(ray_cluster, tiny_target_dir, tiny_draft_dir, tiny_prompts,
                                        in_process_greedy, pipeline):
    config = tiny_config(tiny_target_dir, tiny_draft_dir, pipeline=pipeline, drafter_timeout_s=20)
    router = Router(config)
    try:
        ids = [router.add_request(p, GREEDY) for p in tiny_prompts[:8]]
        for _ in range(3):
            router.step()
        assert all(router.requests[i].speculative for i in ids)
        router.kill_drafter()
        deadline = time.monotonic() + 120
        while router.has_unfinished():
            assert time.monotonic() < deadline, "requests hang after the drafter died"
            router.step()
        outputs = [router.result(i).token_ids for i in ids]
        assert outputs == in_process_greedy[:8]
        assert router.metrics.drafter_failures == 1
        wait_for(lambda: router.step() is not None and router.drafter_restarts, max(deadline - time.monotonic(), 1),
                 "the drafter to be restarted")  # each step polls the replacement actor
        drafts_before = router.metrics.num_drafts
        again = router.generate(tiny_prompts[8:10], GREEDY)
        assert [r.token_ids for r in again] == in_process_greedy[8:10]
        assert router.metrics.num_drafts > drafts_before, "speculation must resume on the new drafter"
        assert all(r.metrics.num_drafts > 0 for r in again)
    finally:
        router.shutdown()


def test_placement_and_config_errors(ray_cluster, tiny_target_dir, tiny_draft_dir):
    config = tiny_config(tiny_target_dir, tiny_draft_dir, tp_size=2, shard_cpus=0.5, drafter_cpus=0.5)
    assert replica_bundles(config) == [{"CPU": 0.5}, {"CPU": 0.5}, {"CPU": 0.5}]
    with pytest.raises(ConfigError, match="tp_size"):
        Router(tiny_config(tiny_target_dir, tiny_draft_dir, tp_size=3))  # 4 heads do not split in 3
    with pytest.raises(ConfigError, match="target.path"):
        Router(tiny_config(tiny_target_dir.parent / "missing", tiny_draft_dir))


@pytest.mark.slow
def test_embedded_default_ray_equals_in_process(ray_cluster):
    prepare_target()
    exact = embedded_exact()
    config = exact.model_copy(update={"engine": exact.engine.model_copy(update={"max_num_seqs": 4})})
    engine = build_engine(config, backend="native")
    # 6 prompts: more than max_num_seqs (4), so the Ray path admits, batches and retires as in-process
    texts = [t for name in ("humaneval", "mbpp", "gsm8k", "mt-bench") for t in benchmark_prompts(name, 2)][:6]
    prompts = [encode_prompt(engine.tokenizer, t, chat=True) for t in texts]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    expected = [r.token_ids for r in engine.generate(prompts, params)]
    router, outputs, stats = run_router(config, prompts, params)
    assert outputs == expected
    assert router.metrics.num_accepted_tokens > 0 and stats["target"]["channel"]["rows"] > 0
