"""The native target model against transformers' own implementation of the same checkpoint."""

from __future__ import annotations

import pytest
import torch
import transformers

from dspark.decoding.kv_cache import PagedKVCache
from dspark.formats.target_checkpoint import load_target
from dspark.testing import make_tiny_target

from conftest import stdlib_texts

TOLERANCE = 1e-4  # max |logit difference| in float32 (logits are O(1..10))


def run(model, cache: PagedKVCache, seq_id: int, ids: torch.Tensor, start: int):
    # ids: [1, Q] new tokens at positions start .. start + Q - 1
    meta = cache.allocator.metadata([seq_id], [start], [ids.shape[1]])
    positions = start + torch.arange(ids.shape[1])[None]
    return model(ids, positions, cache, meta, feature_layers=(0, 2)).logits


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers(tmp_path, model_type):
    path = make_tiny_target(tmp_path, stdlib_texts(10), model_type=model_type, vocab_size=300)
    ours = load_target(path, "float32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = theirs(ids).logits
    cache = ours.make_cache(256, 16)
    cache.allocator.reserve(0, 64)
    # prefill 30 tokens, then a 6-token "verify" step and a 4-token step on top of the cache
    got = torch.cat([run(ours, cache, 0, ids[:, :30], 0), run(ours, cache, 0, ids[:, 30:36], 30),
                     run(ours, cache, 0, ids[:, 36:], 36)], dim=1)
    assert (got - reference).abs().max().item() < TOLERANCE
    assert torch.equal(got.argmax(-1), reference.argmax(-1))


def test_batched_sequences_of_different_lengths_match_one_by_one(tiny_target):
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 500, (1, n), generator=gen) for n in (5, 17, 11)]
    cache = tiny_target.make_cache(1024, 16)
    singles = []
    for i, ids in enumerate(seqs):
        cache.allocator.reserve(i, 64)
        singles.append(run(tiny_target, cache, i, ids, 0)[0, -1])
    cache2 = tiny_target.make_cache(1024, 16)
    q = max(s.shape[1] for s in seqs)
    batch = torch.zeros(len(seqs), q, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : s.shape[1]] = s[0]
        cache2.allocator.reserve(i, 64)
    meta = cache2.allocator.metadata([0, 1, 2], [0, 0, 0], [s.shape[1] for s in seqs])
    last = torch.tensor([[s.shape[1] - 1] for s in seqs])
    out = tiny_target(batch, torch.arange(q)[None].expand(3, -1), cache2, meta, logits_at=last)
    for i in range(3):
        assert torch.allclose(out.logits[i, 0], singles[i], atol=1e-9)


def test_kv_cache_blocks_are_freed_and_rolled_back():
    cache = PagedKVCache(1, 64, 16, 1, 2, 2, torch.float32)
    alloc = cache.allocator
    start = alloc.num_free_blocks
    alloc.reserve(7, 40)
    assert alloc.num_free_blocks == start - 3  # reservation counts as used
    alloc.grow(7, 40)
    alloc.truncate(7, 17)
    assert len(alloc.tables[7]) == 2
    alloc.free(7)
    assert alloc.num_free_blocks == start
    with pytest.raises(Exception, match="KV blocks"):
        alloc.reserve(8, 10_000)


def test_rope_parameters_of_transformers_5_are_read():
    from dspark.config import DecoderConfig

    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 100}
    assert DecoderConfig.from_hf({**base, "rope_theta": 5e5}).rope.theta == 5e5
    new = DecoderConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e5}})
    assert new.rope.theta == 1e5 and new.rope.scaling_type is None
    yarn = DecoderConfig.from_hf({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e4, "factor": 32.0,
                                                               "original_max_position_embeddings": 4096}})
    assert (yarn.rope.theta, yarn.rope.scaling_type, yarn.rope.factor) == (5e4, "yarn", 32.0)
