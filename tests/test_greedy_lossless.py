"""Greedy speculative output equals the engine's own plain decoding, token for token."""

from __future__ import annotations

import pytest
import torch

from dspark.config import SamplingParams
from dspark.decoding.drafter import DSparkDrafter
from dspark.decoding.scheduler import StepCostProfile
from dspark.formats.checkpoint import load_draft
from dspark.model.draft_model import DraftProposal

from conftest import benchmark_prompts, make_engine

MAX_TOKENS = 64


class OracleDrafter:
    """Proposes the target's own greedy continuation (known from a plain-decoding run); with ``right``, only the
    first ``right`` tokens of each block are the target's (the rest are off by one token id)."""

    available = True

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab: int, block_size: int = 4,
                 right: int | None = None):
        self.references, self.vocab, self.block_size, self.right = references, vocab, block_size, right
        self.proposed = 0

    def can_start(self, request) -> bool:
        return True

    def start(self, request) -> None:
        pass

    def release(self, request) -> None:
        pass

    def commit(self, request_ids, kept, features) -> None:
        pass

    def result(self, handle: DraftProposal) -> DraftProposal:
        return handle

    def submit(self, requests, sampling) -> DraftProposal:
        rows = []
        for r in requests:
            ref = self.references[tuple(r.prompt_ids)]
            done = len(r.output_ids)
            nxt = ref[done: done + self.block_size]
            if self.right is not None:
                nxt = nxt[:self.right] + [(t + 1) % self.vocab for t in nxt[self.right:]]
            rows.append(nxt + [0] * (self.block_size - len(nxt)))
        tokens = torch.tensor(rows)
        self.proposed += tokens.numel()
        probs = torch.nn.functional.one_hot(tokens, self.vocab).float()
        return DraftProposal(tokens, probs, torch.ones(tokens.shape, dtype=torch.float32))


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = benchmark_prompts("humaneval", 20) + benchmark_prompts("mt-bench", 20)
    return [tiny_tokenizer.encode(t)[-200:] for t in texts]


@pytest.fixture(scope="module")
def reference(tiny_target, tiny_tokenizer, prompts):
    engine = make_engine(tiny_target, tiny_tokenizer, speculate=False)
    results = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    assert all(len(r.token_ids) == MAX_TOKENS for r in results)
    return [r.token_ids for r in results]


def _drafter(tiny_draft_dir, tiny_target, block_size=None):
    draft = load_draft(tiny_draft_dir, tiny_target.config, torch.float64)
    draft.bind_target(tiny_target.embed_tokens, tiny_target.lm_head)
    return DSparkDrafter(draft, 8192, 16, prefilter_k=0, block_size=block_size)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("scheduler", ["full", "confidence"])
def test_random_draft_head_is_lossless(tiny_target, tiny_tokenizer, tiny_draft_dir, prompts, reference, scheduler):
    engine = make_engine(tiny_target, tiny_tokenizer, _drafter(tiny_draft_dir, tiny_target), scheduler=scheduler,
                         profile=StepCostProfile((1, 8, 40), (0.010, 0.012, 0.030), 0.004))
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == reference
    # a random head: most drafts are rejected, so this exercises the correction path
    assert engine.metrics.num_drafts > 0
    assert engine.metrics.acceptance_length < 1.5


def test_oracle_drafter_accepts_everything_and_is_lossless(tiny_target, tiny_tokenizer, prompts, reference):
    oracle = OracleDrafter({tuple(p): ref for p, ref in zip(prompts, reference)}, tiny_target.config.vocab_size)
    engine = make_engine(tiny_target, tiny_tokenizer, oracle, scheduler="full")
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == reference
    m = engine.metrics
    # every verified draft token accepted: each full round commits block + 1 (bonus) tokens
    assert m.num_accepted_tokens == m.num_draft_tokens
    assert m.acceptance_length > 4.5
    assert m.accepted_per_pos[0] == m.num_drafts


@pytest.mark.parametrize("block_size", [1, 3])
def test_shorter_blocks_are_lossless(tiny_target, tiny_tokenizer, tiny_draft_dir, prompts, reference, block_size):
    engine = make_engine(tiny_target, tiny_tokenizer, _drafter(tiny_draft_dir, tiny_target, block_size),
                         scheduler="full")
    results = engine.generate(prompts[:10], GREEDY)
    assert [r.token_ids for r in results] == reference[:10]


def test_batch_composition_does_not_change_output(tiny_target, tiny_tokenizer, tiny_draft_dir, prompts, reference):
    """Requests arriving while others run (continuous batching) get the same tokens."""
    engine = make_engine(tiny_target, tiny_tokenizer, _drafter(tiny_draft_dir, tiny_target), scheduler="full",
                         max_num_seqs=3)
    ids = [engine.add_request(p, GREEDY) for p in prompts[:4]]
    engine.step()
    ids += [engine.add_request(p, GREEDY) for p in prompts[4:8]]
    while engine.has_unfinished():
        engine.step()
    assert [engine.result(i).token_ids for i in ids] == reference[:8]


