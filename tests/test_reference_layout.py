"""A draft in the reference layout -- what speculators writes and vLLM 0.32 reads (``sample_from_anchor: false``,
``markov_head_type: "vanilla"``, a reduced vocabulary with ``d2t``/``t2d``, a ``mask_embedding`` tensor, a Qwen3
backbone with q/k norms) -- loads here and drafts exactly what a direct computation from the reference definition
gives. The reference below is written from vLLM's source, not from this library:

- ``vllm/model_executor/models/qwen3_dflash.py``: context K/V = k_proj/v_proj(hidden_norm(fc(aux states))) with
  k_norm and RoPE at the context positions; the block (anchor, then mask slots embedded as
  ``embed_tokens[mask_token_id]``) attends to context + block without a causal mask; ``is_neox_style`` picks the
  rotary layout.
- ``vllm/v1/worker/gpu/spec_decode/dspark/speculator.py``: with ``sample_from_anchor`` false the block has 1 + N slots
  and slots 1..N predict; tokens are sampled left to right with ``base_logits[i] + markov_w2 @ markov_w1[prev]``,
  ``prev`` starting at the anchor; draft ids map to target ids by ``id + d2t[id]``.
- ``vllm/model_executor/models/qwen3_dspark.py``: ``mask_embedding`` is an unused placeholder there; the confidence
  is ``sigmoid(proj([h; markov_w1[prev]]))``; a reduced vocabulary ships its own ``lm_head``.
- speculators ``models/dspark/model_definitions.py``: the gated and rnn Markov heads.
The same for vLLM's ``k3_dspark`` MLA layout at the end of the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dspark.decoding.drafter import DraftInputs, DSparkDrafter
from dspark.decoding.sampling import SamplingTensors
from dspark.formats.checkpoint import load_draft

V, VD, H, HEADS, KV_HEADS, D, R, N = 96, 40, 32, 4, 2, 8, 6, 3  # target vocab, draft vocab, ..., rank, tokens
TARGET_LAYERS, AUX_IDS = 6, [2, 4, 6]  # aux id i: the state entering target layer i
EPS, THETA, MASK = 1e-6, 10000.0, 95


def reference_checkpoint(path: Path, neox: bool, seed: int = 0, markov: str = "vanilla",
                         window: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.3):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * std

    kept = torch.randperm(V, generator=g)[:VD].sort().values  # the draft vocabulary, as target ids
    w = {
        "fc.weight": rnd(H, len(AUX_IDS) * H), "hidden_norm.weight": 1 + rnd(H, std=0.1),
        "norm.weight": 1 + rnd(H, std=0.1), "lm_head.weight": rnd(VD, H, std=1.0),
        "markov_head.markov_w1.weight": rnd(V, R, std=1.0), "markov_head.markov_w2.weight": rnd(VD, R, std=1.0),
        "confidence_head.proj.weight": rnd(1, H + R), "confidence_head.proj.bias": rnd(1),
        "d2t": kept - torch.arange(VD), "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, kept, True),
        "mask_embedding": rnd(H, std=1.0),  # vLLM ignores it; so must we
    }
    if markov == "gated":
        w["markov_head.gate_proj.weight"], w["markov_head.gate_proj.bias"] = rnd(R, H + R, std=1.0), rnd(R)
    elif markov == "rnn":
        w["markov_head.joint_proj.weight"] = rnd(3 * R, 2 * R + H, std=1.0)
        w["markov_head.joint_proj.bias"] = rnd(3 * R)
    for name, shape in (("q_proj", (HEADS * D, H)), ("k_proj", (KV_HEADS * D, H)), ("v_proj", (KV_HEADS * D, H)),
                        ("o_proj", (H, HEADS * D))):
        w[f"layers.0.self_attn.{name}.weight"] = rnd(*shape)
    w["layers.0.self_attn.q_norm.weight"] = 1 + rnd(D, std=0.1)
    w["layers.0.self_attn.k_norm.weight"] = 1 + rnd(D, std=0.1)
    w["layers.0.input_layernorm.weight"] = 1 + rnd(H, std=0.1)
    w["layers.0.post_attention_layernorm.weight"] = 1 + rnd(H, std=0.1)
    w["layers.0.mlp.gate_proj.weight"], w["layers.0.mlp.up_proj.weight"] = rnd(2 * H, H), rnd(2 * H, H)
    w["layers.0.mlp.down_proj.weight"] = rnd(H, 2 * H)
    config = {
        "architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark", "speculators_version": "0.9.0",
        "draft_vocab_size": VD, "target_hidden_size": H,
        "transformer_layer_config": {
            "model_type": "qwen3", "architectures": ["Qwen3DSparkModel"], "hidden_size": H, "intermediate_size": 2 * H,
            "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": D,
            "vocab_size": V, "rms_norm_eps": EPS, "rope_theta": THETA, "max_position_embeddings": 4096,
            "is_neox_style": neox,
            **({"layer_types": ["sliding_attention"], "sliding_window": window} if window else {}),
        },
        "speculators_config": {"algorithm": "dspark", "proposal_methods": [{"proposal_type": "dspark",
                                                                              "speculative_tokens": N}],
                               "verifier": {"name_or_path": "tiny", "architectures": ["Qwen3ForCausalLM"]}},
        "block_size": N + 1, "aux_hidden_state_layer_ids": AUX_IDS, "mask_token_id": MASK, "markov_rank": R,
        "markov_head_type": markov, "enable_confidence_head": True, "confidence_head_with_markov": True,
        "sample_from_anchor": False,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.float() if v.is_floating_point() else v for k, v in w.items()}, str(path / "model.safetensors"))
    return {k: v.float().double() if v.is_floating_point() else v for k, v in w.items()}


def rms(x, weight):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope(x, positions, neox):  # x: [T, heads, D]
    inv = 1.0 / THETA ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = positions.double()[:, None] * inv
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    if neox:  # rotate halves
        a, b = x[..., : D // 2], x[..., D // 2:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)
    a, b = x[..., 0::2], x[..., 1::2]  # GPT-J: rotate pairs (x0, x1), (x2, x3), ...
    return torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2)


def reference_block(w, embed, aux_states, anchor, neox, window=0):
    """The draft's N prediction hidden states for one sequence whose anchor sits right after ``aux_states``."""
    ctx = rms(aux_states @ w["fc.weight"].T, w["hidden_norm.weight"])  # [C, H]
    c = len(ctx)
    ids = torch.tensor([anchor] + [MASK] * N)
    x = embed[ids]  # [1 + N, H]: mask slots use the vocabulary row
    pos, ctx_pos = c + torch.arange(1 + N), torch.arange(c)
    p = "layers.0."
    h = rms(x, w[p + "input_layernorm.weight"])

    def heads(t, n):
        return t.view(len(t), n, D)

    q = rope(rms(heads(h @ w[p + "self_attn.q_proj.weight"].T, HEADS), w[p + "self_attn.q_norm.weight"]), pos, neox)
    k_of = lambda s, at: rope(rms(heads(s @ w[p + "self_attn.k_proj.weight"].T, KV_HEADS),  # noqa: E731
                                  w[p + "self_attn.k_norm.weight"]), at, neox)
    keys = torch.cat((k_of(ctx, ctx_pos), k_of(h, pos)))
    values = heads(torch.cat((ctx, h)) @ w[p + "self_attn.v_proj.weight"].T, KV_HEADS)
    keys, values = keys.repeat_interleave(HEADS // KV_HEADS, 1), values.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) / D**0.5  # full attention: no causal mask
    if window:  # a sliding layer (qwen3_dflash.py _resolve_layer_attention): windowed, and causal in the block
        key_pos = torch.cat((ctx_pos, pos))
        allowed = (pos[:, None] - key_pos[None, :] < window) & (key_pos[None, :] <= pos[:, None])
        scores = scores.masked_fill(~allowed, float("-inf"))
    att = torch.softmax(scores, -1)
    x = x + torch.einsum("hqk,khd->qhd", att, values).flatten(1) @ w[p + "self_attn.o_proj.weight"].T
    h = rms(x, w[p + "post_attention_layernorm.weight"])
    x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ \
        w[p + "mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"])[1:]  # slots 1..N predict (the anchor is a bonus token)


