"""Small gymnasium envs for tests/test_envs.py, loaded through EnvConfig.id = "module:callable"."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class EchoEnv(gym.Env):
    """Dict observation, Tuple action; each observation echoes the action it followed:
    pos = the Box action as received, inner.bits = the Discrete action in binary,
    inner.img = the Discrete action everywhere, count = steps so far. Reward = the
    Discrete action; the episode terminates after ``episode_len`` steps."""

    def __init__(self, episode_len: int = 1000):
        self.episode_len = episode_len
        # Keys deliberately out of order: the adapter must sort them.
        self.observation_space = spaces.Dict(
            {
                "pos": spaces.Box(-1.0, 1.0, (2,), np.float64),
                "count": spaces.Discrete(10_000),
                "inner": spaces.Dict({"img": spaces.Box(0, 255, (2, 2), np.uint8), "bits": spaces.MultiBinary(3)}),
            }
        )
        self.action_space = spaces.Tuple((spaces.Discrete(8), spaces.Box(-1.0, 1.0, (2,), np.float32)))
        self.count = 0

    def _obs(self, k: int, pos: np.ndarray) -> dict:
        bits = np.array([(k >> b) & 1 for b in range(3)], dtype=np.int8)
        img = np.full((2, 2), k, dtype=np.uint8)
        return {"pos": pos.astype(np.float64), "count": self.count, "inner": {"img": img, "bits": bits}}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.count = 0
        return self._obs(0, np.zeros(2)), {}

    def step(self, action):
        k, pos = action
        assert self.action_space.contains(action), action
        self.count += 1
        return self._obs(int(k), np.asarray(pos)), float(k), self.count >= self.episode_len, False, {}


def make_dict_env(episode_len: int = 1000) -> gym.Env:
    return EchoEnv(episode_len)


class FaultyEnv(gym.Env):
    """obs {"x": float32 [3] = (steps, seed, 0), "img": uint8 [2, 2]}; reward 1 a step.
    If reset with seed ``fail_seed``, its step number ``fail_at`` misbehaves as ``mode``
    says: "raise", "nan" (x has a NaN), "inf" / "neg_inf" (x has +inf / -inf), "shape" (x
    has 4 values), "dtype" (img is float64), "nan_reward", "inf_reward", "huge_reward" (1e16),
    "sleep" (sleeps 60 s in ``step``: a hung env)."""

    def __init__(self, fail_seed: int, fail_at: int, mode: str):
        self.fail_seed, self.fail_at, self.mode = fail_seed, fail_at, mode
        self.observation_space = spaces.Dict(
            {"x": spaces.Box(-np.inf, np.inf, (3,), np.float32), "img": spaces.Box(0, 255, (2, 2), np.uint8)}
        )
        self.action_space = spaces.Discrete(2)
        self.seed_used = -1
        self.count = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.seed_used = seed
        self.count = 0
        return self._obs(False), {}

    def _obs(self, failing: bool) -> dict:
        x = np.array([self.count, self.seed_used, 0.0], dtype=np.float32)
        img = np.zeros((2, 2), dtype=np.uint8)
        if failing and self.mode in ("nan", "inf", "neg_inf"):
            x[2] = {"nan": np.nan, "inf": np.inf, "neg_inf": -np.inf}[self.mode]
        if failing and self.mode == "shape":
            x = np.zeros(4, dtype=np.float32)
        if failing and self.mode == "dtype":
            img = img.astype(np.float64)
        return {"x": x, "img": img}

    def step(self, action):
        self.count += 1
        failing = self.seed_used == self.fail_seed and self.count == self.fail_at
        if failing and self.mode == "raise":
            raise RuntimeError("simulated emulator crash")
        if failing and self.mode == "sleep":
            time.sleep(60)
        bad = {"nan_reward": float("nan"), "inf_reward": float("inf"), "huge_reward": 1e16}
        reward = bad[self.mode] if failing and self.mode in bad else 1.0
        return self._obs(failing), reward, False, False, {}


def make_faulty_env(fail_seed: int, fail_at: int, mode: str) -> gym.Env:
    return FaultyEnv(fail_seed, fail_at, mode)


_steps_in_process = 0


class CartPoleFailingOnce(gym.Wrapper):
    """CartPole-v1 whose ``at``-th step in this process (over all its envs) returns +inf as
    its reward (``mode = "inf_reward"``), an observation with +inf (``"inf_obs"``), or sleeps
    for 60 s first (``"sleep"``: a hung step, for ``env.step_timeout_s``): once."""

    def __init__(self, mode: str, at: int):
        super().__init__(gym.make("CartPole-v1"))
        self.mode, self.at = mode, at

    def step(self, action):
        global _steps_in_process
        if _steps_in_process + 1 == self.at and self.mode == "sleep":
            _steps_in_process += 1
            time.sleep(60)
        obs, reward, terminated, truncated, info = self.env.step(action)
        _steps_in_process += 1
        if _steps_in_process == self.at:
            if self.mode == "inf_reward":
                reward = float("inf")
            elif self.mode == "inf_obs":
                obs = obs.copy()
                obs[0] = np.inf
        return obs, reward, terminated, truncated, info


def make_cartpole_failing_once(mode: str, at: int = 300) -> gym.Env:
    return CartPoleFailingOnce(mode, at)


class LivesEnv(gym.Env):
    """A game with ``lives`` lives that loses one every ``steps_per_life`` steps and pays
    ``reward`` every step; exposes lives the way ALE does (``unwrapped.ale.lives()``)."""

    def __init__(self, lives: int = 3, steps_per_life: int = 5, reward: float = 3.0):
        self.start_lives, self.steps_per_life, self.reward = lives, steps_per_life, reward
        self.observation_space = spaces.Box(0.0, np.inf, (1,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.ale = self
        self.count = 0

    def lives(self) -> int:
        return self.start_lives - self.count // self.steps_per_life

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.count = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.count += 1
        obs = np.array([self.count], np.float32)
        return obs, self.reward, self.lives() == 0, False, {}


def make_lives_env(lives: int = 3, steps_per_life: int = 5, reward: float = 3.0) -> gym.Env:
    return LivesEnv(lives, steps_per_life, reward)


class ImageCartPole(gym.Wrapper):
    """CartPole-v1 seen as {"image": uint8 [8, 8, 1], "state": float32 [4]}: the image shows
    the pole angle as a column of lit pixels, too small for the Nature CNN's kernels."""

    def __init__(self):
        super().__init__(gym.make("CartPole-v1"))
        self.observation_space = spaces.Dict({"image": spaces.Box(0, 255, (8, 8, 1), np.uint8),
                                              "state": self.env.observation_space})

    def _obs(self, state):
        image = np.zeros((8, 8, 1), np.uint8)
        image[:, int(np.clip((state[2] + 0.21) / 0.42 * 8, 0, 7)), 0] = 255
        return {"image": image, "state": state.astype(np.float32)}

    def reset(self, **kwargs):
        state, info = self.env.reset(**kwargs)
        return self._obs(state), info

    def step(self, action):
        state, reward, terminated, truncated, info = self.env.step(action)
        return self._obs(state), reward, terminated, truncated, info


