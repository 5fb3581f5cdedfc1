"""The logits -> distribution transform: exact top-k / top-p, with and without the fast path."""

from __future__ import annotations

import pytest
import torch

import dspark.decoding.sampling as sampling
from dspark.decoding.sampling import SamplingTensors, logits_to_probs, sample_from


def params(n, temperature=1.0, top_p=1.0, top_k=0):
    generators = [torch.Generator().manual_seed(i) for i in range(n)]
    return SamplingTensors(torch.full((n,), temperature), torch.full((n,), top_p),
                           torch.full((n,), top_k, dtype=torch.long), generators)


def reference(logits, temperature, top_p, top_k):
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(-1, descending=True)
    sorted_p = probs.gather(-1, order)
    if top_k:
        sorted_p[:, top_k:] = 0
        sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    keep[:, 0] = True
    out = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return out / out.sum(-1, keepdim=True)


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(1.0, 0.95, 0), (0.7, 0.8, 0), (1.0, 1.0, 50),
                                                             (1.3, 0.9, 20), (1.0, 0.999999, 0)])
def test_matches_a_plain_full_sort(temperature, top_p, top_k):
    gen = torch.Generator().manual_seed(0)
    peaky = torch.randn(6, 5000, generator=gen) * 4  # the nucleus fits in the top 1024: fast path
    flat = torch.randn(6, 5000, generator=gen) * 0.1  # it does not: full sort
    for logits in (peaky, flat):
        got = logits_to_probs(logits, params(6, temperature, top_p, top_k))
        assert torch.allclose(got.double(), reference(logits, temperature, top_p, top_k), atol=1e-5)


def test_fast_path_is_taken_when_it_suffices(monkeypatch):
    calls = []
    original = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(1)) * 4
    logits_to_probs(logits, params(4, 1.0, 0.95))
    assert not calls
    logits_to_probs(logits * 0.01, params(4, 1.0, 0.95))
    assert calls
    assert sampling.NUCLEUS_CANDIDATES == 1024


def test_greedy_rows_are_one_hot_and_sampling_respects_support():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    p = params(2, 0.0)
    probs = logits_to_probs(logits, p)
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    draws = sample_from(torch.tensor([[0.0, 0.5, 0.0, 0.5]]).expand(1000, -1), torch.rand(1000))
    assert set(draws.tolist()) == {1, 3}
