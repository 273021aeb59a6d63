"""Deep Q-learning on n-step transitions: DQN (Mnih et al. 2015) and its variants by parameter.

- ``double``: the online net picks a* at the bootstrap observation, the target net
  evaluates it (van Hasselt et al. 2016); otherwise the target net does both.
- a distributional agent (``QAgentConfig.distributional``) gets the C51 loss: cross-entropy
  between the online distribution of the taken action and the projected target
  distribution (Bellemare et al. 2017); an agent with a quantile head (``algo.name =
  "qr_dqn"`` or ``"iqn"``) gets the quantile Huber loss of its quantiles of the taken action
  against the target's quantiles, each shifted by r + gamma^m z (QR-DQN, Dabney et al. 2017:
  fixed fractions; IQN, Dabney et al. 2018: N online and N' target fractions drawn afresh per
  item); a scalar one gets the Huber (or squared) TD loss. Bootstrap actions maximise the
  expectation (C51) or the mean of the quantiles, over the actions legal at the bootstrap
  observation when the agent has an action mask (``shared.agents.masking``).
- replay supplies n-step returns, bootstrap discounts (gamma^m, 0 after a termination) and
  importance weights, so one update covers 1- and n-step, uniform and prioritized replay.
  With a dueling, distributional agent, double = True, n-step prioritized replay this is
  Rainbow without noisy nets (Hessel et al. 2018).

Only the target can be replaced: ``DQN(agent, cfg, td_target=f)`` trains a scalar Q head
towards ``f(dqn, batch)`` [N] instead of ``q_learning_target`` (docs/extending.md: a
Munchausen-DQN in a few lines); everything else (loss, priorities, target network, schedule)
stays DQN's.

Like Acme's learning_lib, ``update`` returns new priorities with its diagnostics and never
writes to replay itself: |TD error| per item, for C51 the per-item KL divergence of the
online from the target distribution (the Rainbow paper, rlpyt; ``c51_priority = "cross_entropy"``
returns the loss itself, as Dopamine does), for QR-DQN and IQN the item's quantile Huber loss.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from shared.algos.distributional import project_distribution
from shared.algos.hparams import DQNConfig
from shared.algos.optim import adam, gradient_step, set_lr
from shared.algos.quantiles import quantile_huber
from shared.algos.target import TargetNetworkAlgo
from shared.algos.update import Update
from shared.agents.masking import masked_argmax
from shared.agents.q import QAgent
from shared.data.batches import Transition


def q_learning_target(dqn: "DQN", batch: Transition) -> torch.Tensor:
    """The (double) Q-learning target of a scalar Q head, [N] f32: return_ + bootstrap_discount *
    Q'(s', a*), with a* the bootstrap action (``DQN.bootstrap_action``) and Q' the target network.
    Called without gradients."""
    target_q = dqn.target.q_values(batch.bootstrap_observation)  # [N, A]
    a_star = dqn.bootstrap_action(target_q, batch.bootstrap_observation)
    next_q = target_q.gather(-1, a_star[:, None]).squeeze(-1)
    return batch.return_.float() + batch.bootstrap_discount.float() * next_q


class DQN(TargetNetworkAlgo):
    """Q-learning on a ``QAgent``: ``update(batch, progress)`` is one Adam step on one batch,
    with the target network Polyak-averaged (``target_tau``) every ``target_update_period`` updates.

    ``td_target(dqn, batch) -> [N]`` replaces the TD target of a scalar Q head (default
    ``q_learning_target``); it is called without gradients and may read ``dqn.target`` (the
    target network), ``dqn.agent`` and ``dqn.cfg``.
    """

    def __init__(self, agent: QAgent, cfg: DQNConfig = DQNConfig(),
                 td_target: Callable[["DQN", Transition], torch.Tensor] = q_learning_target) -> None:
        if td_target is not q_learning_target and (agent.cfg.distributional or agent.quantile_head is not None):
            raise ValueError("DQN(td_target=...): a TD target replaces a scalar Q head's only; this agent has a "
                             "distributional or quantile head (set agent.distributional = false)")
        super().__init__(agent)
        self.cfg, self.td_target = cfg, td_target
        self.optimizer = adam(agent.parameters(), lr=cfg.lr, eps=cfg.adam_eps)

    def bootstrap_action(self, target_q: torch.Tensor, bootstrap_observation) -> torch.Tensor:
        """a* [N] at the bootstrap observation: argmax of the online net (double) or the target's,
        over the actions legal there (the agent's action mask, if it has one)."""
        q = self.agent.q_values(bootstrap_observation) if self.cfg.double else target_q
        return masked_argmax(q, self.agent.legal_actions(bootstrap_observation))

    def _fractions(self, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The quantile fractions of the loss: IQN's, fresh U(0, 1) draws for the online [n, N]
        and target [n, N'] quantiles (``IQNConfig``); QR-DQN's head has fixed ones (None, None)."""
        if not self.agent.quantile_head.implicit:
            return None, None
        device = self.agent.device
        return torch.rand(n, self.cfg.n_taus, device=device), torch.rand(n, self.cfg.n_target_taus, device=device)

    def update(self, batch: Transition, progress: float) -> Update:
        """One gradient step on a batch of N transitions (torch tensors on the agent's device).

        ``progress`` in [0, 1] is the run's fraction done (learning-rate annealing). Returns
        floats loss (IS-weighted mean), q_mean (online Q of the taken actions), target_mean,
        td_abs_mean (|target - Q|; for C51 and quantiles between expectations), grad_norm (before
        clipping), lr; and the new priorities, numpy float32 [N] >= 0, for the replay table.
        """
        cfg, agent = self.cfg, self.agent
        lr = set_lr(self.optimizer, cfg.lr, progress, cfg.anneal_lr)
        action = batch.action.long()
        rows = torch.arange(action.shape[0], device=action.device)
        returns, discount = batch.return_.float(), batch.bootstrap_discount.float()

        if agent.cfg.distributional:
            support = agent.support
            with torch.no_grad():
                target_probs = self.target.dist(batch.bootstrap_observation).exp()  # [N, A, atoms]
                a_star = self.bootstrap_action((target_probs * support).sum(-1), batch.bootstrap_observation)
                target = project_distribution(target_probs[rows, a_star], returns, discount, support)
            log_probs = agent.dist(batch.observation)[rows, action]  # [N, atoms]
            per_item = -(target * log_probs).sum(-1)
            q_taken = (log_probs.detach().exp() * support).sum(-1)
            target_value = (target * support).sum(-1)
            td_abs = (target_value - q_taken).abs()
            if cfg.c51_priority == "kl":  # cross-entropy minus the target's entropy (0 log 0 = 0)
                priorities = per_item.detach() + torch.special.xlogy(target, target).sum(-1)
            else:
                priorities = per_item.detach()
            priorities = priorities.clamp(min=0.0)  # rounding can take a KL of ~0 below it
        elif agent.quantile_head is not None:
            online_taus, target_taus = self._fractions(action.shape[0])
            with torch.no_grad():
                target_z, _ = self.target.quantiles(batch.bootstrap_observation, target_taus)  # [N, A, T']
                a_star = self.bootstrap_action(target_z.mean(-1), batch.bootstrap_observation)
                target = returns[:, None] + discount[:, None] * target_z[rows, a_star]  # [N, T']
            z, taus = agent.quantiles(batch.observation, online_taus)
            z_taken = z[rows, action]  # [N, T]
            per_item = quantile_huber(z_taken, target, cfg.huber_delta, taus).mean(-1).sum(-1)
            q_taken = z_taken.detach().mean(-1)
            target_value = target.mean(-1)
            td_abs = (target_value - q_taken).abs()
            priorities = per_item.detach()
        else:
            with torch.no_grad():
                target_value = self.td_target(self, batch)
            q_taken = agent.q_values(batch.observation)[rows, action]
            if cfg.huber_delta > 0:
                per_item = F.huber_loss(q_taken, target_value, reduction="none", delta=cfg.huber_delta)
            else:
                per_item = 0.5 * (q_taken - target_value) ** 2
            td_abs = (target_value - q_taken.detach()).abs()
            priorities = td_abs

        loss = (batch.is_weight.float() * per_item).mean()
        grad_norm = gradient_step(self.optimizer, loss, agent.parameters(), cfg.max_grad_norm)
        self.count_update(cfg.target_update_period, cfg.target_tau)

        values = torch.stack([loss, q_taken.mean(), target_value.mean(), td_abs.mean(), grad_norm]).detach().tolist()
        stats = dict(zip(("loss", "q_mean", "target_mean", "td_abs_mean", "grad_norm"), values))
        stats["lr"] = lr
        return Update(stats, priorities.float().cpu().numpy())

    def state_dict(self) -> dict:
        return {**super().state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.optimizer.load_state_dict(state["optimizer"])