GATE_PROFILE = StepCostProfile((1, 8, 40), (0.010, 0.012, 0.030), 0.004)


def test_gated_random_head_skips_drafts_and_stays_lossless(tiny_target, tiny_tokenizer, tiny_draft_dir, prompts,
                                                          reference):
    always = make_engine(tiny_target, tiny_tokenizer, _drafter(tiny_draft_dir, tiny_target), scheduler="full",
                         profile=GATE_PROFILE)
    gated = make_engine(tiny_target, tiny_tokenizer, _drafter(tiny_draft_dir, tiny_target), scheduler="full",
                        profile=GATE_PROFILE, draft_gate=True)
    # the tiny head drafts blocks of 4: a drafted round verifies 5 tokens (interpolated) after the draft
    assert gated.gate.break_even == pytest.approx((0.010 + 0.002 * 4 / 7 + 0.004) / 0.010 - 1)
    # continuous batching mixes drafted and held-back rows in one verify pass
    results = gated.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == reference
    always.generate(prompts, GREEDY)
    assert gated.metrics.draft_skips > 0 and always.metrics.draft_skips == 0
    assert gated.metrics.num_drafts < 0.7 * always.metrics.num_drafts
    # the pooled acceptance counts drafted rounds only, and held-back rounds are still verify steps
    assert gated.metrics.verify_steps >= always.metrics.verify_steps


def test_the_gate_holds_greedy_drafts_back_where_the_batch_makes_them_dear(tiny_target, tiny_tokenizer, prompts,
                                                                          reference):
    """A drafter whose blocks keep 2 tokens pays alone (bar 0.51) but not in a round of six (verifying 30 tokens
    costs 45 ms against 11 ms for 6: bar 3.29): decoding six together, greedy rows do not even probe while six run
    (a fully accepted block of 4 could not lift their record over 3.29), only as the batch thins; the same
    tokens."""
    steep = StepCostProfile((1, 8, 40), (0.010, 0.012, 0.060), 0.004)

    def run(batch):
        oracle = OracleDrafter({tuple(p): ref for p, ref in zip(prompts, reference)}, tiny_target.config.vocab_size,
                               right=2)
        engine = make_engine(tiny_target, tiny_tokenizer, oracle, scheduler="full", profile=steep, draft_gate=True)
        return [r.token_ids for r in engine.generate(batch, GREEDY)], engine.metrics, engine.gate

    together, batched, gate = run(prompts[:6])
    assert together == reference[:6]
    assert gate.at(1) < 2 < gate.at(6)
    alone_drafts = alone_skips = 0
    for prompt, expected in zip(prompts[:6], reference[:6]):
        tokens, metrics, _ = run([prompt])
        assert tokens == [expected]
        alone_drafts, alone_skips = alone_drafts + metrics.num_drafts, alone_skips + metrics.draft_skips
    assert alone_skips == 0 and batched.draft_skips > 0
    assert batched.num_drafts < 0.5 * alone_drafts


def test_gate_never_holds_back_an_accurate_drafter(tiny_target, tiny_tokenizer, prompts, reference):
    oracle = OracleDrafter({tuple(p): ref for p, ref in zip(prompts, reference)}, tiny_target.config.vocab_size)
    engine = make_engine(tiny_target, tiny_tokenizer, oracle, scheduler="full", profile=GATE_PROFILE, draft_gate=True)
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == reference
    assert engine.metrics.draft_skips == 0 and engine.metrics.acceptance_length > 4.5


