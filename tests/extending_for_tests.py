"""An algorithm and an encoder from outside rlpipe's packages, as a user writes them
(docs/extending.md): a config names them as ``tests.extending_for_tests:CLIPPED_PG`` and
``tests.extending_for_tests:LayerNormEncoder``; nothing in services/ or shared/ knows them.

A clipped policy gradient in a few lines (PPO's surrogate, Schulman et al. 2017, without
value clipping or minibatches): GAE(lambda) advantages from the learned baseline V, then
``epochs`` full-batch steps on -min(r A, clip(r, 1 -+ eps) A) + value_coef (G - V)^2, where
r is the ratio of the current to the behaviour policy (``agent_info.log_prob``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shared.agents.registry import PG
from shared.algos.optim import adam, gradient_step, set_lr
from shared.algos.registry import AlgoSpec
from shared.algos.update import Update


@dataclass(frozen=True)
class ClippedPGConfig:
    lr: float = 2e-3
    """Adam learning rate at the start; it decays linearly to 0 over the run."""
    gamma: float = 0.98
    """Discount factor."""
    gae_lambda: float = 0.8
    """GAE lambda."""
    clip_eps: float = 0.2
    """Clip range of the probability ratio."""
    epochs: int = 20
    """Full-batch gradient steps a batch."""
    value_coef: float = 0.5
    """Weight of the baseline's squared error."""
    max_grad_norm: float = 0.5
    """Clip the global gradient norm to this (0 = no clipping)."""


def flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, *x.shape[2:])


class ClippedPG:
    def __init__(self, agent: nn.Module, cfg: ClippedPGConfig) -> None:
        self.agent, self.cfg = agent, cfg
        self.optimizer = adam(agent.parameters(), lr=cfg.lr, eps=1e-5)

    def advantages(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """GAE over samples [T, B]; V after a truncation is V(final_observation), after the
        segment's last step V(bootstrap_observation), after a termination 0."""
        s, cfg = batch.samples, self.cfg
        T, B = s.reward.shape
        v = self.agent.value(flat(s.observation)).reshape(T, B)
        v_final = self.agent.value(flat(s.final_observation)).reshape(T, B)
        v_next = torch.cat([v[1:], self.agent.value(batch.bootstrap_observation)[None]])
        v_next = torch.where(s.truncated, v_final, torch.where(s.terminated, 0.0, v_next))
        delta = s.reward + cfg.gamma * v_next - v
        carry = (~(s.terminated | s.truncated)).float() * cfg.gamma * cfg.gae_lambda
        adv, last = torch.empty_like(delta), torch.zeros(B, device=delta.device)
        for t in reversed(range(T)):
            last = delta[t] + carry[t] * last
            adv[t] = last
        return flat(adv), flat(adv + v)

    def update(self, batch, progress: float) -> Update:
        """``epochs`` steps on an OnPolicyBatch: samples [T, B], bootstrap_observation [B, ...]."""
        cfg, s = self.cfg, batch.samples
        set_lr(self.optimizer, cfg.lr, progress, anneal=True)
        with torch.no_grad():
            advantage, returns = self.advantages(batch)
            advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
        obs, action, old_log_prob = flat(s.observation), flat(s.action), flat(s.agent_info.log_prob)
        for _ in range(cfg.epochs):
            log_prob, _, value = self.agent.evaluate(obs, action)
            ratio = (log_prob - old_log_prob).exp()
            surrogate = torch.min(ratio * advantage, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * advantage)
            loss = -surrogate.mean() + cfg.value_coef * ((returns - value) ** 2).mean()
            grad_norm = gradient_step(self.optimizer, loss, self.agent.parameters(), cfg.max_grad_norm)
        return Update({"loss": loss.item(), "grad_norm": grad_norm.item()})

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


CLIPPED_PG = AlgoSpec("clipped_pg", ClippedPGConfig, PG, "segments", ClippedPG)


class LayerNormEncoder(nn.Module):
    """A vector observation [*L, d] -> [*L, width]: Linear, LayerNorm, tanh."""

    def __init__(self, obs_example, cfg, width: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_example.shape[-1], width), nn.LayerNorm(width), nn.Tanh())
        self.out_dim = width

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)
