"""The verifier on hand-built distributions, and Algorithm 1 on hand-built confidences."""

from __future__ import annotations

import pytest
import torch

from dspark.decoding.scheduler import StepCostProfile, schedule_alone, schedule_prefix
from dspark.decoding.verification import verify, verify_block, verify_greedy, verify_tokenwise

V = 4


def dist(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def uniforms(*values):
    return torch.tensor([values], dtype=torch.float32)


@pytest.mark.parametrize("method", [verify_tokenwise, verify_block])
def test_perfect_match_accepts_all_and_samples_bonus(method):
    draft_probs = dist([0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25])[None]  # [1, 2, V]
    bonus = [0.0, 0.0, 1.0, 0.0]
    target_probs = torch.cat((draft_probs[0], dist(bonus)))[None]  # [1, 3, V]
    tokens = torch.tensor([[3, 1]])
    u = uniforms(0.99, 0.99, 0.99, 0.5) if method is verify_block else uniforms(0.99, 0.99, 0.5)
    res = method(tokens, torch.tensor([2]), draft_probs, target_probs, u)
    assert res.num_accepted.tolist() == [2]
    assert res.tokens.tolist() == [[3, 1, 2]]  # bonus from target row 2 (all mass on token 2)


def test_tokenwise_early_mismatch_resamples_from_residual():
    draft_probs = dist([0.0, 1.0, 0.0, 0.0], [0.25] * 4)[None]
    target_probs = dist([0.5, 0.0, 0.5, 0.0], [0.25] * 4, [0.25] * 4)[None]
    # target(1) = 0: token 1 is rejected whatever the draw; residual = max(t - d, 0) = {0: .5, 2: .5}
    res = verify_tokenwise(torch.tensor([[1, 0]]), torch.tensor([2]), draft_probs, target_probs, uniforms(0, 0, 0.9))
    assert res.num_accepted.tolist() == [0]
    assert res.tokens.tolist() == [[2, -1, -1]]


def test_tokenwise_acceptance_uses_the_ratio():
    draft_probs = dist([0.0, 0.8, 0.2, 0.0])[None]
    target_probs = dist([0.0, 0.4, 0.6, 0.0], [1.0, 0, 0, 0])[None]
    # ratio target/draft for token 1 = 0.5: accepted iff u < 0.5
    acc = verify_tokenwise(torch.tensor([[1]]), torch.tensor([1]), draft_probs, target_probs, uniforms(0.49, 0.0))
    rej = verify_tokenwise(torch.tensor([[1]]), torch.tensor([1]), draft_probs, target_probs, uniforms(0.51, 0.0))
    assert acc.tokens.tolist() == [[1, 0]]
    assert rej.tokens.tolist() == [[2, -1]]  # residual: only token 2 has target > draft


@pytest.mark.parametrize("method", [verify_tokenwise, verify_block])
def test_empty_draft_samples_from_target(method):
    draft_probs = torch.zeros(1, 2, V)
    target_probs = dist([0, 0, 0, 1.0], [1.0, 0, 0, 0], [1.0, 0, 0, 0])[None]
    u = uniforms(0.3, 0.3, 0.3, 0.3) if method is verify_block else uniforms(0.3, 0.3, 0.3)
    res = method(torch.tensor([[0, 0]]), torch.tensor([0]), draft_probs, target_probs, u)
    assert res.num_accepted.tolist() == [0]
    assert res.tokens.tolist() == [[3, -1, -1]]


@pytest.mark.parametrize("method", [verify_tokenwise, verify_block])
def test_zero_width_block_is_plain_sampling(method):
    """No drafter at all (G = 0): the verifier samples the next token from the target."""
    target_probs = dist([0, 0, 1.0, 0], [0, 1.0, 0, 0])[:, None, :]  # [2, 1, V]
    u = torch.full((2, 2 if method is verify_block else 1), 0.5)
    res = method(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long), torch.zeros(2, 0, V),
                 target_probs, u)
    assert res.tokens.tolist() == [[2], [1]] and res.num_accepted.tolist() == [0, 0]


