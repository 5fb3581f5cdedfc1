"""Lossless verification of drafted blocks against the target.

Conventions (G = drafted block length, rows may verify fewer tokens, ``num_draft[b] <= G``):
  * ``draft_tokens[b, i]`` was sampled from ``draft_probs[b, i]``;
  * ``target_probs[b, i]`` is the target's distribution of the token after the anchor and
    ``draft_tokens[b, :i]`` (so ``target_probs[b, num_draft[b]]`` gives the bonus token).
Every function returns a :class:`VerifyResult` with the committed tokens in a fixed
``[B, G + 1]`` tensor padded with -1. Greedy rows take the exact argmax path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.decoding.sampling import sample_from


@dataclass
class VerifyResult:
    tokens: torch.Tensor  # [B, G + 1] accepted draft tokens then the target's token, padded with -1
    num_accepted: torch.Tensor  # [B] accepted draft tokens (the committed count is num_accepted + 1)


def _pack(
    draft_tokens: torch.Tensor,  # [B, G]
    num_accepted: torch.Tensor,  # [B]
    final_token: torch.Tensor,  # [B]
) -> VerifyResult:
    batch, block = draft_tokens.shape
    idx = torch.arange(block + 1, device=draft_tokens.device)[None, :]
    padded = torch.cat((draft_tokens, draft_tokens.new_zeros(batch, 1)), dim=1)
    tokens = torch.where(idx < num_accepted[:, None], padded, torch.full_like(padded, -1))
    tokens.scatter_(1, num_accepted[:, None], final_token[:, None])
    return VerifyResult(tokens, num_accepted)


def _first_false(accepted: torch.Tensor) -> torch.Tensor:
    # accepted: [B, G] bool -> [B] length of the all-True prefix
    return accepted.long().cumprod(dim=1).sum(dim=1)


def verify_greedy(
    draft_tokens: torch.Tensor,  # [B, G]
    num_draft: torch.Tensor,  # [B]
    target_logits: torch.Tensor,  # [B, G + 1, V]
) -> VerifyResult:
    """Accept while the draft equals the target's argmax; then the target's argmax."""
    target_tokens = target_logits.argmax(-1)  # [B, G + 1]
    block = draft_tokens.shape[1]
    in_range = torch.arange(block, device=draft_tokens.device)[None, :] < num_draft[:, None]
    num_accepted = _first_false((draft_tokens == target_tokens[:, :block]) & in_range)
    return _pack(draft_tokens, num_accepted, target_tokens.gather(1, num_accepted[:, None])[:, 0])


def _token_probs(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    # probs: [B, G(+1), V], tokens: [B, G] -> [B, G]
    return probs[:, : tokens.shape[1]].gather(2, tokens[:, :, None])[:, :, 0]


def verify_tokenwise(
    draft_tokens: torch.Tensor,  # [B, G]
    num_draft: torch.Tensor,  # [B]
    draft_probs: torch.Tensor,  # [B, G, V]
    target_probs: torch.Tensor,  # [B, G + 1, V]
    uniforms: torch.Tensor,  # [B, G + 1]: G acceptance draws and one for the final token
) -> VerifyResult:
    """Speculative sampling: accept token i with min(1, target/draft); resample the residual."""
    batch, block = draft_tokens.shape
    p_target = _token_probs(target_probs, draft_tokens)
    p_draft = _token_probs(draft_probs, draft_tokens)
    in_range = torch.arange(block, device=draft_tokens.device)[None, :] < num_draft[:, None]
    accepted = (uniforms[:, :block] * p_draft < p_target) & in_range
    num_accepted = _first_false(accepted)
    target_at = target_probs.gather(1, num_accepted[:, None, None].expand(-1, 1, target_probs.shape[-1]))[:, 0]
    draft_padded = torch.cat((draft_probs, draft_probs.new_zeros(batch, 1, draft_probs.shape[-1])), dim=1)
    draft_at = draft_padded.gather(1, num_accepted[:, None, None].expand(-1, 1, draft_probs.shape[-1]))[:, 0]
    rejected = (num_accepted < num_draft)[:, None]
    residual = (target_at - draft_at).clamp_min(0)
    # a rejection implies target < draft somewhere, hence positive residual mass
    final_dist = torch.where(rejected & (residual.sum(-1, keepdim=True) > 0), residual, target_at)
    return _pack(draft_tokens, num_accepted, sample_from(final_dist, uniforms[:, block]))


def verify_block(
    draft_tokens: torch.Tensor,  # [B, G]
    num_draft: torch.Tensor,  # [B]
    draft_probs: torch.Tensor,  # [B, G, V]
    target_probs: torch.Tensor,  # [B, G + 1, V]
    uniforms: torch.Tensor,  # [B, G + 2]: stopping draws eta_1..eta_G at 1..G (0 unused), final at G + 1
) -> VerifyResult:
    """Block verification (Sun et al. 2024): accepts at least as many tokens as token-wise.

    p_0 = 1, p_i = min(1, p_{i-1} * target(x_i) / draft(x_i));
    r_i = sum_x max(p_i * target_i(x) - draft_i(x), 0), h_i = r_i / (r_i + 1 - p_i) for i < L, h_L = p_L;
    tau = max{i : eta_i <= h_i} (0 if none); the final token comes from target_L when tau = L, else
    from normalise(max(p_tau * target_tau - draft_tau, 0)).
    """
    batch, block = draft_tokens.shape
    ratio = _token_probs(target_probs, draft_tokens) / _token_probs(draft_probs, draft_tokens).clamp_min(1e-30)
    one = ratio.new_ones(batch)  # [B]
    p = [one]
    for i in range(block):
        p.append(torch.minimum(one, p[-1] * ratio[:, i]))
    p_all = torch.stack(p, dim=1)  # [B, G + 1]
    # [B, G + 1, V]
    draft_padded = torch.cat((draft_probs, draft_probs.new_zeros(batch, 1, draft_probs.shape[-1])), dim=1)
    residual_mass = (p_all[:, :, None] * target_probs - draft_padded).clamp_min(0).sum(-1)  # [B, G + 1]
    denom = residual_mass + 1 - p_all
    h = torch.where(denom > 0, residual_mass / denom.clamp_min(1e-30), torch.zeros_like(denom))
    idx = torch.arange(block + 1, device=draft_tokens.device)[None, :]
    h = torch.where(idx == num_draft[:, None], p_all, h)  # h_L = p_L
    h = torch.where(idx > num_draft[:, None], torch.zeros_like(h), h)
    h[:, 0] = torch.where(num_draft == 0, one, h[:, 0])
    stop_ok = (uniforms[:, : block + 1] <= h) & (idx <= num_draft[:, None])  # a draw of exactly 0 stops nowhere past L
    stop_ok[:, 0] = True  # tau = 0 when no later index qualifies
    tau = (stop_ok.long() * idx).max(dim=1).values  # [B]
    gather = tau[:, None, None].expand(-1, 1, target_probs.shape[-1])
    target_at = target_probs.gather(1, gather)[:, 0]
    draft_at = draft_padded.gather(1, gather)[:, 0]
    p_tau = p_all.gather(1, tau[:, None])
    residual = (p_tau * target_at - draft_at).clamp_min(0)
    use_target = (tau == num_draft)[:, None] | (residual.sum(-1, keepdim=True) <= 0)
    final_dist = torch.where(use_target, target_at, residual)
    return _pack(draft_tokens, tau, sample_from(final_dist, uniforms[:, block + 1]))


def verify(
    method: str,
    draft_tokens: torch.Tensor,  # [B, G]
    num_draft: torch.Tensor,  # [B]
    draft_probs: torch.Tensor,  # [B, G, V]
    target_logits: torch.Tensor,  # [B, G + 1, V]
    target_probs: torch.Tensor,  # [B, G + 1, V]
    greedy: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor,  # [B, G + 2]
    all_greedy: bool | None = None,  # known on the host: saves asking the device
) -> VerifyResult:
    """Verify a mixed batch: greedy rows exactly, sampled rows with ``method`` ('token' or 'block')."""
    result = verify_greedy(draft_tokens, num_draft, target_logits)
    if bool(greedy.all()) if all_greedy is None else all_greedy:
        return result
    greedy = greedy.to(draft_tokens.device)
    if method == "block":
        sampled = verify_block(draft_tokens, num_draft, draft_probs, target_probs, uniforms)
    else:
        sampled = verify_tokenwise(
            draft_tokens, num_draft, draft_probs, target_probs,
            torch.cat((uniforms[:, : draft_tokens.shape[1]], uniforms[:, -1:]), dim=1),
        )
    rows = greedy[:, None]
    return VerifyResult(
        torch.where(rows, result.tokens, sampled.tokens),
        torch.where(greedy, result.num_accepted, sampled.num_accepted),
    )
