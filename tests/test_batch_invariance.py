"""bf16 on the CPU: a position gets bit-identical logits whether decoded alone or verified in a block.

This is what makes speculative greedy output equal plain greedy output exactly in bf16 (fp32 CPU
GEMMs round differently by row count, so fp32 equality holds only up to near-ties).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.formats.target_checkpoint import load_target
from dspark.model.attention import chunked_attend
from dspark.model.layers import Linear
from dspark.testing import make_tiny_target

from conftest import stdlib_texts


def _block_inputs(seed: int, context: int, rows: int, heads: int = 6, kv_heads: int = 2):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, rows, heads, 64, generator=gen).bfloat16()  # [B, Q, H, D]
    k = torch.randn(2, context + rows, kv_heads, 64, generator=gen).bfloat16()  # [B, L, Hkv, D]
    v = torch.randn(2, context + rows, kv_heads, 64, generator=gen).bfloat16()
    mask = torch.zeros(2, rows, context + rows, dtype=torch.bool)  # causal over the block
    for j in range(rows):
        mask[:, j, : context + j + 1] = True
    mask[1, :, :5] = False  # a left-padded row
    return q, k, v, mask


@pytest.mark.parametrize("context", [3, 63, 64, 200, 700])
def test_chunked_attention_row_does_not_depend_on_block_or_extra_keys(context):
    q, k, v, mask = _block_inputs(context, context, rows=8)
    block = chunked_attend(q, k, v, mask, 0.125)  # [B, 8, H * D]
    gen = torch.Generator().manual_seed(1)
    for j in range(8):
        for extra in (0, 1, 70):  # keys after the row's own, masked: other drafts, padding, scratch
            seen = context + j + 1
            noise = torch.randn(2, extra, *k.shape[2:], generator=gen).bfloat16()
            row_mask = torch.zeros(2, 1, seen + extra, dtype=torch.bool)
            row_mask[:, 0, :seen] = mask[:, j, :seen]
            alone = chunked_attend(q[:, j:j + 1], torch.cat((k[:, :seen], noise), 1),
                                   torch.cat((v[:, :seen], noise), 1), row_mask, 0.125)
            assert torch.equal(alone[:, 0], block[:, j]), (j, extra)


def test_chunked_attention_matches_reference_attention():
    q, k, v, mask = _block_inputs(0, 300, rows=8)
    reference = F.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2),
        attn_mask=mask[:, None], scale=0.125, enable_gqa=True).transpose(1, 2).flatten(2)
    got = chunked_attend(q, k, v, mask, 0.125).float()
    assert (got - reference).abs().max().item() < 2e-2  # bf16 inputs and output, values O(1)
    single_head = chunked_attend(q[:, :1, :2], k[:, :301, :2], v[:, :301, :2], mask[:, :1, :301], 0.125)
    ref_single = F.scaled_dot_product_attention(
        q[:, :1, :2].float().transpose(1, 2), k[:, :301, :2].float().transpose(1, 2),
        v[:, :301, :2].float().transpose(1, 2), attn_mask=mask[:, None, :1, :301], scale=0.125
    ).transpose(1, 2).flatten(2)
    assert (single_head.float() - ref_single).abs().max().item() < 2e-2  # one query row, no GQA group


def test_linear_gives_a_single_row_its_batched_result():
    gen = torch.Generator().manual_seed(0)
    layer = Linear(1536, 576, bias=False).bfloat16()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(576, 1536, generator=gen) * 0.03)
        rows = torch.randn(1, 32, 1536, generator=gen).bfloat16()
        batched = layer(rows)
        alone = torch.cat([layer(rows[:, i:i + 1]) for i in range(32)], dim=1)
    assert alone.shape == batched.shape == (1, 32, 576)
    assert torch.equal(alone, batched)


def _logits(model, ids, steps):
    # ids: [1, T]; run the sequence through the cache in pieces of the given sizes
    cache = model.make_cache(512, 16)
    cache.allocator.reserve(0, ids.shape[1] + 8)
    out, start = [], 0
    for size in steps:
        meta = cache.allocator.metadata([0], [start], [size])
        out.append(model(ids[:, start:start + size], start + torch.arange(size)[None], cache, meta).logits)
        start += size
    return torch.cat(out, dim=1)


def test_bf16_target_decodes_a_position_exactly_as_it_verifies_it(tmp_path):
    path = make_tiny_target(tmp_path, stdlib_texts(10), model_type="llama", vocab_size=300)
    model = load_target(path, "bfloat16")
    ids = torch.randint(0, 300, (1, 110), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        verified = _logits(model, ids, [60, 8, 8, 34])  # prefill, two verify blocks, a long tail
        decoded = _logits(model, ids, [60] + [1] * 50)  # prefill, then one token at a time
        prefilled = _logits(model, ids, [110])
    assert torch.equal(verified, decoded)
    assert torch.equal(prefilled, decoded)


def test_bf16_draft_gives_a_row_the_same_block_alone_or_beside_others():
    """The DSpark head in bf16 (the served default's draft dtype on a CPU with native bf16): a request's drafted
    tokens, draft distributions and confidences do not depend on the rows drafted beside it or on their context
    lengths, over two rounds of its paged context cache. A seeded sampled request's draws then repeat whatever else
    the server is doing (its verification is the target's invariant pass)."""
    from dspark.decoding.drafter import DraftInputs, DSparkDrafter
    from dspark.decoding.sampling import SamplingTensors
    from dspark.formats.checkpoint import load_draft

    from conftest import embedded_exact

    cfg = embedded_exact()
    target = load_target(cfg.resolve(cfg.target.path), "bfloat16")
    draft = load_draft(cfg.resolve(cfg.draft.path), target.config, torch.bfloat16)
    draft.bind_target(target.embed_tokens, target.lm_head, head_in_draft_dtype=True)
    gen = torch.Generator().manual_seed(0)
    width = draft.fc.in_features
    rounds = [{0: 37, 1: 5, 2: 90, 3: 16}, {0: 3, 1: 8, 2: 1, 3: 6}]  # context rows committed before each draft
    features = [{r: torch.randn(n, width, generator=gen).bfloat16() for r, n in kept.items()} for kept in rounds]

    def run(ids: list[int]) -> list:
        drafter = DSparkDrafter(draft, 4096, 16, cfg.engine.draft_top_k, cfg.engine.block_size)
        seen = dict.fromkeys(ids, 0)
        generators = [torch.Generator().manual_seed(100 + r) for r in ids]
        out = []
        for kept, rows in zip(rounds, features):
            for r in ids:
                if not seen[r]:
                    drafter.start_sequence(r, 512)
                drafter.commit([r], [kept[r]], rows[r])
                seen[r] += kept[r]
            sampling = SamplingTensors(torch.ones(len(ids)), torch.full((len(ids),), 0.95),
                                       torch.zeros(len(ids), dtype=torch.long), generators)
            inputs = DraftInputs(ids, torch.tensor([200 + r for r in ids]), torch.tensor([seen[r] for r in ids]))
            out.append(drafter.draft(inputs, sampling))
        return out

    alone, beside = run([0]), run([1, 0, 2, 3])
    for a, b in zip(alone, beside):
        assert torch.equal(a.tokens[0], b.tokens[1])
        assert torch.equal(a.confidences[0], b.confidences[1])
        assert torch.equal(a.draft_probs.to_dense()[0], b.draft_probs.to_dense()[1])
