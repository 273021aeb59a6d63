"""Q-policy-gradient learning on n-step transitions: DDPG, TD3, SAC, TQC and CrossQ.

- ``DDPG`` (Lillicrap et al. 2016): the critic regresses on r + gamma^m Q'(s', mu'(s')) from
  the target actor and critic; the actor maximises Q(s, mu(s)). With ``TD3Config`` it is
  TD3 (Fujimoto et al. 2018): twin critics and the minimum of their targets (clipped
  double Q), Gaussian smoothing noise on the target action, clipped to
  +-target_noise_clip, and actor and target updates every ``policy_delay`` critic updates.
- ``SAC`` (Haarnoja et al. 2018): twin soft Q targets min_i Q'_i(s', a') - alpha log pi(a'|s')
  with a' sampled from the current actor, the actor minimises alpha log pi - min_i Q_i, and
  alpha is tuned so the policy's entropy tracks ``target_entropy`` (-|A| by default), or
  fixed. Two parts are injected or set, and make the other two algorithms:
- TQC (Kuznetsov et al. 2020) is SAC with ``TruncatedQuantiles`` for ``ScalarCritics``: M
  critics of N quantiles each; the target pools the M * N atoms of the target critics at
  (s', a'), sorted, drops the top M * d, and takes r + gamma^m (atom - alpha log pi) of each
  kept one; every critic's quantiles regress on all of them by the quantile Huber loss
  (kappa 1, averaged over quantiles and atoms, ``shared.algos.quantiles``); the actor climbs
  the mean of all M * N quantiles.
- CrossQ (Bhatt et al. 2024) is SAC with ``target_networks = false``: no target critics; the
  batch's state-actions (s, a) and the bootstrap ones (s', a') go through the critics in one
  forward pass of 2N rows, so their batch renormalization (``CrossQConfig``) normalises both
  with the statistics of the two together (the next state-actions come from another
  distribution than the replayed ones; normalised alone, or by running statistics that never
  saw them, they would be out of distribution), and the next half's Q, detached, is the
  target. The actor (and temperature) step every ``policy_delay`` = 3 critic steps, with the
  critics in eval mode (their running statistics), as sb3-contrib does. With batch renorm in
  the actor too (``CrossQConfig.actor_batch_renorm``, the paper's) the bootstrap actions a' come
  from its running statistics and the actor loss's pass trains it (batch statistics, moved by
  that pass), as sb3-contrib's; acting reads the running statistics (``QpgAgent.step``).

Replay supplies n-step returns, bootstrap discounts (gamma^m, 0 after a termination) and
importance weights, so one update covers 1- and n-step, uniform and prioritized replay
(the n-step soft target takes the entropy bonus at the bootstrap step only). Critic losses
are importance-weighted; ``update`` returns |TD error| of the first critic (quantile critics:
of its mean against the target atoms' mean) as new priorities, like the DQN family, and never
writes to replay itself. One Adam optimizer per network (actor, critics, SAC's temperature);
targets are deep copies of the agent, moved by Polyak averaging (SAC: only the critics, the
parts its TD target uses). ``DDPG`` and ``SAC`` are ``TargetNetworkAlgo``s that each hold an
``ActorCriticSteps``, the optimizers and gradient steps they share, rather than inheriting
them (STYLE.md, habit 2).
"""

from __future__ import annotations

import contextlib

import torch

from shared.agents.qpg import DeterministicAgent, QpgAgent, SacAgent
from shared.algos.hparams import (CrossQConfig, DDPGConfig, QpgConfig, SACConfig, TD3Config,  # noqa: F401 (re-exported)
                                  TQCConfig)
from shared.algos.optim import adam, gradient_step, set_lr
from shared.algos.quantiles import quantile_huber, truncated_pool
from shared.algos.target import TargetNetworkAlgo
from shared.algos.update import Update
from shared.data.batches import Transition
from shared.data.namedarraytuple import zip_map