def reference_sequential(w, hidden, anchor, prevs=None):
    """Left-to-right stage; greedy when ``prevs`` is None, else teacher-forced on the given target ids."""
    base = hidden @ w["lm_head.weight"].T  # [N, VD]
    prev, tokens, probs, conf = anchor, [], [], []
    state = torch.zeros(R, dtype=torch.float64)
    for i in range(N):
        e = w["markov_head.markov_w1.weight"][prev]
        mixed = e  # vanilla; speculators' models/dspark/model_definitions.py for gated and rnn
        if "markov_head.gate_proj.weight" in w:
            mixed = torch.sigmoid(w["markov_head.gate_proj.weight"] @ torch.cat((hidden[i], e))
                                  + w["markov_head.gate_proj.bias"]) * e
        elif "markov_head.joint_proj.weight" in w:
            a, c, o = (w["markov_head.joint_proj.weight"] @ torch.cat((state, e, hidden[i]))
                       + w["markov_head.joint_proj.bias"]).chunk(3)
            state = torch.sigmoid(a) * state + (1 - torch.sigmoid(a)) * torch.tanh(c)
            mixed = torch.tanh(o)
        logits = base[i] + w["markov_head.markov_w2.weight"] @ mixed
        conf.append(torch.sigmoid(w["confidence_head.proj.weight"][0] @ torch.cat((hidden[i], e))
                                  + w["confidence_head.proj.bias"][0]))
        p_draft = torch.softmax(logits, -1)
        probs.append(torch.zeros(V, dtype=torch.float64).index_copy_(0, torch.arange(VD) + w["d2t"], p_draft))
        choice = int(logits.argmax())
        target_id = choice + int(w["d2t"][choice])
        prev = target_id if prevs is None else int(prevs[i])
        tokens.append(target_id)
    return torch.tensor(tokens), torch.stack(probs), torch.stack(conf)


