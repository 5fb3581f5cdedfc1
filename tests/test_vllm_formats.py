"""Every draft config this project writes, read by the installed vLLM's own readers (speculators ``dspark``:
``vllm/transformers_utils/configs/speculators/``; ``k3_dspark``: ``K3DSparkConfig``), gives the same layer ids,
block layout and vocabulary as this library's reading of it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dspark.config import DecoderConfig
from dspark.formats.checkpoint import draft_config_from_json, load_draft, save_draft
from dspark.integrations.vllm_0_32 import WRITTEN_AGAINST, installed_version
from dspark.model.draft_model import DSparkDraft
from dspark.testing import tiny_draft_config

from conftest import assert_vllm_reads_as_we_do

REPO = Path(__file__).resolve().parents[1]
SHIPPED = [REPO / "configs" / "drafts" / "kimi-k3.1-pro-dspark.json",
           REPO / "configs" / "drafts" / "kimi-k3.1-pro-dspark-preview.json",
           REPO / "models" / "smollm2-135m-dspark" / "config.json"]


def test_the_installed_vllm_is_the_one_this_was_written_against():
    assert installed_version() in WRITTEN_AGAINST.values()


@pytest.mark.parametrize("config_file", SHIPPED, ids=lambda p: p.parent.name + "/" + p.name)
def test_shipped_configs(config_file):
    view = assert_vllm_reads_as_we_do(config_file)
    assert view["sample_from_anchor"] is True and view["num_slots"] == view["num_speculative_tokens"] == 7


def tiny_target() -> DecoderConfig:
    return DecoderConfig(hidden_size=32, intermediate_size=64, num_layers=6, num_heads=4, num_kv_heads=2,
                         head_dim=8, vocab_size=64)


EXPORTS = {
    "anchor-as-first": {},
    "bonus-anchor": {"sample_from_anchor": False},
    "reduced-vocab": {"draft_vocab_size": 24},
    "no-markov": {"enable_markov_head": False, "confidence_with_markov": False, "markov_rank": 1},  # rank unused
    "gated": {"markov_head_type": "gated"},
    "rnn": {"markov_head_type": "rnn"},
    "gpt-j-rope": {"backbone": replace(tiny_draft_config(tiny_target()).backbone, rope_interleave=True)},
    "first-and-last-layers": {"target_layer_ids": (0, 5)},
    "sliding-window-layers": {"backbone": replace(tiny_draft_config(tiny_target()).backbone, model_type="qwen3",
                                                  qk_norm=True, layer_types=("sliding_attention",),
                                                  sliding_window=16)},
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_exports(tmp_path, name):
    cfg = replace(tiny_draft_config(tiny_target(), block_size=5, markov_rank=8), **EXPORTS[name])
    draft = DSparkDraft(cfg)
    if cfg.reduced_vocab:
        draft.d2t.copy_(torch.arange(cfg.draft_vocab_size))  # draft id i -> target id 2i
        draft.t2d.zero_()[0 : 2 * cfg.draft_vocab_size : 2] = True
    save_draft(draft, tmp_path)
    view = assert_vllm_reads_as_we_do(tmp_path / "config.json")
    assert view["target_layer_ids"] == list(cfg.target_layer_ids)  # and back: load_draft reads what was meant
    assert load_draft(tmp_path).config == cfg


def test_an_mla_export_is_k3_dspark(tmp_path):
    cfg = draft_config_from_json(json.loads(SHIPPED[1].read_text()))
    small = replace(cfg, backbone=replace(cfg.backbone, hidden_size=64, intermediate_size=96, num_layers=2,
                                          vocab_size=128, num_heads=4, num_kv_heads=4, q_lora_rank=32,
                                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
                    target_hidden_size=64, mask_token_id=127, markov_rank=8, target_layer_ids=(0, 1, 3))
    save_draft(DSparkDraft(small), tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["model_type"] == "k3_dspark" and data["architectures"] == ["K3DSparkModel"]
    assert_vllm_reads_as_we_do(tmp_path / "config.json")
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"context_proj.weight", "context_norm.weight", "final_norm.weight"} <= names
    assert not names & {"fc.weight", "hidden_norm.weight", "norm.weight"}
    assert load_draft(tmp_path).config == small


def test_a_legacy_export_is_read_with_what_it_meant():
    """This project's exports before the formats matched (markov_head_type "markov", a value no other tool writes)
    held anchor-as-first blocks and output-of-layer ids under sample_from_anchor false / aux ids."""
    current = json.loads(SHIPPED[2].read_text())
    legacy = {**current, "markov_head_type": "markov", "sample_from_anchor": False,
              "aux_hidden_state_layer_ids": [i - 1 for i in current["aux_hidden_state_layer_ids"]]}
    assert draft_config_from_json(legacy) == draft_config_from_json(current)
