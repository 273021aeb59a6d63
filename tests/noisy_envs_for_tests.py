"""A user's module that prints when it is imported, as research code often does, whose env steps
slowly (a simulator) and which names the run's algorithm (``PPO``, the built-in one): the
watchdog imports it too, as it loads the run's config (which resolves the algorithm; the env is
checked at launch only), and its listener protocol is on stdout (tests/test_watchdog.py)."""

from __future__ import annotations

import time

import gymnasium as gym

from shared.algos import registry

print("noisy_envs_for_tests: imported (a line on stdout)")


class SlowCartPole(gym.Wrapper):
    """CartPole-v1 whose every step takes ``step_s`` seconds more."""

    def __init__(self, step_s: float):
        super().__init__(gym.make("CartPole-v1"))
        self.step_s = step_s

    def step(self, action):
        time.sleep(self.step_s)
        return self.env.step(action)


def make_slow_cartpole(step_s: float = 0.04) -> gym.Env:
    return SlowCartPole(step_s)


PPO = registry.resolve("ppo")