@pytest.mark.parametrize(("neox", "markov", "window"), [(True, "vanilla", 0), (False, "vanilla", 0),
                                                       (True, "gated", 0), (True, "rnn", 0), (True, "vanilla", 4)])
def test_a_reference_layout_draft_drafts_what_the_reference_definition_gives(tmp_path, neox, markov, window):
    weights = reference_checkpoint(tmp_path / "ref", neox, markov=markov, window=window)
    draft = load_draft(tmp_path / "ref", dtype=torch.float64)
    cfg = draft.config
    assert (cfg.block_size, cfg.num_slots, cfg.sample_from_anchor) == (N, N + 1, False)
    assert cfg.target_layer_ids == tuple(i - 1 for i in AUX_IDS) and cfg.output_vocab_size == VD
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(V, H, generator=g, dtype=torch.float64)
    lm_head_target = torch.nn.Linear(H, V, bias=False).double()  # never used: the reduced head is the draft's own
    draft.bind_target(torch.nn.Embedding.from_pretrained(embed), lm_head_target)
    drafter = DSparkDrafter(draft, cache_tokens=64, kv_block_size=8, prefilter_k=0)
    contexts = [torch.randn(n, len(AUX_IDS) * H, generator=g, dtype=torch.float64) for n in (5, 9)]
    anchors = [7, 61]
    for rid, feats in enumerate(contexts):
        drafter.start_sequence(rid, 32)
        drafter.commit([rid], [len(feats)], feats)
    inputs = DraftInputs([0, 1], torch.tensor(anchors), torch.tensor([len(f) for f in contexts]))
    greedy = SamplingTensors(torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.long),
                             [torch.Generator().manual_seed(i) for i in range(2)])
    proposal = drafter.draft(inputs, greedy)
    for b, (feats, anchor) in enumerate(zip(contexts, anchors)):
        hidden = reference_block(weights, embed, feats, anchor, neox, window)
        tokens, _, conf = reference_sequential(weights, hidden, anchor)
        assert proposal.tokens[b].tolist() == tokens.tolist()
        assert torch.allclose(proposal.confidences[b].double(), conf, atol=1e-6)  # float32, as vLLM computes it

    # sampled at T=1: the draft distributions equal the reference's, teacher-forced on the drafted tokens
    for rid in (0, 1):
        drafter.release_sequence(rid)
        drafter.start_sequence(rid, 32)
        drafter.commit([rid], [len(contexts[rid])], contexts[rid])
    sampled = SamplingTensors(torch.ones(2), torch.ones(2), torch.zeros(2, dtype=torch.long),
                              [torch.Generator().manual_seed(10 + i) for i in range(2)])
    proposal = drafter.draft(inputs, sampled)
    for b, (feats, anchor) in enumerate(zip(contexts, anchors)):
        hidden = reference_block(weights, embed, feats, anchor, neox, window)
        _, probs, _ = reference_sequential(weights, hidden, anchor, prevs=proposal.tokens[b])
        assert torch.allclose(proposal.draft_probs[b].double(), probs, atol=1e-6)  # sampled in float32
        assert bool(weights["t2d"][proposal.tokens[b]].all())


