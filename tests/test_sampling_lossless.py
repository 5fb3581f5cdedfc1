"""Sampled speculative decoding reproduces the target's distribution exactly.

A tiny-vocabulary target lets us enumerate the exact distribution of the first three output
tokens (temperature 1.0, top-p 0.95). Thousands of seeded requests through the speculative
engine are compared with it by a chi-square test, for token-wise and block verification,
with and without the confidence scheduler; a deliberately broken verifier must fail it.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

import dspark.decoding.engine as engine_module
import dspark.decoding.target_runner as target_runner
from dspark.config import DecoderConfig, SamplingParams
from dspark.decoding.drafter import DSparkDrafter
from dspark.decoding.kv_cache import PagedKVCache
from dspark.decoding.sampling import SamplingTensors, logits_to_probs, sample_from
from dspark.decoding.scheduler import StepCostProfile
from dspark.decoding.verification import VerifyResult, _pack, verify
from dspark.model.draft_model import DSparkDraft
from dspark.model.target_model import TargetModel
from dspark.testing import tiny_draft_config

from conftest import make_engine

VOCAB, STEPS, N = 6, 3, 6000
PROMPT = [1, 4, 2, 5]
# "0" recurs: from the first round lookup matches the last "0" (and after a sampled 3 or 2, "0 3" or "0 2") and
# drafts what followed; otherwise the head drafts
REPEATING = [4, 0, 3, 0, 2, 0]
PARAMS = SamplingParams(max_tokens=STEPS, temperature=1.0, top_p=0.95, ignore_eos=True)


@pytest.fixture(scope="module")
def target() -> TargetModel:
    cfg = DecoderConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, vocab_size=VOCAB)
    torch.manual_seed(0)
    model = TargetModel(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.5)
        model.lm_head.weight.mul_(1.5)  # peaky enough that top-p 0.95 removes tokens
    return model


@pytest.fixture(scope="module")
def exact(target) -> torch.Tensor:
    return enumerated(target, PROMPT)


@pytest.fixture(scope="module")
def exact_repeating(target) -> torch.Tensor:
    return enumerated(target, REPEATING)


def enumerated(target, prompt: list[int]) -> torch.Tensor:
    """P(x1, x2, x3 | prompt) under the processed target distribution, shape [V, V, V]."""
    seqs = [prompt + list(prefix) for prefix in itertools.product(range(VOCAB), repeat=STEPS - 1)]
    ids = torch.tensor(seqs)
    cache = PagedKVCache(2, 4096, 16, 2, 8, 8, torch.float64)
    for i in range(len(seqs)):
        cache.allocator.reserve(i, ids.shape[1])
    meta = cache.allocator.metadata(list(range(len(seqs))), [0] * len(seqs), [ids.shape[1]] * len(seqs))
    logits = target(ids, torch.arange(ids.shape[1])[None].expand(len(seqs), -1), cache, meta).logits
    params = SamplingTensors.build([PARAMS] * len(seqs) * 3, [])
    probs = logits_to_probs(logits[:, -STEPS:].flatten(0, 1), params).view(len(seqs), STEPS, VOCAB)
    # probs[s, k] is the distribution of token k+1 given PROMPT + seq prefix s (valid when it matches)
    joint = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for s, (a, b) in enumerate(itertools.product(range(VOCAB), repeat=2)):
        joint[a, b, :] = probs[s, 0, a] * probs[s, 1, b] * probs[s, 2, :]
    assert abs(joint.sum().item() - 1) < 1e-5
    assert (probs[:, 0] == 0).any(), "top-p must truncate something for the test to mean anything"
    return joint


def run_engine(target, verification: str, scheduler: str, layout: dict | None = None, prompt: list[int] = PROMPT,
               sources: str = "head", n: int = N) -> tuple[torch.Tensor, engine_module.Engine]:
    torch.manual_seed(1)
    cfg = tiny_draft_config(target.config, block_size=3, markov_rank=4, layer_ids=(0, 1))
    draft = DSparkDraft(replace(cfg, **(layout or {})))
    with torch.no_grad():
        draft.markov_head.markov_w2.weight.normal_(0, 1.0)  # the Markov bias must matter
        if draft.config.reduced_vocab:  # target ids 0, 2, 3, 5 only, through the draft's own LM head
            kept = torch.tensor([0, 2, 3, 5])
            draft.d2t.copy_(kept - torch.arange(4))
            draft.t2d.zero_()[kept] = True
            draft.own["lm_head"].weight.copy_(target.lm_head.weight[kept].float())
    draft = draft.double().bind_target(target.embed_tokens, target.lm_head)
    drafter = DSparkDrafter(draft, 200_000, 16, prefilter_k=0)
    # a cost table that makes verification expensive enough to truncate some blocks and not others
    profile = StepCostProfile((N, 2 * N, 3 * N, 4 * N), (1.0, 1.3, 1.9, 3.0))
    engine = make_engine(target, None, drafter, profile=profile, verification=verification, scheduler=scheduler,
                         max_num_seqs=n, kv_cache_tokens=200_000, draft_sources=sources)
    params = [SamplingParams(**{**PARAMS.__dict__, "seed": i}) for i in range(n)]
    results = engine.generate([prompt] * n, params)
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    for r in results:
        a, b, c = r.token_ids
        counts[a, b, c] += 1
    return counts, engine


def chi_square_p(counts: torch.Tensor, joint: torch.Tensor) -> float:
    expected = joint.flatten() / joint.sum() * counts.sum()  # float32 rounding: renormalise exactly
    observed = counts.flatten().double()
    small = expected < 5
    exp = torch.cat((expected[~small], expected[small].sum()[None]))
    obs = torch.cat((observed[~small], observed[small].sum()[None]))
    assert obs[-1] == 0 or exp[-1] > 0, "a token the target cannot produce was produced"
    if exp[-1] == 0:  # every rare outcome has probability 0 (top-p): no pooled bin
        exp, obs = exp[:-1], obs[:-1]
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize("verification", ["token", "block"])
@pytest.mark.parametrize("scheduler", ["full", "confidence"])
def test_output_distribution_equals_target(target, exact, verification, scheduler):
    counts, engine = run_engine(target, verification, scheduler)
    m = engine.metrics
    assert 0.1 < m.num_accepted_tokens / m.num_draft_tokens < 0.9, "need both accepts and rejects"
    if scheduler == "confidence":
        assert m.num_draft_tokens < m.num_drafted_tokens, "the scheduler must have trimmed some blocks"
    # impossible continuations (removed by top-p) never appear
    assert counts[exact == 0].sum() == 0
    assert chi_square_p(counts, exact) > 1e-3


def broken_verify(method, draft_tokens, num_draft, draft_probs, target_logits, target_probs, greedy, uniforms,
                  all_greedy=None):
    """The classic bug: on rejection, resample from the target instead of the residual."""
    block = draft_tokens.shape[1]
    ratio_ok = uniforms[:, :block] * draft_probs.gather(2, draft_tokens[:, :, None])[:, :, 0] < \
        target_probs[:, :block].gather(2, draft_tokens[:, :, None])[:, :, 0]
    ok = ratio_ok & (torch.arange(block)[None] < num_draft[:, None])
    accepted = ok.long().cumprod(1).sum(1)
    final = target_probs.gather(1, accepted[:, None, None].expand(-1, 1, target_probs.shape[-1]))[:, 0]
    return VerifyResult(*_pack(draft_tokens, accepted, sample_from(final, uniforms[:, -1])).__dict__.values())


def test_the_test_catches_a_broken_verifier(target, exact, monkeypatch):
    monkeypatch.setattr(target_runner, "verify", broken_verify)
    counts, _ = run_engine(target, "token", "full")
    assert chi_square_p(counts, exact) < 1e-6
    monkeypatch.setattr(target_runner, "verify", verify)


@pytest.mark.parametrize("layout", [{"sample_from_anchor": False}, {"draft_vocab_size": 4}],
                         ids=["bonus-anchor", "reduced-vocab"])
def test_reference_layouts_sample_the_target_distribution(target, exact, layout):
    """Heads in the reference layouts: speculators' bonus-anchor blocks, and a reduced vocabulary (d2t) that cannot
    propose two of the target's tokens -- the output is still exactly the target's distribution."""
    counts, engine = run_engine(target, "block", "full", layout)
    m = engine.metrics
    assert 0.1 < m.num_accepted_tokens / m.num_draft_tokens < 0.9, "need both accepts and rejects"
    assert counts[exact == 0].sum() == 0
    assert chi_square_p(counts, exact) > 1e-3


def test_lookup_drafts_keep_the_target_distribution(target, exact_repeating):
    """The native engine drafting by prompt lookup on a prompt where it matches: a lookup draft is a one-point
    distribution, verified by the same rejection sampler, and the output keeps the target's distribution. (Within
    three tokens the hybrid keeps the head's turn: a one-token lookup draft's prior, 0.7, is below the head's, 1.0;
    head and lookup rows sampled in one verify pass are checked on vLLM, ``tests/test_vllm_dspark.py``.)"""
    counts, engine = run_engine(target, "block", "confidence", prompt=REPEATING, sources="lookup")
    sources = engine.draft_sources
    assert sources["lookup"]["drafts"] > N / 4 and sources["head"]["drafts"] == 0, sources
    assert 0 < sources["lookup"]["accepted_tokens"] < sources["lookup"]["drafted_tokens"], sources
    assert engine.metrics.lookup_drafts == sources["lookup"]["drafts"]
    assert counts[exact_repeating == 0].sum() == 0
    assert chi_square_p(counts, exact_repeating) > 1e-3


def test_the_test_catches_lookup_drafts_verified_without_their_probability(target, exact_repeating, monkeypatch):
    """Lookup drafts reported as drawn from the uniform distribution (not the point they are): their tokens are
    accepted too often, and the test sees it."""
    proposal = engine_module.Engine._lookup_proposal

    def uniform(self, choices, requests):
        out = proposal(self, choices, requests)
        return replace(out, draft_probs=torch.full_like(out.draft_probs, 1.0 / VOCAB))

    monkeypatch.setattr(engine_module.Engine, "_lookup_proposal", uniform)
    counts, engine = run_engine(target, "block", "confidence", prompt=REPEATING, sources="lookup", n=N // 2)
    assert engine.draft_sources["lookup"]["drafts"] > N / 8
    assert chi_square_p(counts, exact_repeating) < 1e-6
