"""Quantile regression of return distributions: the quantile Huber loss of Dabney et al.
(2017), "Distributional Reinforcement Learning with Quantile Regression", and the truncated
pooled target of Kuznetsov et al. (2020), "Controlling Overestimation Bias with Truncated
Mixture of Continuous Distributional Quantile Critics" (TQC)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def quantile_fractions(n: int, device=None) -> torch.Tensor:
    """The quantile midpoints tau_i = (2i + 1) / 2n, i = 0..n-1: float32 [n]."""
    return (torch.arange(n, device=device, dtype=torch.float32) + 0.5) / n


def quantile_huber(quantiles: torch.Tensor, targets: torch.Tensor, kappa: float = 1.0,
                   taus: torch.Tensor | None = None) -> torch.Tensor:
    """rho_tau_i(u_ij) = |tau_i - 1{u_ij < 0}| * L_kappa(u_ij) / kappa for every pair of a
    predicted quantile i and a target atom j, u_ij = target_j - quantile_i: [..., K, J].

    quantiles [..., K] at fractions ``taus`` (broadcast to quantiles' shape: IQN's sampled ones)
    or, by default, ``quantile_fractions(K)``; targets [..., J] (held constant: the caller
    detaches them), broadcast over the leading dims. L_kappa is the Huber loss, 0.5 u^2 for
    |u| <= kappa, kappa (|u| - 0.5 kappa) beyond; kappa = 0 is the pure quantile (pinball) loss
    |tau - 1{u < 0}| |u|. The caller reduces: QR-DQN and IQN (Dabney et al. 2017, eq. 10; 2018,
    eq. 3) sum over i and average over j, TQC averages over both.
    """
    K = quantiles.shape[-1]
    shape = (*torch.broadcast_shapes(quantiles.shape[:-1], targets.shape[:-1]), K, targets.shape[-1])
    q, t = quantiles.unsqueeze(-1).expand(shape), targets.unsqueeze(-2).expand(shape)
    tau = (quantile_fractions(K, quantiles.device) if taus is None else taus).unsqueeze(-1)
    # Fused losses over the [..., K, J] pairs: a TQC batch has ~10^5-10^6 of them, and an op
    # each for u, |u|, the branches and the weight made its update four times SAC's.
    weight = torch.where(t < q, 1.0 - tau, tau)
    if kappa == 0:
        return weight * F.l1_loss(q, t, reduction="none")
    return weight * F.huber_loss(q, t, reduction="none", delta=kappa) / kappa


def truncated_pool(quantiles: torch.Tensor, drop_per_net: int) -> torch.Tensor:
    """TQC's target atoms: the quantiles of all M critics, [M, N, K], pooled per sample, sorted
    ascending, and the top M * drop_per_net dropped: [N, M * (K - drop_per_net)]."""
    M, N, K = quantiles.shape
    pooled = quantiles.permute(1, 0, 2).reshape(N, M * K)
    return pooled.sort(dim=-1).values[:, : M * (K - drop_per_net)]
