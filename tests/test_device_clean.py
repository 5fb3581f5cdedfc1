"""The verifier creates every tensor on the device of its inputs. PyTorch's ``meta`` device stands in for a second
device on a CPU-only machine: a tensor made on the CPU beside meta inputs raises, as it would beside CUDA ones.
(The rest of the library, the drafter and the target forward: issue 20, still open.)"""

from __future__ import annotations

import pytest
import torch

from dspark.sampling import sample_from
from dspark.verification import verify_block, verify_greedy, verify_tokenwise

B, G, V = 3, 4, 11


def inputs(device: str):
    torch.manual_seed(0)
    draft_tokens = torch.randint(0, V, (B, G))
    num_draft = torch.tensor([4, 2, 0])
    draft_probs = torch.softmax(torch.randn(B, G, V), -1)
    target_logits = torch.randn(B, G + 1, V)
    uniforms = torch.rand(B, G + 2)
    return [t.to(device) for t in (draft_tokens, num_draft, draft_probs, target_logits,
                                   torch.softmax(target_logits, -1), uniforms)]


@pytest.mark.parametrize("device", ["cpu", "meta"])
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
