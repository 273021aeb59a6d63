"""Atari (ALE) wrappers: the DQN preprocessing of Mnih et al. (2015) as gymnasium wrappers.

``shared.envs.group`` composes them (inner to outer)::

    ALE env (frameskip=1) -> preprocess() -> [TimeLimit] -> EpisodeTracker
        -> [EpisodicLife] -> FireReset (games with FIRE) -> sign reward -> frame stack 4

so the frame stack is channels-first ``[4, 84, 84]`` uint8 (the PyTorch conv layout), a
training "episode" ends at each life lost when episodic life is on, and the tracker under
the reward clipping and episodic life sees the true game score and game length.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
from gymnasium.wrappers import AtariPreprocessing

NOOP, FIRE, RIGHT = 0, 1, 2


def preprocess(env: gym.Env) -> gym.Env:
    """Noop reset (1..30 no-ops), frame skip 4 with max-pool over the last 2 frames, 84x84
    grayscale uint8 ``[84, 84]``. ``env`` must be an ALE env made with ``frameskip=1``."""
    return AtariPreprocessing(
        env, noop_max=30, frame_skip=4, screen_size=84, terminal_on_life_loss=False, grayscale_obs=True
    )


def is_ale(env: gym.Env) -> bool:
    """True for an ALE env (it has an emulator we can read lives and screens from)."""
    return hasattr(env.unwrapped, "ale")


def needs_fire_reset(env: gym.Env) -> bool:
    """Games that wait for FIRE to start (Breakout, Pong…): action 1 means FIRE."""
    meanings = env.unwrapped.get_action_meanings()
    return len(meanings) >= 3 and meanings[FIRE] == "FIRE"


class EpisodicLife(gym.Wrapper):
    """Ends the training episode (``terminated=True``) at each life lost; resets the game
    only at real game over, otherwise continues it with one no-op step (DQN's "episodic
    life", as in baselines/SB3). Reads lives from ``env.unwrapped.ale.lives()``."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self._lives = 0
        self._game_over = True

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._game_over = bool(terminated or truncated)
        lives = self.env.unwrapped.ale.lives()
        if 0 < lives < self._lives:
            terminated = True
        self._lives = lives
        return obs, reward, terminated, truncated, info

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if self._game_over or seed is not None:
            obs, info = self.env.reset(seed=seed, options=options)
        else:
            obs, _, terminated, truncated, info = self.env.step(NOOP)
            if terminated or truncated:
                obs, info = self.env.reset(options=options)
        self._game_over = False
        self._lives = self.env.unwrapped.ale.lives()
        return obs, info


class FireReset(gym.Wrapper):
    """Presses FIRE (then RIGHT, as baselines does) after each reset, so games that wait for
    FIRE start; above EpisodicLife it also relaunches after each life lost."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        obs, info = self.env.reset(seed=seed, options=options)
        for action in (FIRE, RIGHT):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset(options=options)
        return obs, info
