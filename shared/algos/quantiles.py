"""Quantile regression of return distributions: the quantile Huber loss of Dabney et al.
(2017), "Distributional Reinforcement Learning with Quantile Regression", and the truncated
pooled target of Kuznetsov et al. (2020), "Controlling Overestimation Bias with Truncated
Mixture of Continuous Distributional Quantile Critics" (TQC)."""

from __future__ import annotations

import torch


def quantile_fractions(n: int, device=None) -> torch.Tensor:
    """The quantile midpoints tau_i = (2i + 1) / 2n, i = 0..n-1: float32 [n]."""
    return (torch.arange(n, device=device, dtype=torch.float32) + 0.5) / n


def quantile_huber(quantiles: torch.Tensor, targets: torch.Tensor, kappa: float = 1.0) -> torch.Tensor:
    """rho_tau_i(u_ij) = |tau_i - 1{u_ij < 0}| * L_kappa(u_ij) / kappa for every pair of a
    predicted quantile i and a target atom j, u_ij = target_j - quantile_i: [..., K, J].

    quantiles [..., K] at fractions ``quantile_fractions(K)``, targets [..., J] (held constant:
    the caller detaches them), broadcast over the leading dims. L_kappa is the Huber loss,
    0.5 u^2 for |u| <= kappa, kappa (|u| - 0.5 kappa) beyond; kappa = 0 is the pure quantile
    (pinball) loss |tau - 1{u < 0}| |u|. The caller reduces: QR-DQN sums over i and averages
    over j, TQC averages over both.
    """
    u = targets.unsqueeze(-2) - quantiles.unsqueeze(-1)
    tau = quantile_fractions(quantiles.shape[-1], quantiles.device).unsqueeze(-1)
    weight = (tau - (u.detach() < 0).float()).abs()
    if kappa == 0:
        return weight * u.abs()
    huber = torch.where(u.abs() <= kappa, 0.5 * u.square(), kappa * (u.abs() - 0.5 * kappa))
    return weight * huber / kappa


def truncated_pool(quantiles: torch.Tensor, drop_per_net: int) -> torch.Tensor:
    """TQC's target atoms: the quantiles of all M critics, [M, N, K], pooled per sample, sorted
    ascending, and the top M * drop_per_net dropped: [N, M * (K - drop_per_net)]."""
    M, N, K = quantiles.shape
    pooled = quantiles.permute(1, 0, 2).reshape(N, M * K)
    return pooled.sort(dim=-1).values[:, : M * (K - drop_per_net)]
