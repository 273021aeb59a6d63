"""Q-policy-gradient learning on n-step transitions: DDPG, TD3 and SAC.

- ``DDPG`` (Lillicrap et al. 2016): the critic regresses on r + gamma^m Q'(s', mu'(s')) from
  the target actor and critic; the actor maximises Q(s, mu(s)). With ``TD3Config`` it is
  TD3 (Fujimoto et al. 2018): twin critics and the minimum of their targets (clipped
  double Q), Gaussian smoothing noise on the target action, clipped to
  +-target_noise_clip, and actor and target updates every ``policy_delay`` critic updates.
- ``SAC`` (Haarnoja et al. 2018): twin soft Q targets min_i Q'_i(s', a') - alpha log pi(a'|s')
  with a' sampled from the current actor, the actor minimises alpha log pi - min_i Q_i, and
  alpha is tuned so the policy's entropy tracks ``target_entropy`` (-|A| by default), or
  fixed.

Replay supplies n-step returns, bootstrap discounts (gamma^m, 0 after a termination) and
importance weights, so one update covers 1- and n-step, uniform and prioritized replay
(the n-step soft target takes the entropy bonus at the bootstrap step only). Critic losses
are importance-weighted squared errors; ``update`` returns |TD error| of the first critic as
new priorities, like the DQN family, and never writes to replay itself. One Adam optimizer
per network (actor, critics, SAC's temperature); targets are deep copies of the agent,
moved by Polyak averaging (SAC: only the critics, the parts its TD target uses).
"""

from __future__ import annotations

import contextlib
import copy

import torch

from shared.agents.qpg import DeterministicAgent, QpgAgent, SacAgent
from shared.algos.hparams import DDPGConfig, QpgConfig, SACConfig, TD3Config  # noqa: F401 (re-exported)
from shared.algos.optim import adam, gradient_step, set_lr
from shared.algos.update import Update
from shared.data.batches import Transition


