"""The DSpark head: both seed variants, the sequential stage, checkpoint IO and its refusals."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.config import ConfigError, DecoderConfig
from dspark.decoding.sampling import SamplingTensors
from dspark.formats.checkpoint import draft_config_from_json, load_draft, save_draft
from dspark.model.draft_model import DSparkDraft
from dspark.model.layers import Linear

REPO = Path(__file__).resolve().parents[1]
SEEDS = {"release": "kimi-k3.1-pro-dspark.json", "preview": "kimi-k3.1-pro-dspark-preview.json"}


def seed_config(variant: str):
    return draft_config_from_json(json.loads((REPO / "configs" / "drafts" / SEEDS[variant]).read_text()))


def shrink(cfg):
    """The same architecture at tiny size (every knob that matters kept: attention kind, YaRN, ...)."""
    bb = cfg.backbone
    small = replace(bb, hidden_size=64, intermediate_size=96, num_layers=2, vocab_size=128,
                    num_heads=8, num_kv_heads=2 if bb.attention == "gqa" else 8, head_dim=16,
                    q_lora_rank=32 if bb.q_lora_rank else None, kv_lora_rank=16 if bb.kv_lora_rank else 0,
                    qk_nope_head_dim=8 if bb.qk_nope_head_dim else 0,
                    qk_rope_head_dim=8 if bb.qk_rope_head_dim else 0, v_head_dim=8 if bb.v_head_dim else 0)
    return replace(cfg, backbone=small, target_hidden_size=64, mask_token_id=127, markov_rank=cfg.markov_rank // 32,
                   target_layer_ids=(0, 1, 3))


def test_seed_configs_at_full_size():
    release, preview = seed_config("release"), seed_config("preview")
    for cfg in (release, preview):
        assert cfg.target_layer_ids == (7, 23, 67, 83, 91)
        assert cfg.block_size == 7 and cfg.target_hidden_size == 7168 and cfg.backbone.num_layers == 5
    assert (release.backbone.attention, release.backbone.num_heads, release.backbone.num_kv_heads) == ("gqa", 64, 16)
    assert release.markov_rank == 256
    assert preview.backbone.attention == "mla" and preview.markov_rank == 512
    assert (preview.backbone.q_lora_rank, preview.backbone.kv_lora_rank) == (1536, 512)
    assert preview.backbone.rope.scaling_type == "yarn" and preview.backbone.rope.factor == 32


def _bound(cfg, seed=0):
    torch.manual_seed(seed)
    draft = DSparkDraft(cfg)
    embed = torch.nn.Embedding(cfg.backbone.vocab_size, cfg.backbone.hidden_size)
    head = torch.nn.Linear(cfg.backbone.hidden_size, cfg.backbone.vocab_size, bias=False)
    with torch.no_grad():
        draft.markov_head.markov_w2.weight.normal_(0, 1.0)
    return draft.bind_target(embed, head)


def _with_markov(kind: str) -> DSparkDraft:
    """A tiny bound head of Markov head type ``kind``, its Markov weights large enough to move the logits."""
    draft = _bound(replace(shrink(seed_config("release")), markov_head_type=kind))
    with torch.no_grad():
        for p in draft.markov_head.parameters():
            p.normal_(0, 0.5)
    return draft


def _hidden(draft, batch=3):
    cfg = draft.config
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randn(batch, 10, cfg.num_feature_layers * cfg.target_hidden_size, generator=gen)
    block = torch.full((batch, cfg.block_size), cfg.mask_token_id)
    block[:, 0] = torch.tensor([5, 9, 11][:batch])
    with torch.no_grad():
        return draft.backbone(block, 10 + torch.arange(cfg.block_size)[None].expand(batch, -1), draft.fuse(ctx),
                              torch.arange(10)[None].expand(batch, -1), None, None), block[:, 0]


@pytest.mark.parametrize("variant", ["release", "preview"])
def test_tiny_variant_runs_and_roundtrips(tmp_path, variant):
    cfg = shrink(seed_config(variant))
    draft = _bound(cfg)
    hidden, anchors = _hidden(draft)
    assert hidden.shape == (3, 7, 64) and torch.isfinite(hidden).all()
    save_draft(draft, tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    fusion = (("fc.weight", "hidden_norm.weight", "norm.weight") if variant == "release"  # speculators layout
              else ("context_proj.weight", "context_norm.weight", "final_norm.weight"))  # vLLM's k3_dspark (MLA)
    assert {*fusion, "markov_head.markov_w1.weight",
            "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    assert any(n.startswith("layers.1.self_attn.") for n in names)
    again = load_draft(tmp_path).bind_target(draft.embed_tokens, draft.lm_head)
    hidden2, _ = _hidden(again)
    assert torch.equal(hidden, hidden2)


@pytest.mark.parametrize("variant", ["release", "preview"])
def test_cached_context_equals_the_full_context(variant):
    """The paged context cache (MLA: the latent only) gives the same block states as recomputing
    the whole context, when the context arrives over two rounds."""
    draft = _bound(shrink(seed_config(variant))).double()
    cfg = draft.config
    expected, anchors = _hidden(draft)
    cache = draft.make_cache(256, 4)
    heads, key_dim, value_dim = cfg.backbone.cache_geometry
    if cfg.backbone.attention == "mla":
        assert (heads, value_dim) == (1, 0) and key_dim == cfg.backbone.kv_lora_rank + cfg.backbone.qk_rope_head_dim
    gen = torch.Generator().manual_seed(0)
    ctx = draft.fuse(torch.randn(3, 10, cfg.num_feature_layers * cfg.target_hidden_size, generator=gen).double())
    ids = [0, 1, 2]
    for rid in ids:
        cache.allocator.reserve(rid, 32)
    block = torch.full((3, cfg.block_size), cfg.mask_token_id)
    block[:, 0] = anchors
    with torch.no_grad():
        for start, end in ((0, 6), (6, 10)):
            meta = cache.allocator.metadata(ids, [start] * 3, [end - start] * 3, causal=False, device=ctx.device)
            positions = torch.arange(start, end)[None].expand(3, -1)
            hidden = draft.backbone(block, 10 + torch.arange(cfg.block_size)[None].expand(3, -1),
                                    ctx[:, start:end], positions, cache, meta)
    torch.testing.assert_close(hidden, expected.double(), rtol=1e-9, atol=1e-9)


def test_draft_probs_are_exactly_what_was_sampled_from():
    cfg = shrink(seed_config("release"))
    draft = _bound(cfg)
    hidden, anchors = _hidden(draft)
    temperature, top_p = 0.7, 0.8
    sampling = SamplingTensors(torch.full((3,), temperature), torch.full((3,), top_p), torch.zeros(3, dtype=torch.long),
                               [torch.Generator().manual_seed(i) for i in range(3)])
    proposal = draft.propose(hidden, anchors, sampling, prefilter_k=0)
    torch.set_grad_enabled(False)
    base = draft.lm_head(hidden)
    prev = anchors
    for k in range(cfg.block_size):
        # an independent re-implementation: Markov bias, temperature, nucleus
        logits = (base[:, k] + draft.markov_head.markov_w2(draft.markov_head.markov_w1(prev))) / temperature
        probs = torch.softmax(logits, -1)
        sorted_p, order = probs.sort(-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
        expected = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
        expected = expected / expected.sum(-1, keepdim=True)
        assert torch.allclose(proposal.draft_probs[:, k], expected, atol=1e-6)
        assert (proposal.draft_probs[:, k].gather(1, proposal.tokens[:, k:k + 1]) > 0).all()
        prev = proposal.tokens[:, k]
    assert ((proposal.confidences > 0) & (proposal.confidences < 1)).all()
    torch.set_grad_enabled(True)


def test_markov_head_conditions_on_the_previous_token_and_sampling_matches_probs():
    cfg = shrink(seed_config("release"))
    draft = _bound(cfg)
    hidden, anchors = _hidden(draft, batch=1)
    n = 4000
    sampling = SamplingTensors(torch.ones(n), torch.ones(n), torch.zeros(n, dtype=torch.long),
                               [torch.Generator().manual_seed(i) for i in range(n)])
    proposal = draft.propose(hidden.expand(n, -1, -1), anchors.expand(n), sampling, prefilter_k=16)
    first = proposal.tokens[:, 0]
    freq = torch.bincount(first, minlength=cfg.backbone.vocab_size).float() / n
    assert (freq - proposal.draft_probs[0, 0]).abs().max() < 0.03
    assert (proposal.draft_probs[:, 0] > 0).sum(-1).max() <= 16  # the prefilter bounds the support
    # position 2's distribution differs by the token sampled at position 1 (the Markov dependency)
    a, b = first[0], next(t for t in first if t != first[0])
    pa = proposal.draft_probs[first == a][0, 1]
    pb = proposal.draft_probs[first == b][0, 1]
    assert (pa - pb).abs().sum() > 1e-3


def _broken_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    edit(state, config)
    save_file(state, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_malformed_checkpoints_are_refused_by_name(tmp_path):
    cfg = shrink(seed_config("release"))
    save_draft(DSparkDraft(cfg), tmp_path / "ok")
    target = DecoderConfig(hidden_size=64, intermediate_size=96, num_layers=4, num_heads=8, num_kv_heads=2,
                           head_dim=8, vocab_size=128)
    load_draft(tmp_path / "ok", target)  # the good one loads

    cases = {
        "fc.weight": lambda s, c: s.__setitem__("fc.weight", torch.zeros(3, 3)),
        "markov_head.markov_w2.weight": lambda s, c: s.pop("markov_head.markov_w2.weight"),
        "stray.weight": lambda s, c: s.__setitem__("stray.weight", torch.zeros(1)),
        "speculators_model_type": lambda s, c: c.__setitem__("speculators_model_type", "eagle3"),
        "mask_token_id": lambda s, c: c.pop("mask_token_id"),
    }
    for i, (name, edit) in enumerate(cases.items()):
        with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
            load_draft(_broken_copy(tmp_path / "ok", tmp_path / f"bad{i}", edit), target)
    with pytest.raises(ConfigError, match=r"transformer_layer_config\.vocab_size"):
        load_draft(tmp_path / "ok", replace(target, vocab_size=256))
    with pytest.raises(ConfigError, match="target_hidden_size"):
        load_draft(tmp_path / "ok", replace(target, hidden_size=128, head_dim=16))
    with pytest.raises(ConfigError, match="aux_hidden_state_layer_ids"):
        load_draft(tmp_path / "ok", replace(target, num_layers=2))


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("prefilter_k", [0, 16])
def test_a_greedy_batch_drafts_what_the_sampling_path_gives_its_greedy_rows(kind, prefilter_k):
    """A batch of greedy rows skips the per-position distributions and draws (argmax only): the same tokens and
    confidences as those rows get on the sampling path, where a sampled row in the batch makes every row build its
    distribution and draw from it."""
    draft = _with_markov(kind)
    hidden, anchors = _hidden(draft)

    def sampling(temperatures):
        n = len(temperatures)
        return SamplingTensors(torch.tensor(temperatures), torch.ones(n), torch.zeros(n, dtype=torch.long),
                               [torch.Generator().manual_seed(i) for i in range(n)])

    greedy = draft.propose(hidden[:2], anchors[:2], sampling([0.0, 0.0]), prefilter_k)
    mixed = draft.propose(hidden, anchors, sampling([0.0, 0.0, 1.0]), prefilter_k)
    assert greedy.draft_probs is None and mixed.draft_probs is not None
    assert torch.equal(greedy.tokens, mixed.tokens[:2])
    assert torch.equal(greedy.confidences, mixed.confidences[:2])
    if prefilter_k:
        return
    # and they are each position's argmax given the tokens before it (the Markov head conditions on them)
    with torch.no_grad():
        prev = torch.cat((anchors[:2, None], greedy.tokens[:, :-1]), dim=1)
        logits, _, _ = draft.position_logits(draft.base_logits(hidden[:2]), hidden[:2], prev, slice(None))
    assert torch.equal(logits.argmax(-1), greedy.tokens)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_teacher_forced_block_equals_the_sequential_stage(kind):
    """Training scores a whole block at once; drafting walks it left to right: the same numbers (every head type)."""
    draft = _with_markov(kind)
    cfg = draft.config
    with torch.no_grad():
        hidden, anchors = _hidden(draft)
        base = draft.base_logits(hidden)
        prev = torch.cat((anchors[:, None], torch.randint(0, 128, (3, cfg.block_size - 1))), dim=1)
        block_logits, block_conf, _ = draft.position_logits(base, hidden, prev, slice(None))
        state = None
        for k in range(cfg.block_size):
            logits, conf, state = draft.position_logits(base[:, k], hidden[:, k], prev[:, k], k, None, state)
            assert torch.allclose(logits, block_logits[:, k], atol=1e-5)
            assert torch.allclose(conf, block_conf[:, k], atol=1e-5)
    if kind == "rnn":  # the state carries: position 2 depends on the token two back
        other = prev.clone()
        other[:, 0] = (other[:, 0] + 1) % 128
        with torch.no_grad():
            changed, _, _ = draft.position_logits(base, hidden, other, slice(None))
        assert not torch.allclose(changed[:, 2], block_logits[:, 2])


def test_serving_binds_the_lm_head_in_the_drafts_dtype_and_training_shares_it():
    """A bf16 draft beside an fp32 target: serving drafts with a bf16 copy of the target's LM head (the block's
    small-M GEMM in the dtype the draft computes in); training keeps the target's own tensor, no copy."""
    cfg = shrink(seed_config("release"))
    draft = DSparkDraft(cfg).to(torch.bfloat16)
    embed = torch.nn.Embedding(cfg.backbone.vocab_size, cfg.backbone.hidden_size)
    head = torch.nn.Linear(cfg.backbone.hidden_size, cfg.backbone.vocab_size, bias=False)
    assert draft.bind_target(embed, head).lm_head is head
    served = draft.bind_target(embed, head, head_in_draft_dtype=True).lm_head
    assert served is not head and served.weight.dtype == torch.bfloat16
    assert torch.equal(served.weight, head.weight.detach().to(torch.bfloat16))
    assert not served.weight.requires_grad
    same = DSparkDraft(cfg).bind_target(embed, head, head_in_draft_dtype=True)  # fp32 draft: the shared tensor,
    assert same.lm_head.weight.data_ptr() == head.weight.data_ptr()  # no copy, read through the batch-invariant
    assert isinstance(same.lm_head, Linear)  # Linear (a row's logits do not depend on the rows beside it)
