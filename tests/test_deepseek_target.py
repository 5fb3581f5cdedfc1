"""The DeepSeek-V3 / Kimi architecture (MLA + mixture of experts) against transformers' own implementation."""

from __future__ import annotations

import pytest
import torch

from dspark.config import ConfigError
from dspark.decoding.kv_cache import PagedKVCache
from dspark.formats.target_checkpoint import load_target
from dspark.testing import make_tiny_deepseek as tiny_deepseek
from dspark.testing import quantize_checkpoint


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory, tiny_target_dir):
    return tiny_deepseek(tmp_path_factory.mktemp("deepseek-v3"), tiny_target_dir)


def run(target, cache: PagedKVCache, ids: torch.Tensor, start: int) -> torch.Tensor:
    # ids: [1, T] new tokens at positions start..start+T-1 -> logits [T, V]
    meta = cache.allocator.metadata([0], [start], [ids.shape[1]])
    return target(ids, start + torch.arange(ids.shape[1])[None], cache, meta).logits[0]


def test_logits_match_transformers_prefill_and_verify_on_a_cache(deepseek_dir):
    path, reference = deepseek_dir
    target = load_target(path, "float32")
    cfg = target.config
    assert cfg.attention == "mla" and cfg.n_routed_experts == 8 and cfg.rope_interleave
    assert type(target.layers[0].mlp).__name__ == "MLP" and type(target.layers[1].mlp).__name__ == "MoE"
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, 20))
    with torch.no_grad():
        expected = reference(ids).logits[0]
    cache = target.make_cache(256, 16)
    assert cache.keys[0].shape[1:] == (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # the latent, not K/V
    assert cache.values[0].shape[-1] == 0
    cache.allocator.reserve(0, 64)
    prefill = run(target, cache, ids[:, :13], 0)  # prompt
    verify = run(target, cache, ids[:, 13:], 13)  # a 7-token verify block on top of the cached prompt
    tolerance = 1e-4
    assert (prefill - expected[:13]).abs().max().item() < tolerance
    assert (verify - expected[13:]).abs().max().item() < tolerance


def test_yarn_with_unequal_mscales_matches_transformers(tmp_path, tiny_target_dir):
    """DeepSeek YaRN: cos/sin carry mscale(f, mscale) / mscale(f, mscale_all_dim), the softmax scale
    mscale(f, mscale_all_dim) squared -- the rotary factor is not 1 when the two differ."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
    path, reference = tiny_deepseek(tmp_path / "yarn", tiny_target_dir, rope_scaling=yarn)
    target = load_target(path, "float32")
    assert target.config.rope.scaling_type == "yarn" and target.config.rope.mscale == 0.707
    torch.manual_seed(2)
    ids = torch.randint(0, target.config.vocab_size, (1, 24))
    with torch.no_grad():
        expected = reference(ids).logits[0]
    cache = target.make_cache(256, 16)
    cache.allocator.reserve(0, 64)
    assert (run(target, cache, ids, 0) - expected).abs().max().item() < 1e-4


def test_moe_routing_uses_several_experts(deepseek_dir):
    path, _ = deepseek_dir
    target = load_target(path, "float32")
    gate = target.layers[1].mlp.gate
    weights, experts = gate(torch.randn(64, target.config.hidden_size))
    assert experts.shape == (64, 2) and len(experts.unique()) > 4
    assert torch.allclose(weights.sum(-1), torch.full((64,), 2.5))  # normalised, then routed_scaling_factor
    groups = experts // 2  # 8 experts in 4 groups: picks come from at most topk_group = 2 groups
    assert all(len(set(row)) <= 2 for row in groups.tolist())


@pytest.fixture(scope="module")
def deepseek64_with_draft(tmp_path_factory, tiny_target_dir):
    from dspark.formats.checkpoint import save_draft
    from dspark.model.draft_model import DSparkDraft
    from dspark.testing import tiny_draft_config

    path, _ = tiny_deepseek(tmp_path_factory.mktemp("deepseek-v3-f64"), tiny_target_dir, torch.float64)
    target = load_target(path, "float64")
    torch.manual_seed(2)
    draft_dir = tmp_path_factory.mktemp("deepseek-draft")
    save_draft(DSparkDraft(tiny_draft_config(target.config, block_size=4, layer_ids=(0, 1, 2))), draft_dir)
    return path, draft_dir


def ray_config(path, draft_dir, **runtime):
    from dspark.schema import EngineFileConfig

    return EngineFileConfig(target={"path": str(path), "dtype": "float64"},
                            draft={"path": str(draft_dir), "dtype": "float64"},
                            engine={"max_num_seqs": 4, "kv_cache_tokens": 4096, "scheduler": "full"},
                            runtime={"shard_threads": 1, "drafter_threads": 1, **runtime})


@pytest.mark.parametrize("runtime", [{"tp_size": 2}, {"tp_size": 2, "expert_parallel": True}])
def test_tensor_and_expert_parallel_shards_match_tp1_with_a_dspark_head(ray_cluster, deepseek64_with_draft,
                                                                         tiny_tokenizer, runtime):
    import ray

    from actors.router import Router
    from dspark.builder import build_engine
    from dspark.config import SamplingParams

    path, draft_dir = deepseek64_with_draft
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = [tiny_tokenizer.encode(t)[:24] for t in ("def main(argv):", "import os, sys", "class Parser:")]
    target_only = [r.token_ids for r in build_engine(ray_config(path, draft_dir), speculate=False,
                                                                backend="native").generate(
        prompts, params)]
    reference = Router(ray_config(path, draft_dir))  # TP=1 on the Ray path, speculating
    try:
        tp1 = [r.token_ids for r in reference.generate(prompts, params)]
    finally:
        reference.shutdown()
    sharded = Router(ray_config(path, draft_dir, **runtime))
    try:
        outputs = [r.token_ids for r in sharded.generate(prompts, params)]
        drafts = sharded.metrics.num_drafts
        read = [s["checkpoint_bytes_read"] for s in ray.get([shard.stats.remote() for shard in sharded.shards])]
    finally:
        sharded.shutdown()
    assert tp1 == target_only  # the DSpark head end to end on this target: exactly the target's output
    assert outputs == tp1 and drafts > 0
    checkpoint_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert len(read) == 2 and max(read) < 0.8 * checkpoint_bytes  # each shard actor read only its slice


def test_fp8_block_quantised_checkpoint_loads_close_to_the_original(tiny_target_dir, tmp_path):
    """Quantise every projection of the tiny bf16 model to e4m3 with 32x32 block scales, as DeepSeek/Kimi
    publish, and compare with the bf16 original (both computed in fp32)."""
    import json

    from safetensors.torch import load_file, save_file

    path, _ = tiny_deepseek(tmp_path / "original", tiny_target_dir, weight_std=None)  # transformers' own init
    state = {name: t.to(torch.bfloat16) if t.is_floating_point() else t
             for name, t in load_file(str(path / "model.safetensors")).items()}
    save_file(state, str(path / "model.safetensors"))  # the bf16 original, as a model is released
    fp8_dir = tmp_path / "fp8"
    assert quantize_checkpoint(path, fp8_dir, (32, 32)) > 20
    config = json.loads((fp8_dir / "config.json").read_text())
    original, fp8 = load_target(path, "float32"), load_target(fp8_dir, "float32")
    ids = torch.randint(0, original.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    logits = []
    for model in (original, fp8):
        cache = model.make_cache(256, 16)
        cache.allocator.reserve(0, 32)
        logits.append(run(model, cache, ids, 0))
    # e4m3 keeps 3 mantissa bits (~2.7% rms weight error at these scales): stated tolerance, relative to the
    # spread of the original logits: rms error below 5%, worst logit below 25%
    diff, spread = logits[1] - logits[0], logits[0].std()
    assert diff.pow(2).mean().sqrt() / spread < 0.05 and diff.abs().max() / spread < 0.25
    assert (logits[1].argmax(-1) == logits[0].argmax(-1)).float().mean() > 0.8
    config["quantization_config"]["quant_method"] = "awq"
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quantization_config"):
        load_target(fp8_dir, "float32")
