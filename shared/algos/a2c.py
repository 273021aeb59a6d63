"""Advantage actor-critic (Mnih et al. 2016, synchronous): one gradient step per batch.

With ``gae_lambda = 1`` the targets are the n-step returns of the original A2C; a smaller
lambda gives GAE targets. GAE does not correct the staleness of asynchronous batches (keep
the policy lag small); with ``advantages = "vtrace"`` the targets and the rho-weighted
advantages are V-trace's, which does: that is IMPALA's actor-critic (``algo.name = "impala"``).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.data.batches import OnPolicyBatch
from shared.algos.gae import explained_variance, pg_targets, real_steps
from shared.algos.hparams import A2CConfig
from shared.algos.optim import gradient_step, optimizer, ranks, set_lr
from shared.algos.update import Update
from shared.algos.value_norm import CheckpointedState, ValueNorm


class A2C(CheckpointedState):
    """A2C on a ``PgAgent``: ``update(batch, progress)`` takes one optimizer step."""

    def __init__(self, agent: nn.Module, cfg: A2CConfig = A2CConfig()) -> None:
        self.agent = agent
        self.cfg = cfg
        self.optimizer = optimizer(cfg.optimizer, agent.parameters(), lr=cfg.lr, eps=cfg.optimizer_eps,
                                   rmsprop_alpha=cfg.rmsprop_alpha)
        self.value_norm = ValueNorm(agent.device) if cfg.value_norm else None

    def update(self, batch: OnPolicyBatch, progress: float) -> Update:
        """One A2C step on a [T, B] batch; ``progress`` in [0, 1] is the run's fraction done.

        The loss is the mean over the batch's real steps, or with ``loss_reduction = "sum"``
        their sum (over all learner ranks' shares). Returns policy_loss, value_loss and entropy (per-step means
        either way), grad_norm (of the loss as reduced, before clipping), lr,
        explained_variance, and approx_kl / clip_fraction (behaviour vs current policy,
        a measure of staleness; clip_fraction uses |ratio - 1| > 0.2).
        """
        cfg = self.cfg
        lr = set_lr(self.optimizer, cfg.lr, progress, cfg.anneal_lr)
        data = pg_targets(self.agent, batch, cfg, self.value_norm)
        log_prob, entropy, value = self.agent.evaluate(data.observation, data.action, data.memory, data.reset)
        data, log_prob, entropy, value = real_steps(data, log_prob, entropy, value)  # no failed env step
        advantage = data.advantage
        if cfg.normalize_advantage and advantage.numel() > 1:
            advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
        policy_loss = -(advantage * log_prob).mean()
        value_loss = 0.5 * ((value - data.returns) ** 2).mean()
        entropy = entropy.mean()
        loss = policy_loss - cfg.entropy_coef * entropy + cfg.value_coef * value_loss
        if cfg.loss_reduction == "sum":  # the stats stay per-step means, comparable across reductions
            # The ranks' gradients are averaged (gradient_step): each rank's share counts ranks() times
            # so that the step is the whole batch's sum.
            loss = loss * (advantage.numel() * ranks())
        grad_norm = gradient_step(self.optimizer, loss, self.agent.parameters(), cfg.max_grad_norm)
        with torch.no_grad():
            log_ratio = log_prob - data.old_log_prob
            ratio = log_ratio.exp()
            approx_kl = ((ratio - 1.0) - log_ratio).mean()
            clip_fraction = ((ratio - 1.0).abs() > 0.2).float().mean()
        values = torch.stack([policy_loss, value_loss, entropy, approx_kl, clip_fraction, grad_norm]).detach().tolist()
        stats = dict(zip(("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "grad_norm"), values))
        stats["lr"] = lr
        stats["explained_variance"] = explained_variance(data.old_value, data.returns)
        return Update(stats)
