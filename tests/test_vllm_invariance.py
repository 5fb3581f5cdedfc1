"""The bf16 shape invariance of vLLM's CPU path (``dspark/integrations/vllm_0_32/invariance.py``), kernel by kernel:
a row gets the same bits alone, inside a verified block, or beside other requests. (Served end to end through
vLLM with ``engine.vllm_exact``: ``benchmarks/exactness.py``.)"""

from __future__ import annotations

import torch

from dspark.integrations.vllm_0_32.invariance import RowPlan, attend_rows, invariant_linear

BLOCK, KV_HEADS, HEADS, DIM = 32, 3, 9, 64  # SmolLM2-135M's heads; the smallest CPU block


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
    """vLLM's paged cache (``[blocks, kv_heads, block, 2 * D]``, written by vLLM's own ``cpu_attn_reshape_and_cache``
    for the machine's ISA) holding each request's keys and values, its block table, and the keys and values."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.bfloat16, BLOCK, DIM)
    blocks = 1 + sum(-(-n // BLOCK) for n in lengths)
    cache = torch.zeros(blocks, KV_HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(blocks, KV_HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)
    width = max(-(-n // BLOCK) for n in lengths) + 2
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    next_block, kept = 1, []
    for r, n in enumerate(lengths):
        k = torch.randn(n, KV_HEADS, DIM, generator=generator).to(torch.bfloat16)
        v = torch.randn(n, KV_HEADS, DIM, generator=generator).to(torch.bfloat16)
        used = -(-n // BLOCK)
        table[r, :used] = torch.arange(next_block, next_block + used)
        slots = table[r].long().repeat_interleave(BLOCK)[:n] * BLOCK + torch.arange(n) % BLOCK
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
        next_block += used
        kept.append((k, v))
    return (key_cache, value_cache, isa), table, kept


def attend(cache, table, seq_lens: list[int], q_lens: list[int], query: torch.Tensor) -> torch.Tensor:
    key_cache, value_cache, isa = cache
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    out = torch.zeros(int(starts[-1]), HEADS, DIM, dtype=torch.bfloat16)
    plan = RowPlan(starts, torch.tensor(seq_lens, dtype=torch.int32), table)
    attend_rows(plan, query, key_cache, value_cache, out, DIM ** -0.5, isa)
    return out


def test_a_decode_row_equals_the_same_position_verified_in_a_block_beside_other_requests():
    g = torch.Generator().manual_seed(1)
    cache, table, kept = paged([100, 140], g)
    q = torch.randn(8, HEADS, DIM, generator=g).to(torch.bfloat16)  # queries at positions 92..99 of request 0
    block = attend(cache, table[:1], [100], [8], q)  # verified as one block of 8
    for i in range(8):  # each position decoded alone (keys up to it), and beside request 1's block of 5
        alone = attend(cache, table[:1], [93 + i], [1], q[i:i + 1])
        assert torch.equal(alone[0], block[i])
        other = torch.randn(5, HEADS, DIM, generator=g).to(torch.bfloat16)
        beside = attend(cache, table[[1, 0]], [140, 93 + i], [5, 1], torch.cat([other, q[i:i + 1]]))
        assert torch.equal(beside[5], block[i])
    # and it is causal attention: the row's result against an fp32 softmax over its visible keys
    keys, values = (t[:100].float().transpose(0, 1) for t in kept[0])  # [Hkv, 100, D]
    qh = q[7].float().view(KV_HEADS, HEADS // KV_HEADS, DIM)
    weights = torch.softmax(qh @ keys.transpose(1, 2) * DIM ** -0.5, dim=-1)
    assert torch.allclose(block[7].float().view(KV_HEADS, -1, DIM), weights @ values, atol=2e-2)
    first = attend(cache, table[:1], [100], [8], q)[0]  # position 92 sees 93 keys, not 100
    keys93, values93 = keys[:, :93], values[:, :93]
    w = torch.softmax(q[0].float().view(KV_HEADS, -1, DIM) @ keys93.transpose(1, 2) * DIM ** -0.5, dim=-1)
    assert torch.allclose(first.float().view(KV_HEADS, -1, DIM), w @ values93, atol=2e-2)
