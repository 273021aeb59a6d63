"""The categorical (C51) projection of Bellemare, Dabney & Munos (2017), "A Distributional
Perspective on Reinforcement Learning", Algorithm 1, vectorised over the batch. The quantile
Huber loss of QR-DQN, IQN and TQC is in ``shared.algos.quantiles``."""

from __future__ import annotations

import torch


def project_distribution(
    next_probs: torch.Tensor, returns: torch.Tensor, discounts: torch.Tensor, support: torch.Tensor
) -> torch.Tensor:
    """Project the distribution of ``returns + discounts * Z'`` onto ``support``.

    next_probs [N, atoms]: probabilities of Z' (the bootstrap distribution) on ``support``;
    returns [N] (n-step discounted reward sums), discounts [N] (gamma^m, 0 after a
    termination), support [atoms]: evenly spaced atoms z_0 = v_min < ... < z_{K-1} = v_max.
    Returns the target probabilities [N, atoms] (each row sums to that of ``next_probs``).

    Each shifted atom Tz_j = clamp(r + d * z_j, v_min, v_max) sits at fractional index
    b_j = (Tz_j - v_min) / dz; its mass p_j goes to the neighbours l = floor(b_j) and
    l + 1 in proportions (l + 1 - b_j) and (b_j - l). When b_j is an integer all of p_j
    lands on l; the paper's u = ceil(b_j) form would give both neighbours weight 0 there.
    """
    N, K = next_probs.shape
    v_min, v_max = support[0], support[-1]
    dz = (v_max - v_min) / (K - 1)
    shifted = (returns[:, None] + discounts[:, None] * support[None, :]).clamp(v_min, v_max)
    b = ((shifted - v_min) / dz).clamp(0, K - 1)  # rounding can push v_max a hair past K - 1
    lower = b.floor()
    frac = b - lower
    lower = lower.long()
    upper = (lower + 1).clamp(max=K - 1)  # b = K - 1 exactly: frac is 0, so upper gets nothing
    offset = (torch.arange(N, device=next_probs.device) * K)[:, None]
    target = torch.zeros(N * K, dtype=next_probs.dtype, device=next_probs.device)
    target.index_add_(0, (lower + offset).reshape(-1), (next_probs * (1.0 - frac)).reshape(-1))
    target.index_add_(0, (upper + offset).reshape(-1), (next_probs * frac).reshape(-1))
    return target.reshape(N, K)
