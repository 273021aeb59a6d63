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
from shared.replay.storage import StorageConfig
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


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 4), limit=st.sampled_from([0, 9, 23]), seed=st.integers(0, 2**16), split=st.booleans())
def test_cartpole_steps_like_gymnasium_over_random_actions_and_episode_ends(B, limit, seed, split):
    """Every env follows gymnasium's CartPole from the state EnvPool started it in: observations,
    rewards, terminated vs truncated, final observations, the next episode's first observation in
    the same step, and (return, length) of each game in env-index order. ``split``: two groups
    stepped as the alternating sampler steps them split-phase (A.send, B.send, A.recv, B.recv),
    each keeping the contract of one ``step``."""
    cfg = EnvConfig(max_episode_steps=limit, backend="envpool")
    groups = [make_env_group(cfg, B, seed + k * B) for k in range(2 if split else 1)]
    bufs = [Buffers(group) for group in groups]
    refs = []
    for group, buf in zip(groups, bufs):
        group.reset(buf.obs)
        refs.append([cartpole_at(buf.obs[i], limit or 500) for i in range(B)])
    lengths = np.zeros((len(groups), B), int)
    rng = np.random.default_rng(seed)
    kinds = set()
    for _ in range(60):
        for group, buf in zip(groups, bufs):
            buf.actions[:] = rng.integers(0, 2, B)
            group.send(buf.actions)
        for k, (group, buf) in enumerate(zip(groups, bufs)):
            games = group.recv(buf.obs, buf.reward, buf.terminated, buf.truncated, buf.final_obs)
            expected_games = []
            for i, env in enumerate(refs[k]):
                obs, reward, terminated, truncated, _ = env.step(int(buf.actions[i]))
                lengths[k, i] += 1
                terminated &= not truncated  # EnvPool: an end at the limit is a truncation only
                assert (buf.terminated[i], buf.truncated[i], buf.reward[i]) == (terminated, truncated, reward)
                if terminated or truncated:
                    kinds.add("terminated" if terminated else "truncated")
                    np.testing.assert_allclose(buf.final_obs[i], obs, rtol=0, atol=1e-5)
                    assert np.abs(buf.obs[i]).max() <= 0.05  # CartPole's start states: uniform in +-0.05
                    expected_games.append((i, float(lengths[k, i]), int(lengths[k, i])))
                    lengths[k, i] = 0
                    refs[k][i] = cartpole_at(buf.obs[i], limit or 500)
                else:
                    np.testing.assert_allclose(buf.obs[i], obs, rtol=0, atol=1e-5)
            assert games == expected_games
    assert kinds <= ({"terminated", "truncated"} if limit else {"terminated"})
    for group in groups:
        group.close()