def test_block_verification_recovers_a_token_tokenwise_rejects():
    # Sun et al.'s motivating case: token-wise rejects x1, block verification may still keep it
    draft_probs = dist([0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0])[None]
    target_probs = dist([0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [1.0, 0, 0, 0])[None]
    tokens = torch.tensor([[1, 2]])
    tw = verify_tokenwise(tokens, torch.tensor([2]), draft_probs, target_probs, uniforms(0.7, 0.0, 0.0))
    assert tw.num_accepted.tolist() == [0]
    # p1 = 0.5, p2 = min(1, 0.5 * 1/1) = 0.5; h2 = p2 = 0.5: eta_2 = 0.4 <= 0.5 keeps both tokens
    bv = verify_block(tokens, torch.tensor([2]), draft_probs, target_probs, uniforms(0.0, 0.7, 0.4, 0.0))
    assert bv.num_accepted.tolist() == [2]
    assert bv.tokens.tolist() == [[1, 2, 0]]


def test_greedy_ties_and_mismatch():
    logits = torch.tensor([[[1.0, 3.0, 3.0, 0.0],  # tie: argmax takes the first, token 1
                            [0.0, 0.0, 0.0, 5.0],
                            [2.0, 0.0, 0.0, 0.0]]])
    res = verify_greedy(torch.tensor([[1, 2]]), torch.tensor([2]), logits)
    assert res.tokens.tolist() == [[1, 3, -1]]  # 1 accepted, 2 != argmax 3 -> correction 3
    res = verify_greedy(torch.tensor([[2, 3]]), torch.tensor([2]), logits)
    assert res.tokens.tolist() == [[1, -1, -1]]  # tie resolved to the first index, draft 2 rejected
    res = verify_greedy(torch.tensor([[1, 3]]), torch.tensor([2]), logits)
    assert res.tokens.tolist() == [[1, 3, 0]]  # all accepted, bonus argmax 0


def test_mixed_batch_keeps_rows_independent():
    draft_probs = dist([0, 1.0, 0, 0])[None].expand(2, -1, -1)
    target_probs = dist([0, 1.0, 0, 0], [0, 0, 1.0, 0])[None].expand(2, -1, -1)
    logits = torch.log(target_probs.clamp_min(1e-9))
    res = verify("block", torch.tensor([[1], [1]]), torch.tensor([1, 0]), draft_probs, logits, target_probs,
                 torch.tensor([True, False]), torch.full((2, 3), 0.5))
    assert res.tokens.tolist() == [[1, 2], [1, -1]]
    assert res.num_accepted.tolist() == [1, 0]


def test_scheduler_stops_at_first_non_improvement():
    # the paper's Appendix A numbers: SPS(1)=1, SPS(2)=0.5, SPS(3)=0.45, a1 = 0.8, c2 = 0.9
    profile = StepCostProfile((1, 2, 3), (1.0, 2.0, 1 / 0.45))
    lengths = schedule_prefix(torch.tensor([[0.8, 0.9]]), profile, torch.tensor([2]))
    assert lengths.tolist() == [0]  # theta_1 = 0.9 < theta_0 = 1.0: stop, even though theta_2 = 1.134


def test_scheduler_admits_by_survival_across_requests():
    flat = StepCostProfile((1, 64), (1.0, 1.0 + 1e-6))
    conf = torch.tensor([[0.9, 0.9, 0.1], [0.5, 0.9, 0.9]])
    assert schedule_prefix(conf, flat, torch.tensor([3, 3])).tolist() == [3, 3]
    steep = StepCostProfile((2, 3, 4, 5), (1.0, 1.2, 1.6, 2.4))
    # survivals: r0 0.9, 0.81, 0.081; r1 0.5, 0.45, 0.405. Admit 0.9 (theta 2.9/1.2=2.42 > 2),
    # 0.81 (3.71/1.6 = 2.32 < 2.42): stop.
    assert schedule_prefix(conf, steep, torch.tensor([3, 3])).tolist() == [1, 0]
    assert schedule_prefix(conf, flat, torch.tensor([1, 0])).tolist() == [1, 0]  # hard caps hold


def test_a_row_scheduled_alone_follows_its_own_confidences_and_the_fixed_cost_only():
    """Seeded sampled rows trim their drafts alone over a linear cost model: L tokens expect 1 + a_1 + ... + a_L
    tokens for 1 + kappa L plain rounds, admitted in order while that improves, stopping at the first that does
    not (as Algorithm 1); the rows beside it change nothing."""
    conf = torch.tensor([[0.9, 0.5, 0.1, 0.9], [0.5, 0.5, 0.5, 0.5]])
    # kappa 0.1, row 0: survivals 0.9, 0.45, 0.045; theta 1, 1.9/1.1 = 1.727, 2.35/1.2 = 1.958, 2.395/1.3 = 1.842:
    # the third token does not improve, so the fourth (survival 0.04) is never looked at. Row 1: 0.5, 0.25, 0.125,
    # 0.0625; theta 1, 1.364, 1.458, 1.442: two tokens
    assert schedule_alone(conf, 0.1, torch.tensor([4, 4])).tolist() == [2, 2]
    assert schedule_alone(conf[1:], 0.1, torch.tensor([4])).tolist() == [2]  # alone: the same
    assert schedule_alone(conf, 0.1, torch.tensor([1, 0])).tolist() == [1, 0]  # hard caps hold
    assert schedule_alone(conf, 0.0, torch.tensor([4, 3])).tolist() == [4, 3]  # no cost: the whole block
    assert schedule_alone(conf, 1.0, torch.tensor([4, 4])).tolist() == [0, 0]  # a token as dear as a round
    # a first token that does not pay for itself: nothing verified (survivals never rise along a block, so with a
    # linear cost the first token that does not improve is where the best length ends)
    assert schedule_alone(torch.tensor([[0.2, 1.0, 1.0, 1.0]]), 0.25, torch.tensor([4])).tolist() == [0]
