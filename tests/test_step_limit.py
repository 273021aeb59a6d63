"""``env.step_timeout_s``: an env call that runs past it is interrupted and is an env failure
like one that raised (also one that swallows the interruption, which is interrupted again);
each env call has the whole limit; a recreate's close and build have it too; off, nothing is
armed; what cannot be interrupted (EnvPool's C++ threads) is refused at load."""

from __future__ import annotations

import json
import signal
import time

import numpy as np
import pytest

from shared.config import loading, schema
from shared.envs.group import EnvConfig, EnvError, EnvGroup, make_env
from tests.pipeline import CONFIGS


def sleepy(limit_s: float, **kwargs) -> EnvConfig:
    return EnvConfig(id="tests.envs_for_tests:make_sleepy_env", kwargs=json.dumps(kwargs), step_timeout_s=limit_s)


def step(group: EnvGroup, B: int, obs):
    out = dict(reward_out=np.zeros(B, np.float32), terminated_out=np.zeros(B, bool), truncated_out=np.zeros(B, bool),
               final_obs_out=np.zeros_like(obs))
    return group.step(np.zeros(B, np.int64), obs, **out), out


def test_a_step_past_the_limit_is_interrupted_and_fails_as_one_that_raised():
    B = 3
    group = EnvGroup(sleepy(0.2), B, 0)
    obs = np.zeros((B, 1), np.float32)
    group.reset(obs)
    group._envs[1].unwrapped.step_s = 60.0  # env 1 hangs (in a loop that swallows Exception)
    t0 = time.monotonic()
    with pytest.raises(EnvError) as e:
        step(group, B, obs)
    took = time.monotonic() - t0
    assert 0.2 <= took < 1.0, took
    assert e.value.env_indices == (1,) and e.value.failed_steps == (1,)
    assert "step took longer than env.step_timeout_s = 0.2 s: interrupted" in str(e.value)
    assert obs[:, 0].tolist() == [1.0, 0.0, 1.0]  # the others stepped; env 1's observation unchanged
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # disarmed after the batch
    group.recreate(1, obs)
    step(group, B, obs)  # the recreated env steps in time
    assert obs[:, 0].tolist() == [2.0, 1.0, 2.0]
    group.close()


def test_each_env_call_has_the_whole_limit_and_a_slow_reset_fails_too():
    B = 3
    group = EnvGroup(sleepy(0.25, step_s=0.15), B, 0)  # a batch takes 0.45 s, each step 0.15 s
    obs = np.zeros((B, 1), np.float32)
    group.reset(obs)
    for _ in range(2):
        step(group, B, obs)
    assert obs[:, 0].tolist() == [2.0] * B
    slow = EnvGroup(sleepy(0.2, reset_s=60.0), 2, 0)
    t0 = time.monotonic()
    with pytest.raises(EnvError, match="reset took longer than env.step_timeout_s") as e:
        slow.reset(np.zeros((2, 1), np.float32))
    assert e.value.env_indices == (0, 1) and time.monotonic() - t0 < 1.5
    group.close()
    slow.close()


def test_off_arms_nothing():
    before = signal.getsignal(signal.SIGALRM)
    group = EnvGroup(EnvConfig(id="tests.envs_for_tests:make_sleepy_env"), 2, 0)
    obs = np.zeros((2, 1), np.float32)
    group.reset(obs)
    step(group, 2, obs)
    assert group._limit is None and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before


@pytest.mark.parametrize("overrides, mentions", [
    (["env.step_timeout_s=-1"], "env.step_timeout_s: must be >= 0 seconds"),
    (["env.step_timeout_s=60", "run.watchdog_s=30"], "must be under run.watchdog_s = 30"),
    (["sampler.inference='server'", "run.watchdog_s=4"],
     "run.watchdog_s = 4: must exceed sampler.timeout_ms = 5000 (5 s, a sampler's longest wait for actions"),
    (["sampler.inference='server'", "sampler.timeout_ms=2000", "env.step_timeout_s=3", "run.watchdog_s=4"],
     "must exceed sampler.timeout_ms = 2000 (2 s, a sampler's longest wait for actions without a heartbeat) plus "
     "env.step_timeout_s = 3"),
    (["env.step_timeout_s=1", "env.backend='envpool'"], "env.backend = 'envpool' steps its envs in C++ threads"),
])
def test_a_limit_that_cannot_work_is_one_line_at_load(overrides, mentions):
    with pytest.raises(schema.ConfigError) as e:
        loading.load(CONFIGS / "cartpole_ppo.toml", overrides)
    assert mentions in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_env_that_swallows_the_interruption_is_interrupted_again_and_its_late_return_is_a_timeout():
    B = 2
    group = EnvGroup(sleepy(0.1, step_s=0.35, swallow_all=True), B, 0)  # eats StepTimeout too
    obs = np.zeros((B, 1), np.float32)
    group.reset(obs)
    with pytest.raises(EnvError) as e:
        step(group, B, obs)
    assert e.value.env_indices == (0, 1) and e.value.failed_steps == (0, 1)
    assert str(e.value).count("step took longer than env.step_timeout_s = 0.1 s: interrupted") == 2, str(e.value)
    assert all(env.unwrapped.swallowed >= 2 for env in group._envs)  # the limit stayed armed after the first
    assert obs[:, 0].tolist() == [0.0, 0.0]  # the late returns are no transitions
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    group.close()


def test_an_env_error_slow_to_describe_is_a_step_that_raised_not_an_escaping_timeout():
    group = EnvGroup(sleepy(0.1, fail_s=0.3), 1, 0)  # str() of its error outlasts the limit
    obs = np.zeros((1, 1), np.float32)
    group.reset(obs)
    with pytest.raises(EnvError, match="step raised SlowToSayError: slow to say"):
        step(group, 1, obs)
    group.close()


def test_recreate_times_the_old_envs_close_and_the_new_envs_build():
    builds = []

    def make(cfg):
        builds.append(cfg)
        if len(builds) > 1:
            time.sleep(60.0)  # the rebuild hangs
        return make_env(cfg)

    group = EnvGroup(sleepy(0.2, close_s=60.0), 1, 0, make=make)  # and so does the old env's close
    obs = np.zeros((1, 1), np.float32)
    group.reset(obs)
    t0 = time.monotonic()
    with pytest.raises(EnvError, match="after recreate: make took longer than env.step_timeout_s = 0.2 s") as e:
        group.recreate(0, obs)
    assert e.value.env_indices == (0,) and time.monotonic() - t0 < 1.5
    assert len(builds) == 2 and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