class _QpgAlgo:
    """The shared machinery: optimizers, learning-rate annealing, clipped steps, Polyak targets."""

    def __init__(self, agent: QpgAgent, cfg: QpgConfig) -> None:
        self.agent, self.cfg = agent, cfg
        self.target = copy.deepcopy(agent).requires_grad_(False)
        self.actor_params = [*agent.actor_encoder.parameters(), *agent.actor_head.parameters()]
        self.actor_opt = adam(self.actor_params, lr=cfg.actor_lr)
        self.critic_opt = adam(agent.critics.parameters(), lr=cfg.critic_lr)
        self.updates = 0
        # What _polyak moves, listed once (it runs every update).
        self._averaged = (self._averaged_params(self.target), self._averaged_params(agent))
        self._copied = (list(self.target.buffers()), list(agent.buffers()))

    @staticmethod
    def _averaged_params(agent: QpgAgent) -> list[torch.Tensor]:
        """The parameters whose targets the TD targets use: actor and critics (DDPG, TD3)."""
        return list(agent.parameters())

    def _anneal(self, progress: float) -> float:
        """Set the learning rates for ``progress``; returns the fraction of the initial ones."""
        for opt, lr in self._optimizers():
            set_lr(opt, lr, progress, self.cfg.anneal_lr)
        return 1.0 - progress if self.cfg.anneal_lr else 1.0

    def _optimizers(self) -> list[tuple[torch.optim.Optimizer, float]]:
        return [(self.actor_opt, self.cfg.actor_lr), (self.critic_opt, self.cfg.critic_lr)]

    def _step(self, opt: torch.optim.Optimizer, loss: torch.Tensor, params) -> torch.Tensor:
        """One optimizer step on ``loss``; returns the gradient norm before clipping."""
        return gradient_step(opt, loss, params, self.cfg.max_grad_norm)

    def _critic_update(self, batch: Transition, target_value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Critics towards ``target_value`` [N]; returns (loss, q_mean, |TD| of critic 0, grad norm)."""
        q = self.agent.q(batch.observation, self.agent.to_unit(batch.action))  # [n_critics, N]
        weight = batch.is_weight.float()
        loss = (weight * 0.5 * (q - target_value).square()).mean(-1).sum()
        grad_norm = self._step(self.critic_opt, loss, self.agent.critics.parameters())
        return loss.detach(), q[0].detach().mean(), (target_value - q[0].detach()).abs(), grad_norm

    @contextlib.contextmanager
    def _critics_frozen(self):
        """While the actor's loss is computed and stepped: it differentiates through the
        critics, never into them."""
        critics = list(self.agent.critics.parameters())
        for p in critics:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p in critics:
                p.requires_grad_(True)

    @torch.no_grad()
    def _polyak(self) -> None:
        """target <- tau * online + (1 - tau) * target for parameters; buffers (the observation
        normaliser's statistics) are copied: the targets normalise as the agent does."""
        torch._foreach_lerp_(*self._averaged, self.cfg.tau)
        torch._foreach_copy_(*self._copied)

    def _stats(self, names: tuple[str, ...], values: list[torch.Tensor], td_abs: torch.Tensor, frac: float) -> Update:
        """Diagnostics as floats (one host sync), td_abs_mean (|TD| of critic 0, as DQN reports it)
        among them, and the new priorities."""
        means = torch.stack([*(v.float() for v in values), td_abs.float().mean()]).tolist()
        stats = dict(zip((*names, "td_abs_mean"), means))
        stats["lr_frac"] = frac
        return Update(stats, td_abs.float().cpu().numpy())

    def state_dict(self) -> dict:
        """Optimizers, target networks and update count, for checkpoints (the agent is saved separately)."""
        return {"optimizers": [opt.state_dict() for opt, _ in self._optimizers()],
                "target": self.target.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        for (opt, _), saved in zip(self._optimizers(), state["optimizers"]):
            opt.load_state_dict(saved)
        self.target.load_state_dict(state["target"])
        self.updates = int(state["updates"])


class DDPG(_QpgAlgo):
    """DDPG, or TD3 with a ``TD3Config``: ``update(batch, progress)`` is one critic step and,
    every ``policy_delay`` of them, one actor step and a Polyak move of the targets."""

    def __init__(self, agent: DeterministicAgent, cfg: DDPGConfig = DDPGConfig()) -> None:
        super().__init__(agent, cfg)
        self.last_actor_loss = torch.zeros((), device=agent.device)  # reported between delayed actor steps

    def target_action(self, bootstrap_observation) -> torch.Tensor:
        """mu'(s') plus clipped Gaussian smoothing noise (TD3), within [-1, 1]: [N, A]."""
        action = self.target.policy(bootstrap_observation)
        if self.cfg.target_noise > 0:
            clip = self.cfg.target_noise_clip
            action = action + (torch.randn_like(action) * self.cfg.target_noise).clamp(-clip, clip)
        return action.clamp(-1.0, 1.0)

    def update(self, batch: Transition, progress: float) -> Update:
        """One update on N transitions (torch tensors on the agent's device); ``progress`` in
        [0, 1] anneals the learning rates. Returns floats critic_loss, actor_loss (of the last
        actor step), q_mean, target_mean, critic_grad_norm, td_abs_mean, lr_frac; and the new priorities [N]."""
        frac = self._anneal(progress)
        with torch.no_grad():
            target_q = self.target.q(batch.bootstrap_observation, self.target_action(batch.bootstrap_observation))
            target_value = batch.return_.float() + batch.bootstrap_discount.float() * target_q.min(0).values
        critic_loss, q_mean, td_abs, grad_norm = self._critic_update(batch, target_value)
        self.updates += 1
        if self.updates % self.cfg.policy_delay == 0:
            with self._critics_frozen():
                actor_loss = -self.agent.q(batch.observation, self.agent.policy(batch.observation))[0].mean()
                self._step(self.actor_opt, actor_loss, self.actor_params)
            self.last_actor_loss = actor_loss.detach()
            self._polyak()
        return self._stats(("critic_loss", "actor_loss", "q_mean", "target_mean", "critic_grad_norm"),
                           [critic_loss, self.last_actor_loss, q_mean, target_value.mean(), grad_norm], td_abs, frac)


class SAC(_QpgAlgo):
    """SAC: ``update(batch, progress)`` is one step of the critics, the actor and (when
    learned) the temperature, then a Polyak move of the target critics."""

    def __init__(self, agent: SacAgent, cfg: SACConfig = SACConfig()) -> None:
        super().__init__(agent, cfg)
        self.target_entropy = -float(agent.action_dim) if cfg.target_entropy is None else cfg.target_entropy
        self.log_alpha = torch.tensor(float(cfg.init_alpha), device=agent.device).log().requires_grad_(cfg.learn_alpha)
        self.alpha_opt = adam([self.log_alpha], lr=cfg.alpha_lr)

    def _optimizers(self) -> list[tuple[torch.optim.Optimizer, float]]:
        return super()._optimizers() + [(self.alpha_opt, self.cfg.alpha_lr)]

    @staticmethod
    def _averaged_params(agent: QpgAgent) -> list[torch.Tensor]:
        """The critics only: SAC's TD target samples from the current actor."""
        return list(agent.critics.parameters())

    def update(self, batch: Transition, progress: float) -> Update:
        """One update on N transitions (torch tensors on the agent's device). Returns floats
        critic_loss, actor_loss, alpha, entropy (-mean log pi), q_mean, target_mean,
        critic_grad_norm, td_abs_mean, lr_frac; and the new priorities [N]."""
        frac = self._anneal(progress)
        agent = self.agent
        alpha = self.log_alpha.detach().exp()
        with torch.no_grad():
            next_action, next_log_prob = agent.sample(batch.bootstrap_observation)
            soft_q = self.target.q(batch.bootstrap_observation, next_action).min(0).values - alpha * next_log_prob
            target_value = batch.return_.float() + batch.bootstrap_discount.float() * soft_q
        critic_loss, q_mean, td_abs, grad_norm = self._critic_update(batch, target_value)

        with self._critics_frozen():
            action, log_prob = agent.sample(batch.observation)
            actor_loss = (alpha * log_prob - agent.q(batch.observation, action).min(0).values).mean()
            self._step(self.actor_opt, actor_loss, self.actor_params)
        if self.cfg.learn_alpha:
            alpha_loss = -(self.log_alpha * (log_prob.detach() + self.target_entropy)).mean()
            gradient_step(self.alpha_opt, alpha_loss, [self.log_alpha], 0.0)
        self.updates += 1
        self._polyak()
        return self._stats(("critic_loss", "actor_loss", "alpha", "entropy", "q_mean", "target_mean",
                            "critic_grad_norm"),
                           [critic_loss, actor_loss.detach(), alpha, -log_prob.detach().mean(), q_mean,
                            target_value.mean(), grad_norm], td_abs, frac)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "log_alpha": self.log_alpha.detach().clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
