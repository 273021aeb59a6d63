"""rlpipe's own test tasks, registered with gymnasium under the ``rlpipe/`` namespace.

- ``rlpipe/CartPoleNoVel-v1``: CartPole-v1 with the velocity components removed from the
  observation (cart position and pole angle only), a partially observable task: a policy
  must infer the velocities from the observations it has seen, so memory is what solves it
  (the standard POMDP check of recurrent agents, e.g. in rl-baselines-zoo and SB3-contrib).
  Same dynamics, reward and 500-step limit as CartPole-v1.
- ``rlpipe/MaskedChoice-v0``: action masking's check (``MaskedChoice``), a task where
  illegal actions are common and costly: each step about half of the actions are illegal,
  and taking one ends the episode with a penalty.
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


class MaskedChoice(gym.Env):
    """Each step one of ``n_actions`` actions is the target, cued one-hot in ``cue``; every action
    (the target too) is legal with probability ``p_legal`` (one at random if that leaves none),
    as the observation's ``action_mask`` (MultiBinary) says. Reward: +1 for the target, 0 for
    another legal action; an illegal action costs ``penalty`` and terminates the episode.
    Registered with a 16-step limit: a policy that never plays an illegal action has episodes
    of exactly 16 steps, the best one (the target when it is legal, else any legal action) a
    return of ~8. Masked, "prefer the target" is all there is to learn; unmasked, a policy
    must also read from the mask when the target is illegal and what else is legal."""

    def __init__(self, n_actions: int = 6, p_legal: float = 0.5, penalty: float = 1.0):
        self.n_actions, self.p_legal, self.penalty = n_actions, p_legal, penalty
        self.observation_space = gym.spaces.Dict({"cue": gym.spaces.Box(0.0, 1.0, (n_actions,), np.float32),
                                                  "action_mask": gym.spaces.MultiBinary(n_actions)})
        self.action_space = gym.spaces.Discrete(n_actions)

    def _draw(self) -> dict:
        self.target = int(self.np_random.integers(self.n_actions))
        self.legal = self.np_random.random(self.n_actions) < self.p_legal
        if not self.legal.any():
            self.legal[self.np_random.integers(self.n_actions)] = True
        cue = np.zeros(self.n_actions, np.float32)
        cue[self.target] = 1.0
        return {"cue": cue, "action_mask": self.legal.astype(np.int8)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._draw(), {}

    def step(self, action):
        action = int(action)
        if not self.legal[action]:
            return self._draw(), -self.penalty, True, False, {"illegal": True}
        reward = float(action == self.target)
        return self._draw(), reward, False, False, {}


def register() -> None:
    """Register the tasks (idempotent)."""
    if "rlpipe/CartPoleNoVel-v1" not in gym.registry:
        gym.register("rlpipe/CartPoleNoVel-v1", entry_point="shared.envs.tasks:cartpole_no_velocity",
                     max_episode_steps=500, reward_threshold=475.0)
    if "rlpipe/MaskedChoice-v0" not in gym.registry:
        gym.register("rlpipe/MaskedChoice-v0", entry_point="shared.envs.tasks:MaskedChoice", max_episode_steps=16)