class ScalarCritics:
    """Critics of one Q-value each, [n, N]: the TD target takes their minimum (clipped double
    Q with two), each regresses on it by the importance-weighted squared error 0.5 td^2 (summed
    over critics, averaged over the batch), and the SAC actor climbs their minimum."""

    def target(self, next_q: torch.Tensor) -> torch.Tensor:
        """Bootstrap atoms [N, 1] from the critics' values at (s', a') [n, N]."""
        return next_q.min(0).values.unsqueeze(-1)

    def loss(self, q: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, |TD| of critic 0 [N]) for Q [n, N] against target atoms [N, 1], weights [N]."""
        td = target[:, 0] - q
        return (weight * 0.5 * td.square()).mean(-1).sum(), td[0].detach().abs()

    def actor_value(self, q: torch.Tensor) -> torch.Tensor:
        return q.min(0).values


class TruncatedQuantiles:
    """TQC's critics, quantiles [M, N, K]: the target is the pooled atoms of all M critics,
    sorted, without the top M * ``drop_per_net`` ([N, M (K - d)]); each critic's quantiles
    regress on all of them by the quantile Huber loss (kappa 1), averaged over critics,
    quantiles and atoms as the paper's code does, importance-weighted per sample; the actor
    climbs the mean of all quantiles."""

    def __init__(self, drop_per_net: int) -> None:
        self.drop_per_net = drop_per_net

    def target(self, next_q: torch.Tensor) -> torch.Tensor:
        return truncated_pool(next_q, self.drop_per_net)

    def loss(self, q: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_sample = quantile_huber(q, target).mean((0, 2, 3))  # [M, N, K, J] -> [N]
        return (weight * per_sample).mean(), (target.mean(-1) - q[0].detach().mean(-1)).abs()

    def actor_value(self, q: torch.Tensor) -> torch.Tensor:
        return q.mean((0, 2))


def critic_parameters(agent: QpgAgent):
    """What SAC's targets average: the critics only, the parts its TD target uses (it samples
    a' from the current actor)."""
    return agent.critics.parameters()


