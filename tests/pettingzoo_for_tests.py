"""A PettingZoo Parallel env whose agents leave at different steps (``env.id =
"pettingzoo:tests.pettingzoo_for_tests"``), for the padding checks of tests/test_pettingzoo.py.

Agent j stays ``LIFETIMES[j]`` steps. Its observation is (step, j, seed) and its reward at step t
is ``10 * j + action``, so returns and the actions that reached the env can be read off the
outputs.
"""

from __future__ import annotations

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv

LIFETIMES = (2, 5)


class LeavingAgents(ParallelEnv):
    metadata = {"name": "leaving_agents_v0"}

    def __init__(self):
        self.possible_agents = [f"agent_{j}" for j in range(len(LIFETIMES))]
        self.agents = []
        self._seed = 0

    def observation_space(self, agent):
        return spaces.Box(-np.inf, np.inf, (3,), np.float32)

    def action_space(self, agent):
        return spaces.Discrete(3)

    def _obs(self, j: int) -> np.ndarray:
        return np.array([self.t, j, self._seed], np.float32)

    def reset(self, seed=None, options=None):
        if seed is not None:
            self._seed = seed
        self.t = 0
        self.agents = list(self.possible_agents)
        return {a: self._obs(j) for j, a in enumerate(self.possible_agents)}, {a: {} for a in self.agents}

    def step(self, actions):
        self.t += 1
        index = {a: self.possible_agents.index(a) for a in self.agents}
        rewards = {a: float(10 * index[a] + actions[a]) for a in self.agents}
        terms = {a: self.t >= LIFETIMES[index[a]] for a in self.agents}
        truncs = {a: False for a in self.agents}
        obs = {a: self._obs(index[a]) for a in self.agents}
        self.agents = [a for a in self.agents if not terms[a]]
        return obs, rewards, terms, truncs, {a: {} for a in obs}


def parallel_env():
    return LeavingAgents()
