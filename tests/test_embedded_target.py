"""The real embedded target (SmolLM2-135M-Instruct from its PyPI GGUF), through our own code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark.config import EngineConfig, SamplingParams
from dspark.decoding.drafter import DSparkDrafter
from dspark.decoding.engine import Engine
from dspark.formats.target_checkpoint import load_target
from dspark.loader import encode_prompt, load_tokenizer
from dspark.model.draft_model import DSparkDraft
from dspark.testing import tiny_draft_config
from dspark.training.prepare import prepare_target, sanity_check

from conftest import benchmark_prompts, embedded_exact

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    path = prepare_target()
    return path, load_target(path), load_tokenizer(path)


def test_converted_model_answers_sensibly(smollm2):
    assert "Paris" in sanity_check(smollm2[0])


def test_speculative_greedy_equals_plain_on_the_real_target(smollm2):
    _, target, tok = smollm2
    cfg = target.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    torch.manual_seed(0)
    draft = DSparkDraft(tiny_draft_config(cfg, block_size=4, layer_ids=(1, 15, 27))).bind_target(
        target.embed_tokens, target.lm_head)
    prompts = [encode_prompt(tok, p, chat=True) for p in benchmark_prompts("gsm8k", 3)]
    params = SamplingParams(max_tokens=24, temperature=0)
    engine_cfg = EngineConfig(kv_cache_tokens=4096, max_num_seqs=4, scheduler="full")
    plain = Engine(target, tok, None, EngineConfig(speculate=False, kv_cache_tokens=4096)).generate(prompts, params)
    spec = Engine(target, tok, DSparkDrafter(draft, 4096, 16, 64), engine_cfg, (1, 15, 27)).generate(prompts, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert all(r.text.strip() for r in plain)


def test_profile_is_measured_at_start_up(smollm2):
    _, target, tok = smollm2
    draft = DSparkDraft(tiny_draft_config(target.config, block_size=4)).bind_target(target.embed_tokens,
                                                                                   target.lm_head)
    engine = Engine(target, tok, DSparkDrafter(draft, 2048, 16, 64),
                    EngineConfig(kv_cache_tokens=2048, max_num_seqs=2, profile_max_tokens=8), (0, 15, 29))
    profile = engine.profile
    assert profile.token_counts == (1, 2, 4, 8)
    assert all(b >= a > 0 for a, b in zip(profile.seconds, profile.seconds[1:]))
    assert profile.draft_seconds > 0


def test_shipped_draft_loads_and_is_lossless_on_the_embedded_default(smollm2):
    from dspark.builder import build_engine

    cfg = embedded_exact()
    engine = build_engine(cfg.model_copy(update={"target": cfg.target.model_copy(update={"path": str(smollm2[0])})}),
                          backend="native")
    assert engine.drafter is not None and engine.block_size == 7
    draft_cfg = engine.drafter.model.config
    assert draft_cfg.target_layer_ids == (2, 7, 21, 26, 28) and len(draft_cfg.confidence_temperatures) == 7
    tok = smollm2[2]
    prompts = [encode_prompt(tok, p, chat=True) for p in benchmark_prompts("mbpp", 2)]
    params = SamplingParams(max_tokens=32, temperature=0)
    spec = engine.generate(prompts, params)
    # the reference is plain decoding of the same target, in the config's dtype (bf16)
    plain_engine = Engine(engine.target, tok, None, EngineConfig(speculate=False, kv_cache_tokens=4096))
    plain = plain_engine.generate(prompts, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert engine.metrics.acceptance_length > 1.3  # a trained head: a random one stays near 1.0


def test_bf16_speculative_greedy_is_bit_exact_with_the_shipped_head(smollm2):
    """In bf16 the batch-invariant kernels make speculation exact, not just equal up to near-ties."""
    from dspark.formats.checkpoint import load_draft

    path, _, tok = smollm2
    target = load_target(path, "bfloat16")
    draft = load_draft(Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-dspark", target.config,
                       torch.bfloat16).bind_target(target.embed_tokens, target.lm_head)
    prompts = [encode_prompt(tok, p, chat=True) for name in ("humaneval", "gsm8k", "mt-bench")
               for p in benchmark_prompts(name, 2)]
    params = SamplingParams(max_tokens=32, temperature=0)
    plain = Engine(target, tok, None, EngineConfig(speculate=False, kv_cache_tokens=4096)).generate(prompts, params)
    spec_engine = Engine(target, tok, DSparkDrafter(draft, 4096, 16, 64),
                         EngineConfig(kv_cache_tokens=4096, max_num_seqs=4, scheduler="full"), (2, 7, 21, 26, 28))
    spec = spec_engine.generate(prompts, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert spec_engine.metrics.acceptance_length > 1.2  # drafts were really accepted, not all rejected


def test_converted_target_matches_transformers(smollm2):
    """Our code on the prepared checkpoint = transformers on the same directory (RoPE theta 1e5 included)."""
    from transformers import AutoModelForCausalLM

    path, target, tok = smollm2
    assert target.config.rope.theta == 100000.0
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("The capital of France is Paris. The capital of Italy is")])
    with torch.no_grad():
        expected = reference(ids).logits[0]
    cache = target.make_cache(256, 16)
    cache.allocator.reserve(0, 64)
    meta = cache.allocator.metadata([0], [0], [ids.shape[1]])
    logits = target(ids, torch.arange(ids.shape[1])[None], cache, meta).logits[0]
    assert (logits - expected).abs().max().item() < 1e-3