class ActorCriticSteps:
    """The gradient steps DDPG and SAC share, held by each as ``steps``: one Adam optimizer for
    the actor (``actor_lr``) and one for all the critics (``critic_lr``), both with beta1
    ``adam_beta1``; learning-rate annealing, steps clipped to ``max_grad_norm``, the critics'
    regression on ``values.loss`` and the actor's step through frozen critics. ``others`` are
    optimizers of the algorithm's own (SAC's temperature's) with their initial learning rates:
    annealed with these, and in their checkpoint state after them."""

    def __init__(self, agent: QpgAgent, cfg: QpgConfig, values,
                 others: tuple[tuple[torch.optim.Optimizer, float], ...] = ()) -> None:
        self.agent, self.cfg, self.values = agent, cfg, values
        self.actor_params = [*agent.actor_encoder.parameters(), *agent.actor_head.parameters()]
        self.actor_opt = adam(self.actor_params, lr=cfg.actor_lr, beta1=cfg.adam_beta1)
        self.critic_opt = adam(agent.critics.parameters(), lr=cfg.critic_lr, beta1=cfg.adam_beta1)
        # This order is the checkpoints' "optimizers" list: older checkpoints load by it.
        self.optimizers = [(self.actor_opt, cfg.actor_lr), (self.critic_opt, cfg.critic_lr), *others]

    def anneal(self, progress: float) -> float:
        """Set the learning rates for ``progress``; returns the fraction of the initial ones."""
        for opt, lr in self.optimizers:
            set_lr(opt, lr, progress, self.cfg.anneal_lr)
        return 1.0 - progress if self.cfg.anneal_lr else 1.0

    def critic_update(self, batch: Transition, q: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Critics' outputs ``q`` at the batch (with grad) towards the target atoms [N, J];
        returns (loss, q_mean, |TD| of critic 0, grad norm)."""
        loss, td_abs = self.values.loss(q, target, batch.is_weight.float())
        grad_norm = gradient_step(self.critic_opt, loss, self.agent.critics.parameters(), self.cfg.max_grad_norm)
        return loss.detach(), q[0].detach().mean(), td_abs, grad_norm

    @contextlib.contextmanager
    def critics_frozen(self):
        """While the actor's loss is computed and stepped: it differentiates through the
        critics, never into them, and reads them in eval mode (batch renorm: the running
        statistics, which a training pass over the actor's actions would also move)."""
        critics = list(self.agent.critics.parameters())
        training = self.agent.critics.training
        self.agent.critics.eval()
        for p in critics:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p in critics:
                p.requires_grad_(True)
            self.agent.critics.train(training)

    def actor_step(self, loss: torch.Tensor) -> None:
        """One step of the actor on ``loss``, inside ``critics_frozen``."""
        gradient_step(self.actor_opt, loss, self.actor_params, self.cfg.max_grad_norm)

    def optimizer_states(self) -> list[dict]:
        """Every optimizer's state, in order: a checkpoint's "optimizers"."""
        return [opt.state_dict() for opt, _ in self.optimizers]

    def load_optimizer_states(self, states: list[dict]) -> None:
        for (opt, _), saved in zip(self.optimizers, states):
            opt.load_state_dict(saved)


def report(names: tuple[str, ...], values: list[torch.Tensor], td_abs: torch.Tensor, lr_frac: float) -> Update:
    """An update's diagnostics as floats (one host sync), td_abs_mean (|TD| of critic 0, as DQN
    reports it) and lr_frac among them, and the new priorities."""
    means = torch.stack([*(v.float() for v in values), td_abs.float().mean()]).tolist()
    stats = dict(zip((*names, "td_abs_mean"), means))
    stats["lr_frac"] = lr_frac
    return Update(stats, td_abs.float().cpu().numpy())


class DDPG(TargetNetworkAlgo):
    """DDPG, or TD3 with a ``TD3Config``: ``update(batch, progress)`` is one critic step and,
    every ``policy_delay`` of them, one actor step and a Polyak move of the targets."""

    def __init__(self, agent: DeterministicAgent, cfg: DDPGConfig = DDPGConfig()) -> None:
        super().__init__(agent)
        self.cfg, self.values = cfg, ScalarCritics()
        self.steps = ActorCriticSteps(agent, cfg, self.values)
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
        frac = self.steps.anneal(progress)
        with torch.no_grad():
            target_q = self.target.q(batch.bootstrap_observation, self.target_action(batch.bootstrap_observation))
            target_value = (batch.return_.float()[:, None]
                            + batch.bootstrap_discount.float()[:, None] * self.values.target(target_q))
        q = self.agent.q(batch.observation, self.agent.to_unit(batch.action))
        critic_loss, q_mean, td_abs, grad_norm = self.steps.critic_update(batch, q, target_value)
        self.updates += 1
        if self.updates % self.cfg.policy_delay == 0:
            with self.steps.critics_frozen():
                actor_loss = -self.agent.q(batch.observation, self.agent.policy(batch.observation))[0].mean()
                self.steps.actor_step(actor_loss)
            self.last_actor_loss = actor_loss.detach()
            self.update_target(self.cfg.tau)
        return report(("critic_loss", "actor_loss", "q_mean", "target_mean", "critic_grad_norm"),
                      [critic_loss, self.last_actor_loss, q_mean, target_value.mean(), grad_norm], td_abs, frac)

    def state_dict(self) -> dict:
        """Target networks, update count and optimizers, for checkpoints (the agent is saved
        separately)."""
        return {**super().state_dict(), "optimizers": self.steps.optimizer_states()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.steps.load_optimizer_states(state["optimizers"])


class SAC(TargetNetworkAlgo):
    """SAC: ``update(batch, progress)`` is one step of the critics and, every ``policy_delay``
    of them, of the actor and (when learned) the temperature; then a Polyak move of the target
    critics. ``values`` is the critics' kind (``ScalarCritics``, or ``TruncatedQuantiles``:
    TQC); ``cfg.target_networks = false`` bootstraps from the critics themselves (CrossQ)."""

    def __init__(self, agent: SacAgent, cfg: SACConfig = SACConfig(), values=ScalarCritics()) -> None:
        super().__init__(agent, critic_parameters, cfg.target_networks)
        self.cfg, self.values = cfg, values
        self.target_entropy = -float(agent.action_dim) if cfg.target_entropy is None else cfg.target_entropy
        self.log_alpha = torch.tensor(float(cfg.init_alpha), device=agent.device).log().requires_grad_(cfg.learn_alpha)
        self.alpha_opt = adam([self.log_alpha], lr=cfg.alpha_lr)
        self.steps = ActorCriticSteps(agent, cfg, values, others=((self.alpha_opt, cfg.alpha_lr),))
        zero = torch.zeros((), device=agent.device)
        self.last_actor = (zero, zero)  # (loss, entropy) of the last actor step, reported between delayed ones

    def q_and_next_q(self, batch: Transition, next_action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The critics at the batch's state-actions, with grad, and at (s', ``next_action``),
        without: [n, N] each (quantiles [n, N, K]). The next ones come from the target critics;
        without target networks from the critics themselves, in training mode, in one forward
        pass over the 2N rows of both (CrossQ: module doc)."""
        agent = self.agent
        action = agent.to_unit(batch.action)
        if self.target is not None:
            with torch.no_grad():
                next_q = self.target.q(batch.bootstrap_observation, next_action)
            return agent.q(batch.observation, action), next_q
        agent.critics.train()
        both = zip_map(lambda s, s_next: torch.cat([s, s_next]), batch.observation, batch.bootstrap_observation)
        q, next_q = agent.q(both, torch.cat([action, next_action])).chunk(2, dim=1)
        return q, next_q.detach()

    def update(self, batch: Transition, progress: float) -> Update:
        """One update on N transitions (torch tensors on the agent's device). Returns floats
        critic_loss, actor_loss and entropy (-mean log pi) of the last actor step, alpha,
        q_mean, target_mean, critic_grad_norm, td_abs_mean, lr_frac; and the new priorities [N]."""
        frac = self.steps.anneal(progress)
        agent = self.agent
        alpha = self.log_alpha.detach().exp()
        with torch.no_grad(), agent.actor_mode(False):  # batch renorm: the running statistics, as sb3-contrib
            next_action, next_log_prob = agent.sample(batch.bootstrap_observation)
        q, next_q = self.q_and_next_q(batch, next_action)
        with torch.no_grad():
            soft = self.values.target(next_q) - alpha * next_log_prob[:, None]  # [N, atoms]
            target_value = batch.return_.float()[:, None] + batch.bootstrap_discount.float()[:, None] * soft
        critic_loss, q_mean, td_abs, grad_norm = self.steps.critic_update(batch, q, target_value)
        self.updates += 1

        if self.updates % self.cfg.policy_delay == 0:
            with self.steps.critics_frozen():
                with agent.actor_mode(True):  # batch renorm: the batch's statistics, which this pass moves
                    action, log_prob = agent.sample(batch.observation)
                actor_loss = (alpha * log_prob - self.values.actor_value(agent.q(batch.observation, action))).mean()
                self.steps.actor_step(actor_loss)
            if self.cfg.learn_alpha:
                alpha_loss = -(self.log_alpha * (log_prob.detach() + self.target_entropy)).mean()
                gradient_step(self.alpha_opt, alpha_loss, [self.log_alpha], 0.0)
            self.last_actor = (actor_loss.detach(), -log_prob.detach().mean())
        if self.target is not None:
            self.update_target(self.cfg.tau)
        return report(("critic_loss", "actor_loss", "alpha", "entropy", "q_mean", "target_mean", "critic_grad_norm"),
                      [critic_loss, self.last_actor[0], alpha, self.last_actor[1], q_mean, target_value.mean(),
                       grad_norm], td_abs, frac)

    def state_dict(self) -> dict:
        """Target critics (where there are), update count, optimizers and log(alpha), for
        checkpoints (the agent is saved separately)."""
        return {**super().state_dict(), "optimizers": self.steps.optimizer_states(),
                "log_alpha": self.log_alpha.detach().clone()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.steps.load_optimizer_states(state["optimizers"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
