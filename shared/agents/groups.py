"""Separate networks per agent group (``env.groups``): an agent holds one identically built
member a group (an ``nn.ModuleList``) and routes each row of a batch to its group's member by
the observation's ``agent_group`` leaf, which no network reads as a feature.

Every member runs on all rows and ``routed`` keeps, for each row, its own group's output: K is
small (the kinds of agents in an env), the shapes stay fixed (no data-dependent indexing, so the
forward pass exports), and ``torch.where`` sends a row's gradient to its group's member only. So
the algorithm, its one optimizer, the parameter segment and checkpoints see one module as ever.

A recurrent agent's state is routed the same way. The agent keeps one acting memory, and a
column's state in it is its own group's member's; every member steps all rows from it and each
row keeps its own member's new state, which is what goes into the agent info. A sequence in the
learner starts every member from the stored state, so each row's member starts from its own
state; the other members' outputs on that row, computed from a state not theirs, are dropped by
the routing. A column is one agent, so its group, and the member whose state it carries, never
changes.
"""

from __future__ import annotations

import gymnasium as gym
import torch

from shared.envs.pettingzoo_backend import GROUP_KEY


def group_count(obs_space: gym.Space | None) -> int:
    """K, the agent groups of an observation space with an ``agent_group`` leaf (``Discrete(K)``), else 0."""
    if isinstance(obs_space, gym.spaces.Dict) and GROUP_KEY in obs_space.spaces:
        return int(obs_space.spaces[GROUP_KEY].n)
    return 0


def members(groups: int, make) -> torch.nn.ModuleList:
    """K members built by ``make()``."""
    return torch.nn.ModuleList(make() for _ in range(groups))


def routed(outs: list[torch.Tensor], group: torch.Tensor) -> torch.Tensor:
    """Each row's own group's output: ``outs`` K tensors alike [*L, ...] (member k's on every row),
    ``group`` int [*L] -> [*L, ...], row r from ``outs[group[r]]``."""
    group = group.reshape(*group.shape, *(1,) * (outs[0].dim() - group.dim()))
    out = outs[0]
    for k, other in enumerate(outs[1:], start=1):
        out = torch.where(group == k, other, out)
    return out
