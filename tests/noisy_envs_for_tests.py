"""A user's env module that prints when it is imported, as research code often does, and whose
env steps slowly (a simulator): the watchdog imports it too (it loads the run's config), and
its listener protocol is on stdout (tests/test_watchdog.py)."""

from __future__ import annotations

import time

import gymnasium as gym

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
