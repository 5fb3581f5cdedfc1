"""Sequential Temperature Scaling (STS) of the confidence head, and its error measure.

The scheduler needs absolute survival probabilities ``prod_{i<=k} c_i``, not just a ranking.
STS calibrates left to right: at position k a 1-D grid search picks the temperature T_k that
minimises the expected calibration error (ECE) of the cumulative product, with positions < k
already calibrated and fixed. Temperature scaling keeps the ordering of the confidences.

What it is fitted to (``trainer.heldout_statistics``): the analytic acceptance 1 - 1/2 ||p_draft - p_target||_1 of
each held-out position, i.e. the exact probability that token-wise rejection sampling at temperature 1 (no top-k /
top-p) accepts that position given the true prefix -- not observed accept/reject events of served traffic, which also
depend on the temperature, truncation and block verification in use. The expected value is the same quantity an
observed 0/1 outcome estimates at T=1 (ECE accepts either), but served at other temperatures the calibration is off
by however much acceptance there differs.
"""

from __future__ import annotations

import torch


def expected_calibration_error(
    predicted: torch.Tensor,  # [M] probabilities
    observed: torch.Tensor,  # [M] outcomes in [0, 1] (0/1 events or their exact probabilities)
    bins: int = 15,
) -> float:
    predicted, observed = predicted.flatten().double(), observed.flatten().double()
    index = (predicted * bins).long().clamp(max=bins - 1)
    pred_sum = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, predicted)
    obs_sum = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, observed)
    return float(((pred_sum - obs_sum).abs()).sum() / max(len(predicted), 1))


def cumulative_ece(conf_logits: torch.Tensor, observed: torch.Tensor, temperatures: torch.Tensor,
                   valid: torch.Tensor | None = None) -> list[float]:
    """ECE of prod_{i<=k} sigmoid(logit_i / T_i) against observed joint survival, per position k."""
    cumulative = torch.sigmoid(conf_logits / temperatures[None, :]).cumprod(1)
    observed_cum = observed.cumprod(1)
    out = []
    for k in range(conf_logits.shape[1]):
        rows = valid[:, k] if valid is not None else slice(None)
        out.append(expected_calibration_error(cumulative[rows, k], observed_cum[rows, k]))
    return out


def sequential_temperature_scaling(
    conf_logits: torch.Tensor,  # [M, G] raw confidence logits (temperature 1)
    observed: torch.Tensor,  # [M, G] per-position acceptance given the prefix was accepted
    valid: torch.Tensor | None = None,  # [M, G] bool
    grid: torch.Tensor | None = None,
) -> tuple[float, ...]:
    grid = grid if grid is not None else torch.logspace(-1.0, 1.0, 81, dtype=torch.float64)
    block = conf_logits.shape[1]
    logits, observed = conf_logits.double(), observed.double()
    observed_cum = observed.cumprod(1)
    prefix = torch.ones(logits.shape[0], dtype=torch.float64)
    temperatures = []
    for k in range(block):
        rows = valid[:, k] if valid is not None else torch.ones(len(prefix), dtype=torch.bool)
        errors = [expected_calibration_error((prefix * torch.sigmoid(logits[:, k] / t))[rows],
                                             observed_cum[rows, k]) for t in grid]
        best = float(grid[int(torch.tensor(errors).argmin())])
        temperatures.append(best)
        prefix = prefix * torch.sigmoid(logits[:, k] / best)
    return tuple(temperatures)