def test_a_reference_layout_draft_round_trips_through_our_writer(tmp_path):
    from dspark.formats.checkpoint import save_draft

    reference_checkpoint(tmp_path / "ref", neox=False)
    draft = load_draft(tmp_path / "ref", dtype=torch.float64)
    save_draft(draft, tmp_path / "again")
    written = json.loads((tmp_path / "again" / "config.json").read_text())
    original = json.loads((tmp_path / "ref" / "config.json").read_text())
    for key in ("block_size", "aux_hidden_state_layer_ids", "mask_token_id", "markov_rank", "markov_head_type",
                "draft_vocab_size", "sample_from_anchor", "confidence_head_with_markov"):
        assert written[key] == original[key], key
    assert written["transformer_layer_config"]["is_neox_style"] is False
    assert written["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == N
    again = load_draft(tmp_path / "again", dtype=torch.float64)
    for name, tensor in draft.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


# vLLM's k3_dspark (vllm/transformers_utils/configs/k3_dspark.py, vllm/models/kimi_k3/nvidia/dspark_mla.py):
# context = context_norm(context_proj(states)) goes straight into each layer's kv_a_proj_with_mqa + kv_a_layernorm
# (latent) and interleaved RoPE (key rope part); the block (anchor + N-1 masks, the target's embedding) runs MLA
# non-causally over context + block, scale (nope + rope)^-0.5; logits = target lm_head(final_norm(h)) + Markov bias.
K3 = {"H": 32, "heads": 4, "q_lora": 12, "kv_lora": 8, "nope": 8, "rope": 4, "v": 8, "inter": 48, "r": 6, "N": 4}


def k3_checkpoint(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c = K3

    def rnd(*shape, std=0.3):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * std

    w = {"context_proj.weight": rnd(c["H"], len(AUX_IDS) * c["H"]), "context_norm.weight": 1 + rnd(c["H"], std=0.1),
         "final_norm.weight": 1 + rnd(c["H"], std=0.1),
         "markov_head.markov_w1.weight": rnd(V, c["r"], std=1.0),
         "markov_head.markov_w2.weight": rnd(V, c["r"], std=1.0),
         "confidence_head.proj.weight": rnd(1, c["H"] + c["r"]), "confidence_head.proj.bias": rnd(1)}
    p = "layers.0."
    w[p + "input_layernorm.weight"] = 1 + rnd(c["H"], std=0.1)
    w[p + "post_attention_layernorm.weight"] = 1 + rnd(c["H"], std=0.1)
    w[p + "self_attn.q_a_proj.weight"] = rnd(c["q_lora"], c["H"])
    w[p + "self_attn.q_a_layernorm.weight"] = 1 + rnd(c["q_lora"], std=0.1)
    w[p + "self_attn.q_b_proj.weight"] = rnd(c["heads"] * (c["nope"] + c["rope"]), c["q_lora"])
    w[p + "self_attn.kv_a_proj_with_mqa.weight"] = rnd(c["kv_lora"] + c["rope"], c["H"])
    w[p + "self_attn.kv_a_layernorm.weight"] = 1 + rnd(c["kv_lora"], std=0.1)
    w[p + "self_attn.kv_b_proj.weight"] = rnd(c["heads"] * (c["nope"] + c["v"]), c["kv_lora"])
    w[p + "self_attn.o_proj.weight"] = rnd(c["H"], c["heads"] * c["v"])
    w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = rnd(c["inter"], c["H"]), rnd(c["inter"], c["H"])
    w[p + "mlp.down_proj.weight"] = rnd(c["H"], c["inter"])
    config = {"architectures": ["K3DSparkModel"], "model_type": "k3_dspark", "hidden_size": c["H"],
              "intermediate_size": c["inter"], "num_hidden_layers": 1, "num_attention_heads": c["heads"],
              "num_key_value_heads": c["heads"], "q_lora_rank": c["q_lora"], "kv_lora_rank": c["kv_lora"],
              "qk_nope_head_dim": c["nope"], "qk_rope_head_dim": c["rope"], "v_head_dim": c["v"], "vocab_size": V,
              "rms_norm_eps": EPS, "max_position_embeddings": 4096,
              "rope_parameters": {"rope_type": "default", "rope_theta": THETA},
              "target_layer_ids": [i - 1 for i in AUX_IDS], "num_target_layers": len(AUX_IDS),
              "target_hidden_size": c["H"], "block_size": c["N"], "mask_token_id": MASK, "markov_rank": c["r"],
              "enable_confidence_head": True, "confidence_head_with_markov": True}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.float() for k, v in w.items()}, str(path / "model.safetensors"))
    return {k: v.float().double() for k, v in w.items()}


