"""The DSpark training objective: 0.1 CE + 0.9 TV + 1.0 BCE(confidence), position-weighted."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossTerms:
    total: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor
    conf: torch.Tensor
    acceptance: torch.Tensor  # [G] mean analytic per-position acceptance c*_k (teacher-forced)
    expected_length: torch.Tensor  # mean 1 + sum_k prod_{i<=k} c*_i


def position_weights(block: int) -> torch.Tensor:
    return torch.tensor([math.exp(-k / block) for k in range(block)])


def dspark_loss(
    draft_logits: torch.Tensor,  # [N, G, V] Markov-biased draft logits (V: the draft's vocabulary)
    conf_logits: torch.Tensor,  # [N, G]
    target_probs: torch.Tensor,  # [N, G, V] the target's probabilities of the draft's tokens at each position
    labels: torch.Tensor,  # [N, G] the tokens that actually follow, draft ids (-1: outside the draft's vocabulary)
    valid: torch.Tensor,  # [N, G] bool: position inside the sequence
    weights: tuple[float, float, float] = (0.1, 0.9, 1.0),
    target_outside: torch.Tensor | None = None,  # [N, G] target mass outside a reduced draft vocabulary
) -> LossTerms:
    """With a reduced draft vocabulary the total variation still compares full distributions: the draft puts no
    mass outside its vocabulary, so the target's mass there (``target_outside``) adds to the L1 distance as is,
    and the analytic acceptance ``1 - TV`` is exactly the full-vocabulary one."""
    block = draft_logits.shape[1]
    w = position_weights(block).to(draft_logits.device)[None, :] * valid  # [N, G]
    norm = w.sum().clamp_min(1e-9)
    log_draft = torch.log_softmax(draft_logits.float(), dim=-1)
    draft_probs = log_draft.exp()
    ce_w = w * (labels >= 0)  # a label the draft cannot emit teaches it nothing
    ce = -(log_draft.gather(-1, labels.clamp_min(0)[..., None])[..., 0] * ce_w).sum() / ce_w.sum().clamp_min(1e-9)
    l1 = (draft_probs - target_probs.float()).abs().sum(-1)  # [N, G]
    if target_outside is not None:
        l1 = l1 + target_outside.float()
    tv = (l1 * w).sum() / norm
    accept = (1 - 0.5 * l1).detach().clamp(0, 1)  # c*_k
    bce = F.binary_cross_entropy_with_logits(conf_logits.float(), accept, reduction="none")
    conf = (bce * w).sum() / norm
    total = weights[0] * ce + weights[1] * tv + weights[2] * conf
    count = valid.sum(0).clamp_min(1)
    acceptance = (accept * valid).sum(0) / count
    survival = (accept * valid).cumprod(1)
    return LossTerms(total, ce.detach(), tv.detach(), conf.detach(), acceptance,
                     (1 + survival.sum(1)).mean())