def make_image_cartpole() -> gym.Env:
    return ImageCartPole()


def make_env_failing_under_supervisord() -> gym.Env:
    """CartPole, except in processes supervisord started (it sets SUPERVISOR_ENABLED): a
    service that crashes at every start while ``rlpipe launch`` itself builds the env fine."""
    import os

    if os.environ.get("SUPERVISOR_ENABLED"):
        raise RuntimeError("simulated start-up crash of a service")
    return gym.make("CartPole-v1")


def make_wrong_mask_env() -> gym.Env:
    """MaskedChoice with one action more than its ``action_mask`` has entries (a config error)."""
    from shared.envs.tasks import MaskedChoice

    env = MaskedChoice(6)
    env.action_space = spaces.Discrete(7)
    return env


class SlowToSayError(RuntimeError):
    """An error whose message takes ``s`` seconds to build (env code runs in ``str()``)."""

    def __init__(self, s: float):
        super().__init__()
        self.s = s

    def __str__(self) -> str:
        time.sleep(self.s)
        return "slow to say"


class SleepyEnv(gym.Env):
    """obs float32 [1] = steps so far; ``step`` sleeps ``step_s``, ``reset`` ``reset_s`` and
    ``close`` ``close_s``, in a loop that swallows every ``Exception`` (as careless env code does)
    or, with ``swallow_all``, every ``BaseException`` (counted in ``swallowed``). With
    ``fail_s``, a step raises an error whose message takes that long to build."""

    def __init__(self, step_s: float = 0.0, reset_s: float = 0.0, close_s: float = 0.0, swallow_all: bool = False,
                 fail_s: float = 0.0):
        self.step_s, self.reset_s, self.close_s, self.fail_s = step_s, reset_s, close_s, fail_s
        self.swallowed_types = BaseException if swallow_all else Exception
        self.swallowed = 0
        self.observation_space = spaces.Box(0.0, np.inf, (1,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.count = 0

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                time.sleep(end - time.monotonic())
            except self.swallowed_types:  # noqa: BLE001 - the point: an env that eats errors
                self.swallowed += 1

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._sleep(self.reset_s)
        self.count = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        if self.fail_s:
            raise SlowToSayError(self.fail_s)
        self._sleep(self.step_s)
        self.count += 1
        return np.array([self.count], np.float32), 1.0, False, False, {}

    def close(self):
        self._sleep(self.close_s)


def make_sleepy_env(step_s: float = 0.0, reset_s: float = 0.0, close_s: float = 0.0, swallow_all: bool = False,
                    fail_s: float = 0.0) -> gym.Env:
    return SleepyEnv(step_s, reset_s, close_s, swallow_all, fail_s)