def rope_interleaved(x, positions, dim):  # x: [T, ..., dim], GPT-J pairs (vLLM is_neox_style=False)
    inv = 1.0 / THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angle = positions.double()[:, None] * inv
    shape = (len(positions),) + (1,) * (x.dim() - 2) + (dim // 2,)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2)


def k3_reference_block(w, embed, aux_states, anchor):
    c, p = K3, "layers.0.self_attn."
    ctx = rms(aux_states @ w["context_proj.weight"].T, w["context_norm.weight"])
    n_ctx = len(ctx)
    x = embed[torch.tensor([anchor] + [MASK] * (c["N"] - 1))]
    pos, ctx_pos = n_ctx + torch.arange(c["N"]), torch.arange(n_ctx)
    h = rms(x, w["layers.0.input_layernorm.weight"])

    def latent(s, at):  # the cached latent: normalised c, rotated shared rope key
        kv = s @ w[p + "kv_a_proj_with_mqa.weight"].T
        return rms(kv[:, : c["kv_lora"]], w[p + "kv_a_layernorm.weight"]), rope_interleaved(kv[:, c["kv_lora"]:], at,
                                                                                              c["rope"])

    lat = [latent(ctx, ctx_pos), latent(h, pos)]
    comp, k_pe = torch.cat([lat[0][0], lat[1][0]]), torch.cat([lat[0][1], lat[1][1]])  # [C+N, kv_lora], [C+N, rope]
    kv = (comp @ w[p + "kv_b_proj.weight"].T).view(len(comp), c["heads"], c["nope"] + c["v"])
    k_nope, values = kv[..., : c["nope"]], kv[..., c["nope"]:]
    q = rms(h @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"]) @ w[p + "q_b_proj.weight"].T
    q = q.view(c["N"], c["heads"], c["nope"] + c["rope"])
    q_nope, q_pe = q[..., : c["nope"]], rope_interleaved(q[..., c["nope"]:], pos, c["rope"])
    scores = (torch.einsum("qhd,khd->hqk", q_nope, k_nope) + torch.einsum("qhd,kd->hqk", q_pe, k_pe)) \
        * (c["nope"] + c["rope"]) ** -0.5  # no causal mask: the block sees all of itself
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values).flatten(1)
    x = x + out @ w[p + "o_proj.weight"].T
    h = rms(x, w["layers.0.post_attention_layernorm.weight"])
    x = x + (F.silu(h @ w["layers.0.mlp.gate_proj.weight"].T) * (h @ w["layers.0.mlp.up_proj.weight"].T)) \
        @ w["layers.0.mlp.down_proj.weight"].T
    return rms(x, w["final_norm.weight"])  # every slot predicts (anchor-as-first)


def test_a_k3_dspark_draft_drafts_what_the_reference_definition_gives(tmp_path):
    weights = k3_checkpoint(tmp_path / "k3")
    draft = load_draft(tmp_path / "k3", dtype=torch.float64)
    assert draft.config.backbone.attention == "mla" and draft.config.target_layer_ids == tuple(i - 1 for i in AUX_IDS)
    g = torch.Generator().manual_seed(3)
    embed = torch.randn(V, K3["H"], generator=g, dtype=torch.float64)
    lm_head = torch.nn.Linear(K3["H"], V, bias=False).double()
    with torch.no_grad():
        lm_head.weight.normal_(0, 1.0, generator=g)
    draft.bind_target(torch.nn.Embedding.from_pretrained(embed), lm_head)
    drafter = DSparkDrafter(draft, cache_tokens=64, kv_block_size=8, prefilter_k=0)
    contexts = [torch.randn(n, len(AUX_IDS) * K3["H"], generator=g, dtype=torch.float64) for n in (6, 3)]
    anchors = [12, 80]
    for rid, feats in enumerate(contexts):
        drafter.start_sequence(rid, 32)
        drafter.commit([rid], [len(feats)], feats)
    greedy = SamplingTensors(torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.long),
                             [torch.Generator().manual_seed(i) for i in range(2)])
    proposal = drafter.draft(DraftInputs([0, 1], torch.tensor(anchors), torch.tensor([6, 3])), greedy)
    for b, (feats, anchor) in enumerate(zip(contexts, anchors)):
        hidden = k3_reference_block(weights, embed, feats, anchor)
        prev, tokens = anchor, []
        for i in range(K3["N"]):  # greedy, left to right, the shared (full) vocabulary
            logits = lm_head.weight @ hidden[i] + weights["markov_head.markov_w2.weight"] @ \
                weights["markov_head.markov_w1.weight"][prev]
            prev = int(logits.argmax())
            tokens.append(prev)
        assert proposal.tokens[b].tolist() == tokens
