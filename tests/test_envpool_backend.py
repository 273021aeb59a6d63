"""The EnvPool backend (``env.backend = "envpool"``): EnvGroup's contract over random actions and
episode ends (CartPole against gymnasium's dynamics, Pong's frame stacks and truncations), true
returns under reward clipping, seeding, env failures, config errors, R2D1 sequences of its
frames, and short runs through the real pipeline.

The contract tests shared with the gymnasium backend run on both in tests/test_envs.py, the
frame store's in tests/test_frame_store.py."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.agents.config import ModelConfig, info_example
from shared.config import loading, schema
from shared.data.layout import step_example
from shared.data.namedarraytuple import buffer_from_example, from_spec, spec_of, with_leading_dims
from shared.envs.backends import make_env_group, validate_env_config
from shared.envs.envpool_backend import EnvPoolGroup
from shared.envs.group import EnvConfig, EnvError
from shared.replay.sequences import SequenceStorage, SequenceStorageConfig
from tests.pipeline import CONFIGS
from tests.test_envs import Buffers

envpool = pytest.importorskip("envpool")

PONG = EnvConfig(id="ALE/Pong-v5", kwargs='{"repeat_action_probability": 0.0}', wrappers=("atari",), backend="envpool")


def cartpole_at(state: np.ndarray, max_episode_steps: int) -> gym.Env:
    """gymnasium's CartPole-v1 put in ``state`` (EnvPool's CartPole has its dynamics, not its start states)."""
    env = gym.make("CartPole-v1", max_episode_steps=max_episode_steps)
    env.reset(seed=0)
    env.unwrapped.state = state.astype(np.float64)
    return env


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 4), limit=st.sampled_from([0, 9, 23]), seed=st.integers(0, 2**16))
def test_cartpole_steps_like_gymnasium_over_random_actions_and_episode_ends(B, limit, seed):
    """Every env follows gymnasium's CartPole from the state EnvPool started it in: observations,
    rewards, terminated vs truncated, final observations, the next episode's first observation in
    the same step, and (return, length) of each game in env-index order."""
    group = make_env_group(EnvConfig(max_episode_steps=limit, backend="envpool"), B, seed)
    buf = Buffers(group)
    group.reset(buf.obs)
    refs = [cartpole_at(buf.obs[i], limit or 500) for i in range(B)]
    lengths = np.zeros(B, int)
    rng = np.random.default_rng(seed)
    kinds = set()
    for _ in range(60):
        buf.actions[:] = rng.integers(0, 2, B)
        games = buf.step(group)
        expected_games = []
        for i, env in enumerate(refs):
            obs, reward, terminated, truncated, _ = env.step(int(buf.actions[i]))
            lengths[i] += 1
            terminated &= not truncated  # EnvPool: an end at the limit is a truncation only
            assert (buf.terminated[i], buf.truncated[i], buf.reward[i]) == (terminated, truncated, reward)
            if terminated or truncated:
                kinds.add("terminated" if terminated else "truncated")
                np.testing.assert_allclose(buf.final_obs[i], obs, rtol=0, atol=1e-5)
                assert np.abs(buf.obs[i]).max() <= 0.05  # CartPole's start states: uniform in +-0.05
                expected_games.append((i, float(lengths[i]), int(lengths[i])))
                lengths[i] = 0
                refs[i] = cartpole_at(buf.obs[i], limit or 500)
            else:
                np.testing.assert_allclose(buf.obs[i], obs, rtol=0, atol=1e-5)
        assert games == expected_games
    assert kinds <= ({"terminated", "truncated"} if limit else {"terminated"})
    group.close()


def test_pong_truncations_restart_the_frame_stack_and_keep_the_env_order():
    """Random actions in 3 Pong envs with a 23-step limit: each env ends truncated at exactly 23
    steps, its final stack is the last stack shifted by one frame, and its next stack repeats the
    reset frame 4 times (gymnasium's FrameStackObservation padding, which the frame store expects)."""
    B, limit = 3, 23
    group = make_env_group(EnvConfig(id=PONG.id, kwargs=PONG.kwargs, wrappers=PONG.wrappers, backend="envpool",
                                     max_episode_steps=limit), B, 5)
    buf = Buffers(group)
    group.reset(buf.obs)
    assert (buf.obs.dtype, buf.obs.shape) == (np.uint8, (B, 4, 84, 84))
    rng = np.random.default_rng(1)
    games, score = [], np.zeros(B)
    for t in range(1, 2 * limit + 1):
        before = buf.obs.copy()
        buf.actions[:] = rng.integers(0, group.action_space.n, B)
        got = buf.step(group)
        score += buf.reward
        assert not buf.terminated.any() and buf.truncated.all() == (t % limit == 0)
        if t % limit == 0:
            np.testing.assert_array_equal(buf.final_obs[:, :3], before[:, 1:])
            assert (buf.obs == buf.obs[:, :1]).all()
            assert not np.array_equal(buf.final_obs, buf.obs)
            games += got
            assert got == [(i, float(score[i]), limit) for i in range(B)]
            score[:] = 0
        else:
            assert got == []
            np.testing.assert_array_equal(buf.obs[:, :3], before[:, 1:])
    assert len(games) == 2 * B
    group.close()


def test_pong_seeding_is_reproducible_and_env_i_gets_base_seed_plus_i():
    actions = np.random.default_rng(0).integers(0, 6, 40)  # the same for every env: env 1 replays env 0 of seed + 1

    def play(base_seed: int) -> np.ndarray:
        group = make_env_group(EnvConfig(id=PONG.id, wrappers=PONG.wrappers, backend="envpool"), 3, base_seed)
        buf = Buffers(group)
        group.reset(buf.obs)
        frames = [buf.obs.copy()]
        for a in actions:
            buf.actions[:] = a
            buf.step(group)
            frames.append(buf.obs.copy())
        group.close()
        return np.stack(frames)

    a = play(4)
    np.testing.assert_array_equal(a, play(4))  # sticky actions (ALE v5's 0.25) and noop resets included
    assert not np.array_equal(a[:, 0], a[:, 1])
    np.testing.assert_array_equal(a[:, 1], play(5)[:, 0])


def test_reward_clipping_reports_the_unclipped_return():
    """Pendulum pays -16..0 a step: with clip_reward the steps pay -1, the games their true sum."""
    limit, steps = 10, 25

    def play(wrappers):
        group = make_env_group(EnvConfig(id="Pendulum-v1", wrappers=wrappers, max_episode_steps=limit,
                                         backend="envpool"), 2, 3)
        buf = Buffers(group)
        group.reset(buf.obs)
        rewards, games = [], []
        for t in range(steps):
            buf.actions[:] = np.sin([t, 2 * t])[:, None] * 2
            games += buf.step(group)
            rewards.append(buf.reward.copy())
        group.close()
        return np.array(rewards), games

    raw, raw_games = play(())
    clipped, games = play(("clip_reward",))
    np.testing.assert_array_equal(clipped, np.sign(raw))
    assert games == raw_games and len(games) == 4
    for i, ret, length in games:
        assert length == limit and ret < -limit
    np.testing.assert_allclose([ret for i, ret, _ in games if i == 0], [raw[:10, 0].sum(), raw[10:20, 0].sum()],
                               rtol=1e-6)


class FaultyPool:
    """A real EnvPool pool whose env 1 goes wrong at its 3rd step: ``mode`` "nan" (observation),
    "inf_reward", "raise" (the whole pool raises, as a crashed C++ env would) or "" (none)."""

    def __init__(self, mode: str, **make):
        self.pool, self.mode, self.steps = envpool.make_gymnasium(**make), mode, 0

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def step(self, actions, env_id):
        obs, reward, terminated, truncated, info = self.pool.step(actions, env_id)
        if len(env_id) == len(self.pool):
            self.steps += 1
        if self.steps == 3 and len(env_id) == len(self.pool):
            if self.mode == "raise":
                raise RuntimeError("simulated emulator crash")
            if self.mode == "nan":
                obs[1, 2] = np.nan
            elif self.mode == "inf_reward":
                reward[1] = np.inf
        return obs, reward, terminated, truncated, info


@pytest.mark.parametrize("mode,problem,failed", [
    ("nan", "observation contains NaN or an infinity", (1,)),
    ("inf_reward", "reward is inf", (1,)),
    ("raise", "step raised RuntimeError: simulated emulator crash (the whole pool of 3 envs failed)", (0, 1, 2)),
])
def test_a_failing_env_raises_env_error_and_recreate_recovers(mode, problem, failed):
    made = []

    def make_pool(task, **options):
        made.append(options["seed"])
        return FaultyPool(mode if len(made) == 1 else "", task_id=task, **options)  # a rebuilt pool works

    B, base_seed = 3, 10
    group = EnvPoolGroup(EnvConfig(backend="envpool"), B, base_seed, make_pool=make_pool)
    buf = Buffers(group)
    group.reset(buf.obs)
    buf.actions[:] = 0
    buf.step(group)
    buf.step(group)
    before = buf.obs.copy()
    with pytest.raises(EnvError) as info:
        buf.step(group)
    err = info.value
    assert err.env_indices == failed and err.finished == []
    assert str(err).startswith(f"env 'CartPole-v1' #{failed[0]}: {problem}") and "\n" not in str(err)
    for i in range(B):
        if i in failed:  # the contract: a truncation on the observation the action was taken on
            assert (buf.reward[i], buf.terminated[i], buf.truncated[i]) == (0.0, False, True)
            np.testing.assert_array_equal(buf.final_obs[i], before[i])
            np.testing.assert_array_equal(buf.obs[i], before[i])
        else:
            assert buf.reward[i] == 1.0 and not np.array_equal(buf.obs[i], before[i])
    for i in err.env_indices:
        group.recreate(i, buf.obs)
    assert np.abs(buf.obs[list(failed)]).max() <= 0.05  # fresh start states
    if mode == "raise":  # rebuilt once, every env reseeded past the first seeds
        assert made == [[10, 11, 12], [13, 14, 15]]
    for _ in range(3):
        buf.step(group)
    assert np.isfinite(buf.obs).all()
    group.close()


def test_an_out_of_range_action_fails_only_its_env():
    group = make_env_group(EnvConfig(backend="envpool"), 2, 0)
    buf = Buffers(group)
    group.reset(buf.obs)
    buf.actions[:] = [1, 2]
    with pytest.raises(EnvError, match=r"#1: action 2 is outside Discrete\(2\)") as info:
        buf.step(group)
    assert info.value.env_indices == (1,) and buf.truncated.tolist() == [False, True]
    group.recreate(1, buf.obs)
    group.close()


@pytest.mark.parametrize("cfg,field,mentions", [
    (EnvConfig(id="tests.envs_for_tests:make_dict_env", backend="envpool"), "env.id", "'module:callable'"),
    (EnvConfig(id="MinAtar/Breakout-v1", backend="envpool"), "env.id", "has no env 'MinAtar/Breakout-v1'"),
    (EnvConfig(id="ALE/Pong-v4", backend="envpool"), "env.id", "Pong-v5"),
    (EnvConfig(id="ALE/Pong-v5", backend="envpool"), "env.wrappers", "list 'atari'"),
    (EnvConfig(wrappers=("frame_stack:4",), backend="envpool"), "env.wrappers", "Atari envs only"),
    (EnvConfig(wrappers=("episodic_life",), backend="envpool"), "env.wrappers", "Atari"),
    (EnvConfig(kwargs='{"render_mode": "human"}', backend="envpool"), "env.kwargs", "no option 'render_mode'"),
    (EnvConfig(kwargs='{"num_envs": 4}', backend="envpool"), "env.kwargs", "set by rlpipe"),
    (EnvConfig(id="ALE/Pong-v5", wrappers=("atari",), kwargs='{"frameskip": 4}', backend="envpool"), "env.kwargs",
     "frame skip"),
    (EnvConfig(backend="envpol"), "env.backend", "gymnasium, envpool"),
    (EnvConfig(threads=2), "env.threads", "gymnasium backend"),
])
def test_what_envpool_cannot_provide_is_one_line_naming_the_field_and_the_backend(cfg, field, mentions):
    with pytest.raises(ValueError) as info:
        validate_env_config(cfg)
    message = str(info.value)
    assert "\n" not in message and message.startswith((field + ":", field + " = ")) and mentions in message
    assert "envpool" in message or "atari" in message.lower()


def test_the_config_error_comes_at_load_before_anything_starts():
    with pytest.raises(schema.ConfigError, match=r"^env.id: env.backend = 'envpool' has no env 'rlpipe/CartPoleNoVel-v1'"):
        loading.load(CONFIGS / "cartpole_novel_r2d1.toml", ["env.backend='envpool'"])
    exp = loading.load(CONFIGS / "atari_pong_r2d1.toml", ["env.backend='envpool'"])  # its frameskip 1 is accepted
    assert exp.env.backend == "envpool"


def test_r2d1_sequences_of_pong_frames_come_back_exactly_from_the_frame_store():
    """Pong steps of the EnvPool backend, with an R2D1 agent's memory, into the sequence table
    with the frame store: every sequence of 8 steps gathers the stacks the env gave."""
    T, B, L, P, n_seg = 8, 2, 8, 4, 6
    group = make_env_group(EnvConfig(id=PONG.id, wrappers=PONG.wrappers, backend="envpool", max_episode_steps=19),
                           B, 1)
    action = group.example_action()
    example = step_example(group.example_observation(), action,
                           info_example("q", ModelConfig(lstm_size=4, lstm_prev_action=True), action))
    spec = with_leading_dims(spec_of(example), [T, B])
    storage = SequenceStorage(spec, {0: B}, SequenceStorageConfig(capacity=B * 64, length=L, period=P, frame_store=True))
    obs = buffer_from_example(example.observation, [B])
    group.reset(obs)
    rng = np.random.default_rng(0)
    stacks, keys = [], []
    for k in range(n_seg):
        seg = buffer_from_example(example, [T, B])
        for t in range(T):
            seg.observation[t] = obs
            seg.action[t] = rng.integers(0, 6, B)
            group.step(seg.action[t], obs, seg.reward[t], seg.terminated[t], seg.truncated[t], seg.final_observation[t])
        seg.policy_version[:] = k
        stacks.append(seg.observation.copy())
        keys.append(storage.write(0, seg)[1])
    group.close()
    keys = np.concatenate(keys)
    assert len(keys) == B * ((T * n_seg - L) // P + 1) and storage.metrics()["frames_unrebuilt_items"] == 0
    dest = from_spec(storage.batch_spec(len(keys)))
    storage.gather(keys, np.ones(len(keys), np.float32), dest)
    all_steps = np.concatenate(stacks)  # [steps, B, 4, 84, 84]
    for j, key in enumerate(keys):
        row, col = divmod(int(key), storage.ring.B_total)
        np.testing.assert_array_equal(dest.observation[:, j], all_steps[row:row + L, col])


# ---------------------------------------------------------------- the real pipeline


@pytest.mark.learning
@pytest.mark.parametrize("inference", ["local", "server"])
def test_ppo_cartpole_learns_through_the_pipeline_on_envpool(runs, inference):
    run = runs("cartpole_ppo.toml", "env.backend='envpool'", f"sampler.inference={inference}",
               "run.target_return=150.0", "run.max_env_steps=60000")
    result = run.wait_result(60)
    assert result["reason"] == "target" and result["mean_return"] >= 150, result
    assert run.config().env.backend == "envpool"


def test_pong_ppo_samples_and_ships_segments_through_the_pipeline_on_envpool(runs):
    run = runs("atari_pong_ppo.toml", "env.backend='envpool'", "sampler.count=1", "sampler.envs=4",
               "sampler.horizon=32", "learner.batch_segments=1", "algo.epochs=1", "algo.minibatches=1",
               "run.max_env_steps=384")
    result = run.wait_result(60)
    assert result["reason"] == "budget" and result["env_steps"] >= 384 and result["updates"] >= 3, result
    assert run.config().env.backend == "envpool"
