"""PQN (Gallici et al. 2024, "Simplifying Deep Temporal Difference Learning"): Q-learning on
on-policy segments, after CleanRL's pqn.py.

DQN without its replay buffer and target network: epsilon-greedy actors in many envs fill
the on-policy queue's [T, B] segments (the data path of PPO), the targets are Q(lambda)
returns over each segment computed once at the start of the update, and the Q-network
regresses onto them for several epochs of minibatches. A LayerNorm after each hidden layer
(``model.layer_norm``) is what keeps this stable without a target network (the paper, sec. 4).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.algos.gae import gae, recursion_ends
from shared.algos.hparams import PQNConfig
from shared.algos.optim import gradient_step, optimizer, set_lr
from shared.algos.update import Update
from shared.data.batches import OnPolicyBatch
from shared.data.namedarraytuple import map_leaves


def q_lambda_returns(reward: torch.Tensor, value: torch.Tensor, next_value: torch.Tensor, terminated: torch.Tensor,
                     done: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Peng's Q(lambda) returns G_t [T, B], as PQN trains on them; arguments as ``gae`` takes them,
    with the greedy values value[t] = max_a Q(s_t, a) and next_value[t] = max_a Q(s_{t+1}, a) of
    the same episode (value[t + 1] inside a segment, max Q of the bootstrap observation at
    t = T-1, of the final observation where step t was truncated).

        G_t = r_t + gamma [(1 - lam) next_value[t] + lam G_{t+1}]

    with the episode ends of ``gae``: after a termination G_t = r_t; where step t was truncated,
    or t = T-1, G_{t+1} is replaced by next_value[t] (no return crosses an episode boundary or
    the segment end). lam = 0 gives the one-step targets r_t + gamma max_a Q(s_{t+1}, a), lam = 1
    the discounted return bootstrapped at truncations and the segment end.

    This is GAE's lambda-return with V = max_a Q: G_t - value[t] = delta_t + gamma lam (G_{t+1} -
    value[t + 1]), delta_t = r_t + gamma next_value[t] - value[t], so it is computed by ``gae``
    (tests/test_pqn.py checks it against the recursion above).
    """
    return gae(reward, value, next_value, terminated, done, gamma, lam)[1]


def _flat(x):
    return map_leaves(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), x)


@torch.no_grad()
def batch_targets(agent, batch: OnPolicyBatch, cfg: PQNConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Q(lambda) targets and the greedy values they were computed from, both [T, B], for a batch
    on the agent's device: max_a Q (over the legal actions, with an action mask) from the current network (``recompute_values``) or the
    behaviour values stored at sampling time; at truncations max_a Q(final observation) from
    the current network."""
    s = batch.samples
    T, B = s.reward.shape
    cut = s.truncated & ~s.terminated
    if cfg.recompute_values:
        value = agent.greedy_values(_flat(s.observation)).reshape(T, B)
        bootstrap = agent.greedy_values(batch.bootstrap_observation)
    else:
        value, bootstrap = s.agent_info.value, batch.bootstrap_value
    value = value.float()
    next_value = torch.cat([value[1:], bootstrap[None].float()], dim=0)
    if bool(cut.any()):
        next_value[cut] = agent.greedy_values(s.final_observation[cut]).float()
    returns = q_lambda_returns(s.reward.float(), value, next_value, s.terminated, recursion_ends(s), cfg.gamma,
                               cfg.q_lambda)
    return returns, value


class PQN:
    """PQN on a ``QAgent``: ``update(batch, progress)`` runs epochs x minibatches optimizer steps on
    the squared error of Q(s_t, a_t) against its Q(lambda) target."""

    def __init__(self, agent: nn.Module, cfg: PQNConfig = PQNConfig()) -> None:
        self.agent = agent
        self.cfg = cfg
        self.optimizer = optimizer(cfg.optimizer, agent.parameters(), lr=cfg.lr, eps=cfg.adam_eps)

    def update(self, batch: OnPolicyBatch, progress: float) -> Update:
        """One PQN update on a [T, B] batch; ``progress`` in [0, 1] is the run's fraction done.

        Returns means over the gradient steps of loss (mean squared TD error) and grad_norm
        (before clipping), q_mean (Q of the taken actions), target_mean, lr.
        """
        cfg, agent = self.cfg, self.agent
        lr = set_lr(self.optimizer, cfg.lr, progress, cfg.anneal_lr)
        batch = map_leaves(lambda x: x.to(agent.device, non_blocking=True), batch)
        returns, _ = batch_targets(agent, batch, cfg)
        s = batch.samples
        obs, action, target = _flat(s.observation), _flat(s.action).long(), returns.reshape(-1)
        if bool(s.failed.any()):  # a failed env step is no transition (``Samples.failed``)
            real = ~s.failed.reshape(-1)
            obs, action, target = obs[real], action[real], target[real]
        n = target.shape[0]
        per_step = []
        for _ in range(cfg.epochs):
            for idx in torch.tensor_split(torch.randperm(n, device=target.device), cfg.minibatches):
                q = agent.q_values(obs[idx]).gather(-1, action[idx, None]).squeeze(-1)
                loss = (q - target[idx]).square().mean()
                grad_norm = gradient_step(self.optimizer, loss, agent.parameters(), cfg.max_grad_norm)
                per_step += (loss.detach(), q.detach().mean(), grad_norm)
        means = torch.stack(per_step).view(-1, 3).mean(0).tolist()
        stats = dict(zip(("loss", "q_mean", "grad_norm"), means))
        stats.update(target_mean=float(target.mean()), lr=lr)
        return Update(stats)

    def state_dict(self) -> dict:
        """Optimizer state, for checkpoints (the agent's parameters are saved separately)."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
