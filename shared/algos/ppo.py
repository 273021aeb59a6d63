"""Proximal Policy Optimization (Schulman et al. 2017), clipped surrogate, after CleanRL's ppo.py.

Batches may be a few policy versions stale (asynchronous samplers): the importance ratio
uses the behaviour log-probs stored at sampling time, so the clipped objective corrects
for it like for PPO's own epochs. With ``advantages = "vtrace"`` the advantages and value
targets are V-trace's too, from the current network's values and log-probs at the start of
the update: APPO as in Sample Factory.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.data.batches import OnPolicyBatch
from shared.algos.gae import explained_variance, pg_targets, real_steps
from shared.algos.hparams import PPOConfig
from shared.algos.optim import adam, average_over_ranks, gradient_step, set_lr
from shared.algos.update import Update
from shared.algos.value_norm import CheckpointedState, ValueNorm


class PPO(CheckpointedState):
    """PPO on a ``PgAgent``: ``update(batch, progress)`` runs epochs x minibatches Adam steps."""

    def __init__(self, agent: nn.Module, cfg: PPOConfig = PPOConfig()) -> None:
        self.agent = agent
        self.cfg = cfg
        self.optimizer = adam(agent.parameters(), lr=cfg.lr, eps=cfg.adam_eps)
        self.value_norm = ValueNorm(agent.device) if cfg.value_norm else None

    def update(self, batch: OnPolicyBatch, progress: float) -> Update:
        """One PPO update on a [T, B] batch; ``progress`` in [0, 1] is the run's fraction done.

        Returns means over the gradient steps of policy_loss, value_loss, entropy and
        grad_norm (before clipping), over their rows of approx_kl (the (r - 1) - log r
        estimator) and clip_fraction, plus lr and explained_variance (the V(s_t) used for
        the targets vs the value targets).
        """
        cfg = self.cfg
        lr = set_lr(self.optimizer, cfg.lr, progress, cfg.anneal_lr)
        clip = cfg.clip_eps * (1.0 - progress) if cfg.anneal_clip else cfg.clip_eps
        data = pg_targets(self.agent, batch, cfg, self.value_norm)
        # Minibatches split the rows: transitions [T*B] feed-forward, whole env sequences (the
        # columns of [T, B]) for a recurrent agent, which replays each from its stored state.
        recurrent = data.memory is not None
        n = data.advantage.shape[1 if recurrent else 0]
        # One minibatch is the whole batch: the mean loss does not depend on the order, and its
        # normalised advantages are the same in every epoch.
        whole = -self._normalized(real_steps(data)[0].advantage) if cfg.minibatches == 1 else None
        # Diagnostics are kept as the steps made them and reduced at the end, without grad:
        # no ops a step for them, one host sync per update.
        per_step, log_ratios = [], []
        for _ in range(cfg.epochs):
            parts = [None] if whole is not None else torch.tensor_split(
                torch.randperm(n, device=data.advantage.device), cfg.minibatches)
            for idx in parts:
                mb = data if idx is None else (data[:, idx] if recurrent else data[idx])
                log_prob, entropy, value = self.agent.evaluate(mb.observation, mb.action, mb.memory, mb.reset)
                mb, log_prob, entropy, value = real_steps(mb, log_prob, entropy, value)  # no failed env step
                log_ratio = log_prob - mb.old_log_prob
                ratio = log_ratio.exp()
                neg_advantage = whole if whole is not None else -self._normalized(mb.advantage)
                policy_loss = torch.max(neg_advantage * ratio, neg_advantage * ratio.clamp(1.0 - clip, 1.0 + clip)).mean()

                value_error = (value - mb.returns).square()
                if cfg.value_clip > 0:
                    clipped = mb.old_value + (value - mb.old_value).clamp(-cfg.value_clip, cfg.value_clip)
                    value_error = torch.max(value_error, (clipped - mb.returns).square())
                value_loss = 0.5 * value_error.mean()

                entropy = entropy.mean()
                loss = policy_loss + cfg.value_coef * value_loss
                if cfg.entropy_coef:
                    loss = loss - cfg.entropy_coef * entropy
                grad_norm = gradient_step(self.optimizer, loss, self.agent.parameters(), cfg.max_grad_norm)

                per_step += (policy_loss, value_loss, entropy, grad_norm)
                log_ratios.append(log_ratio)
            if cfg.target_kl > 0:
                with torch.no_grad():
                    kl = self._approx_kl(log_ratios[-1])
                average_over_ranks([kl])  # every rank stops after the same epoch
                if float(kl) > cfg.target_kl:
                    break
        with torch.no_grad():
            log_ratio = torch.cat([r.flatten() for r in log_ratios])
            clip_fraction = ((log_ratio.exp() - 1.0).abs() > clip).float().mean()
            means = torch.cat([torch.stack(per_step).view(-1, 4).mean(0),
                               torch.stack([self._approx_kl(log_ratio), clip_fraction])])
        stats = dict(zip(("policy_loss", "value_loss", "entropy", "grad_norm", "approx_kl", "clip_fraction"),
                         means.tolist()))
        stats["lr"] = lr
        real = real_steps(data)[0]
        stats["explained_variance"] = explained_variance(real.old_value, real.returns)
        return Update(stats)

    def _normalized(self, advantage: torch.Tensor) -> torch.Tensor:
        if self.cfg.normalize_advantage and advantage.numel() > 1:
            return (advantage - advantage.mean()) / (advantage.std() + 1e-8)
        return advantage

    @staticmethod
    def _approx_kl(log_ratio: torch.Tensor) -> torch.Tensor:
        return ((log_ratio.exp() - 1.0) - log_ratio).mean()
