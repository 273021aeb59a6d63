"""A two-player turn-based PettingZoo game that is not zero-sum (``env.id =
"pettingzoo:tests.cooperative_game_for_tests"``): two agents take turns for four moves and both
get +1 at the end, so a self-play pool is refused for it (tests/test_selfplay_pool.py)."""

from __future__ import annotations

import numpy as np
from gymnasium import spaces
from pettingzoo import AECEnv

MOVES = 4


class CooperativeGame(AECEnv):
    metadata = {"name": "cooperative_game_v0"}

    def __init__(self):
        super().__init__()
        self.possible_agents = ["player_0", "player_1"]

    def observation_space(self, agent):
        return spaces.Dict({"observation": spaces.Box(0.0, 1.0, (2,), np.float32),
                            "action_mask": spaces.Box(0, 1, (2,), np.int8)})

    def action_space(self, agent):
        return spaces.Discrete(2)

    def observe(self, agent):
        return {"observation": np.zeros(2, np.float32), "action_mask": np.ones(2, np.int8)}

    def reset(self, seed=None, options=None):
        self.agents = list(self.possible_agents)
        self.rewards = {a: 0.0 for a in self.agents}
        self._cumulative_rewards = {a: 0.0 for a in self.agents}
        self.terminations = {a: False for a in self.agents}
        self.truncations = {a: False for a in self.agents}
        self.infos = {a: {} for a in self.agents}
        self.agent_selection = self.agents[0]
        self.moves = 0

    def step(self, action):
        if self.terminations[self.agent_selection] or self.truncations[self.agent_selection]:
            self._was_dead_step(action)
            return
        self.moves += 1
        done = self.moves >= MOVES
        for a in self.agents:
            self.rewards[a] = 1.0 if done else 0.0
            self.terminations[a] = done
        self.agent_selection = self.agents[self.moves % 2]
        self._accumulate_rewards()


def env():
    return CooperativeGame()