def test_a_split_step_is_the_same_step_and_send_recv_go_in_pairs():
    """``send`` then ``recv`` gives what ``step`` gives (same seeds, same actions); a second
    ``send`` before ``recv``, or a ``recv`` without ``send``, is a programming error."""
    actions = np.random.default_rng(3).integers(0, 2, (40, 3))

    def play(split: bool):
        group = make_env_group(EnvConfig(max_episode_steps=15, backend="envpool"), 3, 8)
        buf = Buffers(group)
        group.reset(buf.obs)
        out = []
        for a in actions:
            buf.actions[:] = a
            if split:
                group.send(buf.actions)
                buf.actions[:] = 1 - a  # the actions were copied at send
                games = group.recv(buf.obs, buf.reward, buf.terminated, buf.truncated, buf.final_obs)
            else:
                games = buf.step(group)
            out.append((buf.obs.copy(), buf.reward.copy(), buf.terminated.copy(), buf.truncated.copy(),
                        buf.final_obs.copy(), games))
        if split:
            with pytest.raises(RuntimeError, match="no step was sent"):
                group.recv(buf.obs, buf.reward, buf.terminated, buf.truncated, buf.final_obs)
            group.send(buf.actions)
            with pytest.raises(RuntimeError, match="previous step was not received"):
                group.send(buf.actions)
        group.close()
        return out

    for (*a, games_a), (*b, games_b) in zip(play(False), play(True)):
        assert games_a == games_b
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


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
    "inf_reward", "raise" (the whole pool raises in ``recv``, as a crashed C++ env would),
    "raise_send" (in ``send``) or "" (none)."""

    def __init__(self, mode: str, **make):
        self.pool, self.mode, self.steps, self.whole = envpool.make_gymnasium(**make), mode, 0, False

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def send(self, actions, env_id):
        self.whole = len(env_id) == len(self.pool)  # a step of every env, not an autoreset
        self.steps += self.whole
        if self.steps == 3 and self.whole and self.mode == "raise_send":
            raise RuntimeError("simulated emulator crash")
        self.pool.send(actions, env_id)

    def recv(self, **kwargs):
        obs, reward, terminated, truncated, info = self.pool.recv(**kwargs)
        if self.steps == 3 and self.whole:
            if self.mode == "raise":
                raise RuntimeError("simulated emulator crash")
            if self.mode == "nan":
                obs[1, 2] = np.nan
            elif self.mode == "inf_reward":
                reward[1] = np.inf
        return obs, reward, terminated, truncated, info


WHOLE_POOL = "step raised RuntimeError: simulated emulator crash (the whole pool of 3 envs failed)"


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("mode,problem,failed", [
    ("nan", "observation contains NaN or an infinity", (1,)),
    ("inf_reward", "reward is inf", (1,)),
    ("raise", WHOLE_POOL, (0, 1, 2)),
    ("raise_send", WHOLE_POOL, (0, 1, 2)),
])
def test_a_failing_env_raises_env_error_and_recreate_recovers(mode, problem, failed, split):
    """``split``: the step sent, another group's sent and received meanwhile, then received."""
    made = []

    def make_pool(task, **options):
        made.append(options["seed"])
        return FaultyPool(mode if len(made) == 1 else "", task_id=task, **options)  # a rebuilt pool works

    B, base_seed = 3, 10
    group = EnvPoolGroup(EnvConfig(backend="envpool"), B, base_seed, make_pool=make_pool)
    other = EnvPoolGroup(EnvConfig(backend="envpool"), B, base_seed + B)
    buf, other_buf = Buffers(group), Buffers(other)
    group.reset(buf.obs)
    other.reset(other_buf.obs)
    buf.actions[:] = 0
    other_buf.actions[:] = 1
    buf.step(group)
    buf.step(group)
    before = buf.obs.copy()
    with pytest.raises(EnvError) as info:
        if split:
            group.send(buf.actions)
            other.send(other_buf.actions)
            other.recv(other_buf.obs, other_buf.reward, other_buf.terminated, other_buf.truncated,
                       other_buf.final_obs)
            group.recv(buf.obs, buf.reward, buf.terminated, buf.truncated, buf.final_obs)
        else:
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
    if mode.startswith("raise"):  # rebuilt once, every env reseeded past the first seeds
        assert made == [[10, 11, 12], [13, 14, 15]]
    for _ in range(3):
        buf.step(group)
    assert np.isfinite(buf.obs).all()
    group.close()
    other.close()


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
    with pytest.raises(schema.ConfigError, match=r"^env.split_step = 'async': allowed: 'auto', 'on', 'off'"):
        loading.load(CONFIGS / "cartpole_ppo.toml", ["env.backend='envpool'", "env.split_step='async'"])
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
    storage = SequenceStorage(spec, {0: B}, StorageConfig(B * 64, frame_store=True),
                              SequenceStorageConfig(length=L, period=P))
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


# ---------------------------------------------------------------- the alternating sampler


class ScriptedActions:
    """An action source that acts from each env's observation at ``wait`` (so that any order of
    calls gives the same actions), logging the calls."""

    def __init__(self, sampler, log: list):
        self.sampler, self.log = sampler, log

    def request(self, group: int) -> None:
        self.log.append(("request", group))

    def wait(self, group: int) -> int:
        self.log.append(("wait", group))
        slot = self.sampler.slots[group]
        slot.action[:] = np.floor(slot.observation[:, 1] * 1e4) % 2  # as good as random
        slot.agent_info.value[:] = slot.observation.sum(axis=1)
        return 7


class LoggedGroup:
    """An env group whose ``send`` and ``recv`` calls go into ``log``."""

    def __init__(self, group, g: int, log: list):
        self.group, self.g, self.log = group, g, log

    def __getattr__(self, name):
        return getattr(self.group, name)

    def send(self, actions):
        self.log.append(("send", self.g))
        self.group.send(actions)

    def recv(self, *outputs):
        self.log.append(("recv", self.g))
        return self.group.recv(*outputs)


