"""A PettingZoo Parallel env whose two kinds of agents must act differently on the same
information (``env.id = "pettingzoo:tests.groups_for_tests"``), for tests/test_agent_groups.py.

Agents ``left_0``, ``left_1`` and ``right_0`` all see the same thing, the episode's progress;
each step a left agent earns 1 for action 0 and a right agent 1 for action 1, so one shared policy
without the agent's identity earns at most 2 of the 3 points a step, and a policy per group all 3.
Episodes last ``STEPS`` steps.
"""

from __future__ import annotations

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv

STEPS = 8
AGENTS = ("left_0", "left_1", "right_0")


class TwoKinds(ParallelEnv):
    metadata = {"name": "two_kinds_v0"}

    def __init__(self):
        self.possible_agents = list(AGENTS)
        self.agents = []

    def observation_space(self, agent):
        return spaces.Box(0.0, 1.0, (1,), np.float32)

    def action_space(self, agent):
        return spaces.Discrete(2)

    def _obs(self, agent: str) -> np.ndarray:
        return np.array([self.t / STEPS], np.float32)

    def reset(self, seed=None, options=None):
        self.t = 0
        self.agents = list(self.possible_agents)
        return {a: self._obs(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        self.t += 1
        rewards = {a: float(actions[a] == (0 if a.startswith("left") else 1)) for a in self.agents}
        over = self.t >= STEPS
        obs = {a: self._obs(a) for a in self.agents}
        dones = {a: over for a in self.agents}
        truncs = {a: False for a in self.agents}
        if over:
            self.agents = []
        return obs, rewards, dones, truncs, {a: {} for a in obs}


def parallel_env():
    return TwoKinds()
