"""rlpipe's own test tasks, registered with gymnasium under the ``rlpipe/`` namespace.

- ``rlpipe/CartPoleNoVel-v1``: CartPole-v1 with the velocity components removed from the
  observation (cart position and pole angle only), a partially observable task: a policy
  must infer the velocities from the observations it has seen, so memory is what solves it
  (the standard POMDP check of recurrent agents, e.g. in rl-baselines-zoo and SB3-contrib).
  Same dynamics, reward and 500-step limit as CartPole-v1.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control import CartPoleEnv

POSITION_AND_ANGLE = [0, 2]


class KeepIndices(gym.ObservationWrapper):
    """Keeps the observation entries ``indices`` of a 1-D Box observation."""

    def __init__(self, env: gym.Env, indices: list[int]):
        super().__init__(env)
        self.indices = np.asarray(indices)
        box = env.observation_space
        self.observation_space = gym.spaces.Box(box.low[self.indices], box.high[self.indices], dtype=box.dtype)

    def observation(self, observation):
        return observation[self.indices]


def cartpole_no_velocity(**kwargs) -> gym.Env:
    return KeepIndices(CartPoleEnv(**kwargs), POSITION_AND_ANGLE)


def register() -> None:
    """Register the tasks (idempotent)."""
    if "rlpipe/CartPoleNoVel-v1" not in gym.registry:
        gym.register("rlpipe/CartPoleNoVel-v1", entry_point="shared.envs.tasks:cartpole_no_velocity",
                     max_episode_steps=500, reward_threshold=475.0)
