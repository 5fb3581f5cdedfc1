"""The bf16 shape invariance of vLLM's CPU path (``dspark/integrations/vllm_0_32/invariance.py``), kernel by kernel:
a row gets the same bits alone, inside a verified block, or beside other requests. (Served end to end through
vLLM with ``engine.vllm_exact``: ``benchmarks/exactness.py``.)"""

from __future__ import annotations

import torch

from dspark.integrations.vllm_0_32.invariance import _GroupPlan, invariant_linear

BLOCK, KV_HEADS, HEADS, DIM = 32, 3, 9, 64


def test_a_lone_row_gets_the_bits_it_gets_in_a_batch():
    torch.manual_seed(0)
    weight = torch.randn(1536, 576, dtype=torch.bfloat16)
    x = torch.randn(7, 576, dtype=torch.bfloat16)
    linear = invariant_linear(torch.nn.functional.linear, amx=False)
    batch = linear(x, weight, None)
    for i in range(len(x)):
        assert torch.equal(linear(x[i:i + 1], weight, None)[0], batch[i])
    amx = invariant_linear(torch.nn.functional.linear, amx=True)  # 32 rows at a time past 32
    big = torch.randn(70, 576, dtype=torch.bfloat16)
    assert torch.equal(amx(big, weight, None)[69], amx(big[69:], weight, None)[0])


def paged(lengths: list[int], generator: torch.Generator):
    """A zero-initialised paged cache ``[blocks, kv_heads, 2 * block, D]`` (as vLLM allocates it) holding each
    request's keys and values in our layout, its block table, and the keys and values themselves."""
    blocks = 1 + sum(-(-n // BLOCK) for n in lengths)
    cache = torch.zeros(blocks, KV_HEADS, 2 * BLOCK, DIM, dtype=torch.bfloat16)
    layout = cache.view(blocks, KV_HEADS, 2, BLOCK, DIM)
    width = max(-(-n // BLOCK) for n in lengths) + 2
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    next_block = 1
    for r, n in enumerate(lengths):
        k = torch.randn(n, KV_HEADS, DIM, generator=generator).to(torch.bfloat16)
        v = torch.randn(n, KV_HEADS, DIM, generator=generator).to(torch.bfloat16)
        for b in range(-(-n // BLOCK)):
            table[r, b] = next_block
            part = slice(b * BLOCK, min(n, (b + 1) * BLOCK))
            layout[next_block, :, 0, :part.stop - part.start] = k[part].transpose(0, 1)
            layout[next_block, :, 1, :part.stop - part.start] = v[part].transpose(0, 1)
            next_block += 1
    return cache, table


def attend(cache, table, seq_lens: list[int], q_lens: list[int], query: torch.Tensor) -> torch.Tensor:
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    out = torch.zeros(starts[-1], HEADS, DIM, dtype=torch.bfloat16)
    plan = _GroupPlan(list(range(len(q_lens))), starts, q_lens, seq_lens, table, BLOCK)
    plan.attend(query, cache.view(cache.shape[0], KV_HEADS, 2, BLOCK, DIM), out, HEADS, DIM ** -0.5)
    return out


def test_a_decode_row_equals_the_same_position_verified_in_a_block_beside_other_requests():
    g = torch.Generator().manual_seed(1)
    cache, table = paged([100, 140], g)
    q = torch.randn(8, HEADS, DIM, generator=g).to(torch.bfloat16)  # queries at positions 92..99 of request 0
    block = attend(cache, table[:1], [100], [8], q)  # verified as one block of 8
    for i in range(8):  # each position decoded alone (keys up to it), and beside request 1's block of 5
        alone = attend(cache, table[:1], [93 + i], [1], q[i:i + 1])
        assert torch.equal(alone[0], block[i])
        other = torch.randn(5, HEADS, DIM, generator=g).to(torch.bfloat16)
        beside = attend(cache, table, [93 + i, 140], [1, 5], torch.cat([q[i:i + 1], other]))
        assert torch.equal(beside[0], block[i])
    # and it is attention: the row's result against fp32 softmax over its visible keys
    layout = cache.view(cache.shape[0], KV_HEADS, 2, BLOCK, DIM)
    keys = torch.cat([layout[b, :, 0] for b in table[0, :4].tolist()], dim=1)[:, :100].float()  # [Hkv, 100, D]
    values = torch.cat([layout[b, :, 1] for b in table[0, :4].tolist()], dim=1)[:, :100].float()
    qh = q[7].float().view(KV_HEADS, HEADS // KV_HEADS, DIM)
    weights = torch.softmax(qh @ keys.transpose(1, 2) * DIM ** -0.5, dim=-1)
    assert torch.allclose(block[7].float().view(KV_HEADS, -1, DIM), weights @ values, atol=2e-2)
