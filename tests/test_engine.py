"""Engine behaviour: stopping, streaming, aborts, mixed batches, metrics bookkeeping."""

from __future__ import annotations

import pytest
import torch

from dspark.config import SamplingParams
from dspark.decoding.drafter import DSparkDrafter
from dspark.formats.checkpoint import load_draft

from conftest import make_engine


@pytest.fixture
def drafter(tiny_draft_dir, tiny_target):
    draft = load_draft(tiny_draft_dir, tiny_target.config, torch.float64)
    return DSparkDrafter(draft.bind_target(tiny_target.embed_tokens, tiny_target.lm_head), 8192, 16, 0)


PROMPTS = ["def parse(line):", "import sys\n", "class Config:", "    return "]


def test_streamed_tokens_equal_the_final_result(tiny_target, tiny_tokenizer, drafter):
    engine = make_engine(tiny_target, tiny_tokenizer, drafter)
    ids = [engine.add_request(tiny_tokenizer.encode(p), SamplingParams(max_tokens=20, temperature=0.8, seed=i))
           for i, p in enumerate(PROMPTS)]
    streamed = {i: [] for i in ids}
    finished = set()
    for out in engine.stream():
        assert out.request_id not in finished, "no output after finish"
        streamed[out.request_id].extend(out.new_token_ids)
        if out.finished:
            finished.add(out.request_id)
    assert finished == set(ids)
    for i in ids:
        res = engine.result(i)
        assert streamed[i] == res.token_ids and len(res.token_ids) <= 20
        assert res.metrics.completion_tokens == len(res.token_ids)


def test_mixed_greedy_and_sampled_batch_keeps_greedy_exact(tiny_target, tiny_tokenizer, drafter):
    prompts = [tiny_tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = make_engine(tiny_target, tiny_tokenizer, speculate=False).generate(prompts, greedy)
    mixed = [greedy if i % 2 == 0 else SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=i)
             for i in range(len(prompts))]
    spec = make_engine(tiny_target, tiny_tokenizer, drafter).generate(prompts, mixed)
    for i in (0, 2):
        assert spec[i].token_ids == plain[i].token_ids


def test_seeded_sampling_is_reproducible(tiny_target, tiny_tokenizer, drafter):
    prompts = [tiny_tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=5)] * len(prompts)
    a = make_engine(tiny_target, tiny_tokenizer, drafter).generate(prompts, params)
    fresh = DSparkDrafter(drafter.model, 8192, 16, 0)
    b = make_engine(tiny_target, tiny_tokenizer, fresh).generate(prompts[::-1], params)  # other batch order
    assert [r.token_ids for r in a] == [r.token_ids for r in b][::-1]


def test_stop_strings_and_eos(tiny_target, tiny_tokenizer, drafter):
    prompt = tiny_tokenizer.encode(PROMPTS[0])
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = make_engine(tiny_target, tiny_tokenizer, drafter).generate([prompt], greedy)[0]
    stop_text = tiny_tokenizer.decode(full.token_ids[5:8])
    stop = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop_text,))
    res = make_engine(tiny_target, tiny_tokenizer, drafter).generate([prompt], stop)[0]
    assert res.finish_reason == "stop"
    assert res.token_ids == full.token_ids[: len(res.token_ids)] and len(res.token_ids) <= 8
    assert stop_text not in res.text
    engine = make_engine(tiny_target, tiny_tokenizer, drafter)
    engine.eos_ids = {full.token_ids[3]}
    res = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    assert res.finish_reason == "stop" and res.token_ids[-1] == full.token_ids[3] and len(res.token_ids) <= 4


def test_abort_and_finish_return_every_cache_block(tiny_target, tiny_tokenizer, drafter):
    engine = make_engine(tiny_target, tiny_tokenizer, drafter, max_num_seqs=2)
    free_target = engine.allocator.num_free_blocks
    free_draft = drafter.cache.allocator.num_free_blocks
    ids = [engine.add_request(tiny_tokenizer.encode(p), SamplingParams(max_tokens=30, temperature=0.7, seed=1))
           for p in PROMPTS]
    engine.step()
    engine.step()
    engine.abort(ids[0])  # running
    engine.abort(ids[3])  # still waiting
    for _ in engine.stream():
        pass
    assert engine.requests[ids[0]].finish_reason == "abort"
    assert engine.allocator.num_free_blocks == free_target
    assert drafter.cache.allocator.num_free_blocks == free_draft
    m = engine.metrics
    assert m.verify_steps >= m.num_drafts > 0 and m.num_accepted_tokens <= m.num_draft_tokens <= m.num_drafted_tokens
    assert sum(m.accepted_per_pos) == m.num_accepted_tokens


def test_plain_sampled_decoding_runs_and_reproduces(tiny_target, tiny_tokenizer):
    prompts = [tiny_tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True) for i in range(4)]
    a = make_engine(tiny_target, tiny_tokenizer, speculate=False).generate(prompts, params)
    b = make_engine(tiny_target, tiny_tokenizer, speculate=False).generate(prompts, params)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert all(len(r.token_ids) == 12 and r.metrics.verify_steps == 12 for r in a)
    assert len({tuple(r.token_ids) for r in a}) > 1