@pytest.mark.parametrize("split", ["on", "off"])
def test_the_alternating_sampler_collects_the_same_segments_with_split_steps(split):
    """Two env groups (server inference, alternating) on EnvPool: with ``env.split_step`` each
    step is group 0's send, group 1's wait and send, then each one's recv and request; the
    segments (every field, fixed env columns, bootstraps) and the episodes are those of the
    synchronous schedule."""
    from services.build import agent_info
    from services.sampler.sampler import Sampler
    from shared.config.topology import topology
    from tests.test_memory import KeepAll

    def collect(mode: str):
        exp = loading.load(CONFIGS / "cartpole_ppo.toml", [
            "env.backend='envpool'", f"env.split_step='{mode}'", "env.max_episode_steps=13", "sampler.count=1",
            "sampler.envs=5", "sampler.horizon=16", "sampler.ring=3", "sampler.inference='server'",
            "sampler.alternating=true"])
        sampler = Sampler(exp.sampler, exp.env, topology(exp), 0, agent_info(exp), "splittest", shared_memory=False)
        log = []
        sampler.envs = [LoggedGroup(env, g, log) for g, env in enumerate(sampler.envs)]
        actions = ScriptedActions(sampler, log)
        sampler.start(actions)
        episodes = []
        for _ in range(3):
            sampler.collect_segment(actions, KeepAll())
            episodes.append(sampler.pending[3])
        out = [from_spec(spec_of(sampler.ring[k])) for k in range(2)]
        for k in range(2):
            out[k][:] = sampler.ring[k]
        assert [env.n_envs for env in sampler.envs] == [2, 3] and sampler.split == (mode == "on")
        sampler.close()
        return out, episodes, log

    segments, episodes, log = collect(split)
    reference, ref_episodes, ref_log = collect("off")
    step = log[log.index(("wait", 0), 4):][:8]  # one step of both groups, after the start's requests
    if split == "on":
        assert step == [("wait", 0), ("send", 0), ("wait", 1), ("send", 1), ("recv", 0), ("request", 0),
                        ("recv", 1), ("request", 1)]
    else:
        assert step == [("wait", 0), ("send", 0), ("recv", 0), ("request", 0), ("wait", 1), ("send", 1),
                        ("recv", 1), ("request", 1)]
    assert episodes == ref_episodes and sum(map(len, episodes[:2])) >= 5
    for seg, ref in zip(segments, reference):
        for name in ("observation", "action", "reward", "terminated", "truncated", "final_observation", "failed",
                     "policy_version"):
            np.testing.assert_array_equal(getattr(seg.samples, name), getattr(ref.samples, name), err_msg=name)
        np.testing.assert_array_equal(seg.samples.agent_info.value, ref.samples.agent_info.value)
        np.testing.assert_array_equal(seg.bootstrap_value, ref.bootstrap_value)
        np.testing.assert_array_equal(seg.bootstrap_observation, ref.bootstrap_observation)
    assert any(seg.samples.terminated.any() for seg in segments) and any(seg.samples.truncated.any()
                                                                         for seg in segments)


# ---------------------------------------------------------------- the real pipeline


@pytest.mark.learning
@pytest.mark.parametrize("inference", ["local", "server"])
def test_ppo_cartpole_learns_through_the_pipeline_on_envpool(runs, inference):
    run = runs("cartpole_ppo.toml", "env.backend='envpool'", f"sampler.inference={inference}",
               "run.target_return=150.0", "run.max_env_steps=60000")
    result = run.wait_result(60)
    assert result["reason"] == "target" and result["mean_return"] >= 150, result
    assert run.config().env.backend == "envpool"


@pytest.mark.parametrize("inference", ["local", "server"])
def test_pong_ppo_samples_and_ships_segments_through_the_pipeline_on_envpool(runs, inference):
    """``server``: the sampler's 4 envs in two alternating groups, each step split in two."""
    run = runs("atari_pong_ppo.toml", "env.backend='envpool'", "sampler.count=1", "sampler.envs=4",
               "sampler.horizon=32", "learner.batch_segments=1", "algo.epochs=1", "algo.minibatches=1",
               "run.max_env_steps=384", f"sampler.inference='{inference}'", "sampler.alternating=true",
               "env.split_step='on'" if inference == "server" else "env.split_step='auto'")
    result = run.wait_result(60)
    assert result["reason"] == "budget" and result["env_steps"] >= 384 and result["updates"] >= 3, result
    assert run.config().env.backend == "envpool"
    assert run.config().sampler.inference == inference
    assert ("in 2 group(s), steps split (send, recv)" in run.logs("sampler")) == (inference == "server")
