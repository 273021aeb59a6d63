"""Two envs of the same cost an agent-step, for tests/bench/test_multiagent_sampling.py: a
PettingZoo Parallel env of ``agents`` agents (``env.id = "pettingzoo:tests.busy_agents_for_tests"``)
and a single-agent gymnasium env (``env.id = "tests.busy_agents_for_tests:make_single"``).
Each agent-step spins ``cost_us`` microseconds (an env's own work: a simulator's step), observes
8 floats and ends its episode after ``length`` steps, so N columns cost the same either way and
what differs is only how the sampler steps them."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv

OBS = spaces.Box(-np.inf, np.inf, (8,), np.float32)
ACTIONS = spaces.Discrete(2)


def spin(cost_us: float) -> None:
    end = time.perf_counter() + cost_us * 1e-6
    while time.perf_counter() < end:
        pass


class BusyAgents(ParallelEnv):
    metadata = {"name": "busy_agents_v0"}

    def __init__(self, agents: int = 4, cost_us: float = 50.0, length: int = 100):
        self.possible_agents = [f"agent_{j}" for j in range(agents)]
        self.agents, self.cost_us, self.length, self.t = [], cost_us, length, 0
        self.obs = np.zeros(8, np.float32)

    def observation_space(self, agent):
        return OBS

    def action_space(self, agent):
        return ACTIONS

    def reset(self, seed=None, options=None):
        self.t, self.agents = 0, list(self.possible_agents)
        return {a: self.obs for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        for _ in self.agents:
            spin(self.cost_us)
        self.t += 1
        done = self.t >= self.length
        out = {a: self.obs for a in self.agents}, {a: 1.0 for a in self.agents}, \
            {a: done for a in self.agents}, {a: False for a in self.agents}, {a: {} for a in self.agents}
        if done:
            self.agents = []
        return out


def parallel_env(**kwargs):
    return BusyAgents(**kwargs)


class BusyEnv(gym.Env):
    observation_space, action_space = OBS, ACTIONS

    def __init__(self, cost_us: float = 50.0, length: int = 100):
        self.cost_us, self.length, self.t = cost_us, length, 0
        self.obs = np.zeros(8, np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.obs, {}

    def step(self, action):
        spin(self.cost_us)
        self.t += 1
        return self.obs, 1.0, self.t >= self.length, False, {}


def make_single(cost_us: float = 50.0, length: int = 100):
    return BusyEnv(cost_us, length)
