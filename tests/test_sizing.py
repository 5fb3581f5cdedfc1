"""The full-size Kimi-K3.1-Pro configs: the target parses, both seed drafts fit it, and the sizing script runs."""

from __future__ import annotations

import json

import pytest

from dspark.config import ConfigError, DecoderConfig
from dspark.formats.checkpoint import check_compatible, draft_config_from_json
from dspark.model.kimi_k3 import KimiK3Config
from dspark.sizing import main, read_target_architecture, sizing

from conftest import REPO

TARGET = REPO / "configs" / "targets" / "kimi-k3.1-pro.json"
DRAFTS = sorted((REPO / "configs" / "drafts").glob("kimi-*.json"))


def test_kimi_target_config_describes_the_seeds_target():
    """Kimi-K3: a hybrid of KDA linear attention and NoPE MLA; the native engine refuses it by name, vLLM's own
    config class reads it with the same layer types, and both seed drafts fit it."""
    data = json.loads(TARGET.read_text())
    cfg = read_target_architecture(data)
    assert isinstance(cfg, KimiK3Config) and (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (7168, 93, 163840)
    assert cfg.num_mla_layers == 23 and cfg.kda_heads * cfg.kda_head_dim == 96 * 128
    with pytest.raises(ConfigError, match="model_type.*vLLM serves it"):
        DecoderConfig.from_hf(data)
    from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config as VllmKimiK3Config

    text = VllmKimiK3Config(**{k: v for k, v in data.items() if k != "_comment"}).text_config
    assert [text.is_kda_layer(i) for i in range(93)] == [cfg.is_kda(i) for i in range(93)]
    assert (text.hidden_size, text.num_hidden_layers, text.is_mla, text.is_moe) == (7168, 93, True, True)
    for path in DRAFTS:
        draft = draft_config_from_json(json.loads(path.read_text()))
        check_compatible(draft, cfg)  # raises naming the field if the draft cannot read this target
        assert draft.target_layer_ids == (7, 23, 67, 83, 91)


def test_sizing_of_kimi_on_eight_gpus(capsys):
    cfg = read_target_architecture(json.loads(TARGET.read_text()))
    draft = draft_config_from_json(json.loads(DRAFTS[0].read_text()))
    tp = sizing(cfg, draft, 8, False, batch=64, tau=3.3)
    ep = sizing(cfg, draft, 8, True, batch=64, tau=3.3)
    assert 0.7e12 < tp.target_params < 1.0e12  # latent experts: 3 x 3584 x 2048 each, 384 per MoE layer
    assert tp.target_weight_bytes_per_gpu < 268 * 2**30  # fits a B300's HBM at FP8 with room for the cache
    assert ep.target_weight_bytes_per_gpu == pytest.approx(tp.target_weight_bytes_per_gpu, rel=0.01)
    assert tp.target_kv_bytes_per_token_per_gpu == 23 * (512 + 64) * 2  # a bf16 latent per token, MLA layers only
    # KDA: conv state 3 x 96 x 128 x (4 - 1 + 7 drafted) in bf16 + a 96 x 128 x 128 fp32 state, 70 layers, / 8 GPUs
    assert tp.target_state_bytes_per_sequence_per_gpu == 70 * (3 * 12288 * 10 * 2 + 96 * 128 * 128 * 4) / 8
    assert tp.feature_bytes_per_step == pytest.approx(5 * 7168 * 2 * 64 * 3.3)
    assert main(["--target", str(TARGET), "--draft", str(DRAFTS[0]), "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "target weights per GPU" in out and "KDA state per sequence" in out


PRODUCTION = sorted((REPO / "configs").glob("kimi-*-b300.yaml"))


@pytest.mark.parametrize("path", PRODUCTION, ids=[p.stem for p in PRODUCTION])
def test_production_config_fits_one_b300_node(path, capsys):
    from dspark.schema import load_engine_config
    from dspark.sizing import deployment_from_config

    config = load_engine_config(path)
    plan = deployment_from_config(path)
    assert (plan.gpus, config.engine.backend, config.engine.block_size) == (8, "vllm", 7)
    check_compatible(plan.draft, plan.target)
    assert isinstance(plan.target, KimiK3Config)  # sized here; served by vLLM (the native engine refuses it)
    rt = config.runtime
    assert rt.tp_size * rt.shard_gpus + rt.drafter_gpus <= 8  # one 8-GPU node per replica
    assert main(["--config", str(path)]) == 0, "weights + KV budget must fit a B300 (exit 1 otherwise)"
    out = capsys.readouterr().out
    assert "of 268 GiB" in out and "expert parallel, 8 GPUs" in out
    # the same script refuses a KV budget that does not fit
    assert main(["--config", str(path), "--gpu-memory-gib", "120"]) == 1
    assert plan.weight_bytes == 1.0  # on GPUs the FP8 weights stay FP8 (target.fp8_weights: auto -> matmul)


def test_fp8_dequantised_at_load_would_not_fit(tmp_path, capsys):
    """Dequantising Kimi's FP8 weights into bf16 at load doubles them: the sizing says so and, on a GPU where the
    FP8 weights fit with the KV budget (180 GiB), refuses."""
    from dspark.schema import load_engine_config, write_variant
    from dspark.sizing import deployment_from_config, target_sizing

    path = REPO / "configs" / "kimi-k3.1-pro-b300.yaml"
    config = load_engine_config(path)
    variant = write_variant(config, tmp_path / "load.yaml", target={"fp8_weights": "load"})
    plan, fp8 = deployment_from_config(variant), deployment_from_config(path)
    per_gpu = [target_sizing(p.target, p.gpus, p.expert_parallel, p.weight_bytes)[1] for p in (plan, fp8)]
    assert plan.weight_bytes == 2.0 and per_gpu[0] > 1.95 * per_gpu[1]  # (embedding and LM head are bf16 in both)
    assert main(["--config", str(path), "--gpu-memory-gib", "180"]) == 0
    assert main(["--config", str(variant), "--gpu-memory-gib", "180"]) == 1


def test_preview_draft_caches_its_mla_latent_only():
    from dspark.sizing import deployment_from_config, draft_sizing

    plan = deployment_from_config(REPO / "configs" / "kimi-k3.1-pro-preview-b300.yaml")
    assert plan.draft.backbone.attention == "mla" and plan.draft.markov_rank == 512
    _, kv = draft_sizing(plan.draft)
    assert kv == 5 * (512 + 64) * 2  # 5 layers x (kv LoRA rank + rope dims) x bf16
