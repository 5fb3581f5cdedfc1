"""The library creates every tensor on the device of its inputs. PyTorch's ``meta`` device stands in for a second
device on a CPU-only machine: a tensor made on the CPU beside meta inputs raises, as it would beside CUDA ones.

Covered: verification, sampling, drafting (both block layouts, a reduced vocabulary, greedy and sampled rows) and a
target verify pass (prefill and a drafted round) -- each run once on ``cpu`` (real answers) and once on ``meta``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dspark.config import DecoderConfig
from dspark.decoding.drafter import DraftInputs, DSparkDrafter
from dspark.decoding.sampling import SamplingTensors, logits_to_probs, sample_from
from dspark.decoding.target_runner import TargetRunner, VerifyBatch
from dspark.decoding.verification import verify_block, verify_greedy, verify_tokenwise
from dspark.model.draft_model import DSparkDraft
from dspark.model.target_model import TargetModel
from dspark.testing import tiny_draft_config

B, G, V = 3, 4, 11
DEVICES = ["cpu", "meta"]


def inputs(device: str):
    torch.manual_seed(0)
    draft_tokens = torch.randint(0, V, (B, G))
    num_draft = torch.tensor([4, 2, 0])
    draft_probs = torch.softmax(torch.randn(B, G, V), -1)
    target_logits = torch.randn(B, G + 1, V)
    uniforms = torch.rand(B, G + 2)
    return [t.to(device) for t in (draft_tokens, num_draft, draft_probs, target_logits,
                                   torch.softmax(target_logits, -1), uniforms)]


def sampling_rows(n: int) -> SamplingTensors:
    """Mixed rows: greedy, T=1 with top-p, T=0.7 with top-k (host tensors and generators, as the engine builds)."""
    temps, top_p, top_k = [0.0, 1.0, 0.7], [1.0, 0.9, 1.0], [0, 0, 5]
    rows = [i % 3 for i in range(n)]
    return SamplingTensors(torch.tensor([temps[i] for i in rows]), torch.tensor([top_p[i] for i in rows]),
                           torch.tensor([top_k[i] for i in rows]), [torch.Generator().manual_seed(i) for i in range(n)])


@pytest.mark.parametrize("device", DEVICES)
def test_verifiers_stay_on_the_device_of_their_inputs(device):
    draft_tokens, num_draft, draft_probs, target_logits, target_probs, uniforms = inputs(device)
    results = [verify_greedy(draft_tokens, num_draft, target_logits),
               verify_tokenwise(draft_tokens, num_draft, draft_probs, target_probs, uniforms[:, 1:]),
               verify_block(draft_tokens, num_draft, draft_probs, target_probs, uniforms)]
    for result in results:
        assert result.tokens.device.type == result.num_accepted.device.type == device
        assert result.tokens.shape == (B, G + 1) and result.num_accepted.shape == (B,)
    assert sample_from(target_probs[:, 0], uniforms[:, 0]).device.type == device
    if device == "cpu":  # the same functions give real answers there: rows with no draft accept nothing
        assert all(int(r.num_accepted[2]) == 0 for r in results)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_takes_host_parameters_to_the_logits_device(device):
    torch.manual_seed(1)
    logits = torch.randn(6, 50).to(device)
    params = sampling_rows(6)  # on the host, like the engine's
    probs = logits_to_probs(logits, params)
    tokens = sample_from(probs, params.uniforms(1)[:, 0])  # uniforms come from CPU generators
    assert probs.device.type == tokens.device.type == device and probs.shape == (6, 50)
    if device == "cpu":
        assert torch.allclose(probs.sum(-1), torch.ones(6))
        assert torch.equal(tokens[0::3], logits[0::3].argmax(-1))  # greedy rows take the argmax
        assert int((probs[2] > 0).sum()) <= 5  # top-k 5


def tiny_target_config() -> DecoderConfig:
    return DecoderConfig(hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                         head_dim=8, vocab_size=64)


def build_draft(target: TargetModel, device: str, **changes) -> DSparkDraft:
    torch.manual_seed(2)
    cfg = replace(tiny_draft_config(target.config, block_size=4, markov_rank=8), **changes)
    draft = DSparkDraft(cfg)
    if cfg.reduced_vocab:  # every other target id, as a d2t offset table
        kept = torch.arange(0, cfg.backbone.vocab_size, 2)[: cfg.draft_vocab_size]
        draft.d2t.copy_(kept - torch.arange(len(kept)))
        draft.t2d.zero_().index_fill_(0, kept, True)
    with torch.no_grad():  # a Markov head that is not zero, so its path is exercised
        draft.markov_head.markov_w2.weight.normal_(std=0.5)
    return draft.to(device).bind_target(target.embed_tokens, target.lm_head)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", [{}, {"sample_from_anchor": False}, {"draft_vocab_size": 20}])
def test_drafting_stays_on_the_device_of_the_head(device, layout):
    torch.manual_seed(3)
    target = TargetModel(tiny_target_config()).to(device)
    draft = build_draft(target, device, **layout)
    drafter = DSparkDrafter(draft, cache_tokens=128, kv_block_size=8, prefilter_k=0)
    context = 5
    for rid in range(3):
        drafter.start_sequence(rid, 32)
    features = torch.randn(3 * context, draft.fc.in_features).to(device)  # what a target pass sends
    drafter.commit([0, 1, 2], [context] * 3, features)
    inputs = DraftInputs([0, 1, 2], torch.tensor([7, 9, 11]), torch.tensor([context] * 3))
    proposal = drafter.draft(inputs, sampling_rows(3))
    for t in (proposal.tokens, proposal.draft_probs, proposal.confidences):
        assert t.device.type == device
    assert proposal.tokens.shape == (3, 4) and proposal.draft_probs.shape == (3, 4, 64)
    if device == "cpu":
        assert torch.allclose(proposal.draft_probs.sum(-1), torch.ones(3, 4))
        picked = proposal.draft_probs.gather(-1, proposal.tokens[..., None])[..., 0]
        assert bool((picked > 0).all())  # every drafted token has mass in the distribution it came from
        if draft.config.reduced_vocab:
            assert bool(draft.t2d[proposal.tokens].all())  # target ids the reduced vocabulary can emit


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("greedy", [True, False])
def test_a_target_verify_pass_stays_on_its_device(device, greedy):
    torch.manual_seed(4)
    target = TargetModel(tiny_target_config()).to(device)
    runner = TargetRunner(target, target.make_cache(128, 8), (0, 2), "block")
    alloc = runner.allocator
    for rid in (0, 1):
        alloc.reserve(rid, 32)
        alloc.grow(rid, 6)
    block = 3
    q = 3 + block  # 3 uncached committed tokens, then the drafted block
    meta = alloc.metadata([0, 1], [0, 0], [q, q], causal=True, device=device)
    sampling = sampling_rows(2) if not greedy else replace(sampling_rows(2), temperature=torch.zeros(2))
    batch = VerifyBatch(
        input_ids=torch.randint(0, 64, (2, q)), positions=torch.arange(q)[None].repeat(2, 1), meta=meta,
        logits_at=(2 + torch.arange(block + 1))[None].repeat(2, 1), num_uncached=torch.tensor([3, 3]),
        draft_tokens=torch.randint(0, 64, (2, block)), num_draft=torch.tensor([3, 1]),
        draft_probs=None if greedy else torch.softmax(torch.randn(2, block, 64), -1),
        sampling=SamplingTensors(sampling.temperature, sampling.top_p, sampling.top_k, []),
        uniforms=sampling.uniforms(block + 2), want_features=torch.tensor([True, True]), all_greedy=greedy,
    ).to(device)
    output = runner.run(batch)
    for t in (output.result.tokens, output.result.num_accepted, output.kept, output.features):
        assert t.device.type == device
    assert output.features.shape == (2, q, 2 * 32)
    if device == "cpu":
        assert bool((output.result.num_accepted <= batch.num_draft).all())
