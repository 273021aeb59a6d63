"""The pieces of the distributional DQN losses, vectorised over the batch: the categorical
(C51) projection of Bellemare, Dabney & Munos (2017), "A Distributional Perspective on
Reinforcement Learning", Algorithm 1; and the quantile Huber loss of QR-DQN and IQN (Dabney
et al. 2017, "Distributional Reinforcement Learning with Quantile Regression", eq. 10; 2018,
"Implicit Quantile Networks for Distributional Reinforcement Learning", eq. 3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def quantile_huber_loss(values: torch.Tensor, taus: torch.Tensor, targets: torch.Tensor, kappa: float) -> torch.Tensor:
    """Per-item loss [N] of quantile values [N, T] at fractions taus [N, T] against target
    samples [N, T'] (computed without gradient by the caller):

        loss = sum_i mean_j |tau_i - 1{u_ij < 0}| * L_kappa(u_ij) / kappa,   u_ij = target_j - value_i

    with L_kappa the Huber loss (0.5 u^2 for |u| <= kappa, kappa (|u| - kappa / 2) beyond);
    kappa = 0 is its limit, the plain quantile loss |tau_i - 1{u_ij < 0}| * |u_ij|. Summing over
    the online quantiles i and averaging over the target samples j is both papers' form (QR-DQN:
    T = T' = N, IQN: N and N')."""
    u = targets.unsqueeze(-2) - values.unsqueeze(-1)  # [N, T, T']
    if kappa > 0:
        loss = F.huber_loss(u, torch.zeros_like(u), reduction="none", delta=kappa) / kappa
    else:
        loss = u.abs()
    weight = (taus.unsqueeze(-1) - (u.detach() < 0).to(u.dtype)).abs()
    return (weight * loss).mean(-1).sum(-1)


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