def test_gated_sampling_uses_the_requests_generators(tiny_target, tiny_tokenizer, tiny_draft_dir, prompts):
    """Seeded sampled requests give the same tokens alone and in a batch, with the gate on: they are pinned
    (``SamplingParams.pinned``), so the gate weighs their own record against the fixed bar
    (``engine.pinned_break_even``), never the measured costs of their batch: at 0 it never holds them back, above
    what the head accepts it does, and either way each request's tokens are the same alone and in a batch. Their
    drafts are trimmed alone by the fixed cost model (``engine.pinned_token_cost``; 0: the full block), so trimmed
    they are the same alone and in a batch too."""
    params = SamplingParams(max_tokens=32, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)

    def run(batch, params=params, bar=0.0, cost=0.0, metrics=False):
        engine = make_engine(tiny_target, tiny_tokenizer, _drafter(tiny_draft_dir, tiny_target),
                             scheduler="confidence", profile=GATE_PROFILE, draft_gate=True, pinned_break_even=bar,
                             pinned_token_cost=cost)
        tokens = [r.token_ids for r in engine.generate(batch, params)]
        return (tokens, engine.metrics) if metrics else (tokens, engine.metrics.draft_skips)

    together, full = run(prompts[:6], metrics=True)
    alone = [run([p])[0][0] for p in prompts[:6]]
    assert full.draft_skips == 0 and together == alone
    trimmed, cut = run(prompts[:6], cost=0.2, metrics=True)
    assert cut.num_drafts > 0 and cut.num_draft_tokens / cut.num_drafts < full.num_draft_tokens / full.num_drafts
    assert trimmed == [run([p], cost=0.2)[0][0] for p in prompts[:6]]
    assert all(len(t) == 32 for t in together) and torch.tensor(together).unique().numel() > 20
    held_together, held_skips = run(prompts[:6], bar=1.5)
    assert held_skips > 0 and held_together == [run([p], bar=1.5)[0][0] for p in prompts[:6]]
    _, unseeded_skips = run(prompts[:6], SamplingParams(max_tokens=32, temperature=1.0, top_p=0.95, ignore_eos=True))
    assert unseeded_skips > 0  # the gate is on, and holds back these requests when they are not pinned


@pytest.mark.parametrize("layout", [{"sample_from_anchor": False}, {"draft_vocab_size": 200}],
                         ids=["bonus-anchor", "reduced-vocab"])
def test_reference_layout_heads_are_lossless(tiny_target, tiny_tokenizer, tiny_draft_dir, prompts, reference,
                                             layout):
    """Heads in the reference layouts (speculators' bonus-anchor blocks; a d2t reduced vocabulary) drive the engine
    losslessly too."""
    from dataclasses import replace

    from dspark.model.draft_model import DSparkDraft

    base = load_draft(tiny_draft_dir, tiny_target.config, torch.float64)
    draft = DSparkDraft(replace(base.config, **layout)).double()
    state = {k: v for k, v in base.state_dict().items() if k != "markov_head.markov_w2.weight" or
             not draft.config.reduced_vocab}
    missing = draft.load_state_dict(state, strict=False).missing_keys  # same layers, other layout
    if draft.config.reduced_vocab:  # the draft's own head over every other target id
        kept = torch.arange(0, 2 * draft.config.draft_vocab_size, 2)
        draft.d2t.copy_(kept - torch.arange(len(kept)))
        draft.t2d.zero_()[kept] = True
        with torch.no_grad():
            draft.own["lm_head"].weight.copy_(tiny_target.lm_head.weight[kept].double())
            draft.markov_head.markov_w2.weight.copy_(base.markov_head.markov_w2.weight[kept])
    assert set(missing) <= {"own.lm_head.weight", "d2t", "t2d", "markov_head.markov_w2.weight"}
    draft.bind_target(tiny_target.embed_tokens, tiny_target.lm_head)
    engine = make_engine(tiny_target, tiny_tokenizer, DSparkDrafter(draft, 8192, 16, prefilter_k=0),
                         scheduler="full")
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == reference
    assert engine.metrics.num_drafts > 0


@pytest.fixture(scope="module")
def echoing(tiny_target, tiny_tokenizer, prompts, reference) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts that restate themselves (a prompt, 24 tokens of its greedy continuation, its last 16 tokens again:
    prompt lookup finds the continuation) and their plain greedy outputs."""
    echo = [p + ref[:24] + p[-16:] for p, ref in zip(prompts[:12], reference)]
    plain = make_engine(tiny_target, tiny_tokenizer, speculate=False).generate(echo, GREEDY)
    return echo, [r.token_ids for r in plain]


@pytest.mark.parametrize("sources", ["lookup", "hybrid"])
def test_lookup_and_hybrid_drafts_are_lossless(tiny_target, tiny_tokenizer, tiny_draft_dir, echoing, sources):
    """The native engine drafting by prompt lookup (a one-point draft per matched continuation, no draft pass) or
    by the hybrid (lookup or the head per request and round, ``engine.draft_sources``): the same greedy tokens."""
    echo, expected = echoing
    engine = make_engine(tiny_target, tiny_tokenizer, _drafter(tiny_draft_dir, tiny_target), scheduler="confidence",
                         profile=GATE_PROFILE, draft_sources=sources)
    results = engine.generate(echo, GREEDY)
    assert [r.token_ids for r in results] == expected
    counts = engine.draft_sources
    assert counts["lookup"]["drafts"] > 0 and counts["lookup"]["accepted_tokens"] > 0, counts
    assert engine.metrics.lookup_drafts == counts["lookup"]["drafts"]
    assert (counts["head"]["drafts"] > 0) == (sources == "hybrid"), counts
