"""Target networks: a frozen copy of the agent that follows it by hard copies or Polyak averaging.

``TargetNetworkAlgo`` is the base of every built-in algorithm that bootstraps from a target
network (DQN and its variants, R2D1, DDPG, TD3, SAC, TQC; CrossQ has none) and the public one
for an algorithm of your own (docs/extending.md, "An off-policy algorithm"). It owns the copy,
the update count and their checkpoint; the optimizers stay with the algorithm.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterable

import torch
from torch import nn


def all_parameters(agent: nn.Module) -> Iterable[torch.Tensor]:
    """The default of what a target averages: every parameter of the agent."""
    return agent.parameters()


class TargetNetworkAlgo:
    """``self.agent`` (the online agent), ``self.target`` (its deep copy, without gradients, so it
    has the same heads, C51 support, recurrent core and observation normaliser; None without
    target networks) and ``self.updates`` (updates counted by ``count_update``).

    ``averaged(agent)`` lists the parameters the target follows (SAC: the critics only, the
    parts its TD target uses); the others stay as copied at the start. Buffers (an
    observation normaliser's statistics, batch-norm statistics) are copied at every target
    update, never averaged: the target normalises as the agent does.
    """

    def __init__(self, agent: nn.Module, averaged: Callable[[nn.Module], Iterable[torch.Tensor]] = all_parameters,
                 target_network: bool = True) -> None:
        self.agent = agent
        self.target = copy.deepcopy(agent).requires_grad_(False) if target_network else None
        self.updates = 0
        # Listed once: SAC moves its targets at every update.
        self._averaged = [] if self.target is None else list(zip(averaged(self.target), averaged(agent)))
        self._copied = [] if self.target is None else list(zip(self.target.buffers(), agent.buffers()))

    @torch.no_grad()
    def update_target(self, tau: float = 1.0) -> None:
        """target <- tau * online + (1 - tau) * target for the averaged parameters (tau = 1: a
        hard copy, exact); buffers are copied."""
        for t, o in self._averaged:
            if tau < 1.0:
                t.lerp_(o, tau)
            else:
                t.copy_(o)
        for t, o in self._copied:
            t.copy_(o)

    def count_update(self, target_period: int = 1, tau: float = 1.0) -> None:
        """One update done: the count goes up and, every ``target_period`` updates, the target
        follows (``update_target(tau)``)."""
        self.updates += 1
        if self.target is not None and self.updates % target_period == 0:
            self.update_target(tau)

    def state_dict(self) -> dict:
        """The update count and the target network (where there is one), for checkpoints; the
        agent is saved separately, an algorithm adds its optimizers."""
        state = {"updates": self.updates}
        if self.target is not None:
            state["target"] = self.target.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.target is not None:
            self.target.load_state_dict(state["target"])
        self.updates = int(state["updates"])
