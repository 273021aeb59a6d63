"""EnvGroup and EnvConfig: episode ends, final observations, seeding, spaces, errors, Atari.

The contract tests that apply to every env backend run on each (``backend``); EnvPool's own
checks are in tests/test_envpool_backend.py."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from dataclasses import replace

from shared.envs.backends import make_env_group, validate_env_config
from shared.envs.group import EnvConfig, EnvError, EnvGroup
from shared.data.namedarraytuple import buffer_from_example

try:
    from tests import envs_for_tests
except ImportError:  # plain `pytest` puts tests/ (not the repo root) on sys.path
    import envs_for_tests

torch.set_num_threads(1)
HELPERS = envs_for_tests.__name__
BACKENDS = ["gymnasium", "envpool"]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    if request.param == "envpool":
        pytest.importorskip("envpool")
    return request.param


class Buffers:
    """The [B, ...] arrays a sampler hands to EnvGroup.step."""

    def __init__(self, group: EnvGroup):
        B = group.n_envs
        self.obs = buffer_from_example(group.example_observation(), (B,))
        self.final_obs = buffer_from_example(group.example_observation(), (B,))
        self.actions = buffer_from_example(group.example_action(), (B,))
        self.reward = np.zeros(B, np.float32)
        self.terminated = np.zeros(B, bool)
        self.truncated = np.zeros(B, bool)

    def step(self, group: EnvGroup):
        return group.step(self.actions, self.obs, self.reward, self.terminated, self.truncated, self.final_obs)


def step_beside_references(group: EnvGroup, make_ref, check, check_final, steps: int = 27, end: int = 25):
    """Step ``group`` (2 envs of a Parallel MPE env, seeded 7: seeds 7 and 10) beside two
    reference envs from ``make_ref()`` seeded alike, with the same random actions, through the
    episode's end at step ``end`` and the reset. Before each step ``check(buf, k, j, ref, own)``
    for column ``k * n + j`` (env k's agent j, ``own`` its observation from the reference);
    ``check_final(buf, k, ref)`` at the episode's end."""
    refs = [make_ref() for _ in range(2)]
    agents = refs[0].possible_agents
    buf = Buffers(group)
    group.reset(buf.obs)
    ref_obs = [refs[0].reset(seed=7)[0], refs[1].reset(seed=10)[0]]
    rng = np.random.default_rng(0)
    for t in range(steps):
        for k, ref in enumerate(refs):
            for j, a in enumerate(agents):
                check(buf, k, j, ref, ref_obs[k][a])
        buf.actions[:] = rng.integers(0, 5, group.n_envs)
        buf.step(group)
        for k, ref in enumerate(refs):
            ref_obs[k] = ref.step({a: int(buf.actions[len(agents) * k + j]) for j, a in enumerate(agents)})[0]
            if t == end - 1:
                check_final(buf, k, ref)
                ref_obs[k] = ref.reset()[0]
    return buf


def cartpole_reference(backend: str, seed: int, start: np.ndarray, max_episode_steps: int) -> gym.Env:
    """gymnasium's CartPole-v1 in the state ``start``: seeded like env i of the gymnasium backend
    (its start must then be ``start``); set to it for EnvPool, whose CartPole has the same dynamics
    but its own random start states."""
    env = gym.make("CartPole-v1", max_episode_steps=max_episode_steps)
    obs, _ = env.reset(seed=seed)
    if backend == "gymnasium":
        np.testing.assert_array_equal(obs, start)
    else:
        env.unwrapped.state = start.astype(np.float64)
    return env


def reset_reference(backend: str, env: gym.Env, got: np.ndarray) -> None:
    """Reset ``env`` as the backend's env i was reset (to the start it got, for EnvPool)."""
    reset_obs, _ = env.reset()
    if backend == "gymnasium":
        np.testing.assert_array_equal(got, reset_obs)
    else:
        env.unwrapped.state = got.astype(np.float64)


def assert_same_state(backend: str, got: np.ndarray, want: np.ndarray) -> None:
    """Exact for gymnasium; for EnvPool the reference started from the float32 rounding of its float64 state."""
    np.testing.assert_allclose(got, want, rtol=0, atol=0 if backend == "gymnasium" else 1e-5)


@pytest.mark.parametrize("max_steps,expect", [(5, "truncated"), (0, "terminated")])
def test_cartpole_episode_end_kind_and_final_observation(backend, max_steps, expect):
    B, base_seed = 2, 7
    group = make_env_group(EnvConfig(max_episode_steps=max_steps, backend=backend), B, base_seed)
    buf = Buffers(group)
    group.reset(buf.obs)
    refs = [cartpole_reference(backend, base_seed + i, buf.obs[i], max_steps or 500) for i in range(B)]
    buf.actions[:] = 1  # always push right: the pole falls in about 10 steps
    ended_at, games, kinds = {}, [], set()
    for t in range(1, 40):
        games += buf.step(group)
        for i, env in enumerate(refs):
            obs, reward, terminated, truncated, _ = env.step(1)
            assert (buf.terminated[i], buf.truncated[i], buf.reward[i]) == (terminated, truncated, reward)
            if (terminated or truncated) and i not in ended_at:
                ended_at[i] = t
                kinds.add("terminated" if terminated else "truncated")
                assert_same_state(backend, buf.final_obs[i], obs)
                reset_reference(backend, env, buf.obs[i])
                assert not np.array_equal(buf.obs[i], buf.final_obs[i])
                if terminated:  # the pole fell or the cart left the track
                    assert abs(obs[2]) > 0.2095 or abs(obs[0]) > 2.4
            elif i not in ended_at:
                assert_same_state(backend, buf.obs[i], obs)
        if len(ended_at) == B:
            break
    assert kinds == {expect}
    if expect == "truncated":
        assert ended_at == {0: 5, 1: 5}
    assert sorted(games) == [(i, float(ended_at[i]), ended_at[i]) for i in range(B)]


def run_cartpole(base_seed: int, actions: np.ndarray, B: int = 3, backend: str = "gymnasium") -> np.ndarray:
    group = make_env_group(EnvConfig(backend=backend), B, base_seed)
    buf = Buffers(group)
    group.reset(buf.obs)
    trajectory = [buf.obs.copy()]
    for a in actions:
        buf.actions[:] = a
        buf.step(group)
        trajectory.append(buf.obs.copy())
    return np.stack(trajectory)


def test_seeding_is_deterministic_and_distinct_per_env(backend):
    actions = np.random.default_rng(0).integers(0, 2, (60, 3))
    a, b = run_cartpole(11, actions, backend=backend), run_cartpole(11, actions, backend=backend)
    np.testing.assert_array_equal(a, b)  # 60 steps include auto-resets: reset streams too
    assert not np.array_equal(a[0, 0], a[0, 1])
    assert not np.array_equal(a[0], run_cartpole(12, actions, backend=backend)[0])
    # env i gets base_seed + i
    np.testing.assert_array_equal(a[0, 1], run_cartpole(12, actions, backend=backend)[0, 0])


def test_dict_observation_tuple_action_round_trip_and_box_clipping():
    group = EnvGroup(EnvConfig(id=f"{HELPERS}:make_dict_env"), 2, 0)
    obs = group.example_observation()
    assert obs._fields == ("count", "inner", "pos") and obs.inner._fields == ("bits", "img")
    assert (obs.count.dtype, obs.count.shape) == (np.int64, ())
    assert (obs.pos.dtype, obs.pos.shape) == (np.float32, (2,))  # float64 Box -> float32
    assert (obs.inner.bits.dtype, obs.inner.img.dtype, obs.inner.img.shape) == (np.int8, np.uint8, (2, 2))
    act = group.example_action()
    assert act._fields == ("f0", "f1")
    assert (act.f0.dtype, act.f1.dtype, act.f1.shape) == (np.int64, np.float32, (2,))

    buf = Buffers(group)
    group.reset(buf.obs)
    np.testing.assert_array_equal(buf.obs.count, [0, 0])
    buf.actions.f0[:] = [5, 2]
    buf.actions.f1[:] = [[5.0, -0.5], [-3.0, 0.25]]
    buf.step(group)
    np.testing.assert_array_equal(buf.obs.count, [1, 1])
    np.testing.assert_array_equal(buf.obs.inner.bits, [[1, 0, 1], [0, 1, 0]])
    np.testing.assert_array_equal(buf.obs.inner.img, np.broadcast_to(np.array([5, 2])[:, None, None], (2, 2, 2)))
    np.testing.assert_array_equal(buf.obs.pos, [[1.0, -0.5], [-1.0, 0.25]])  # clipped for the env
    np.testing.assert_array_equal(buf.actions.f1, [[5.0, -0.5], [-3.0, 0.25]])  # caller's action kept
    np.testing.assert_array_equal(buf.reward, [5.0, 2.0])


@pytest.mark.parametrize(
    "cfg,field,mentions",
    [
        (EnvConfig(id="CartPol-v1"), "env.id", "CartPole-v1"),
        (EnvConfig(id="no_such_module_xyz:make"), "env.id", "no_such_module_xyz"),
        (EnvConfig(id=f"{HELPERS}:no_such_callable"), "env.id", "no_such_callable"),
        (EnvConfig(id=":make"), "env.id", "module:attribute"),
        (EnvConfig(wrappers=("frame_stak:4",)), "env.wrappers", "frame_stack:N"),
        (EnvConfig(wrappers=("frame_stack:0",)), "env.wrappers", "episodic_life"),
        (EnvConfig(wrappers=("clip_reward", "clip_reward")), "env.wrappers", "twice"),
        (EnvConfig(wrappers=("atari",)), "env.wrappers", "ALE"),
        (EnvConfig(kwargs="{bad json"), "env.kwargs", "JSON"),
        (EnvConfig(kwargs="[1, 2]"), "env.kwargs", "object"),
        (EnvConfig(max_episode_steps=-1), "env.max_episode_steps", ">= 0"),
        (EnvConfig(split_step="yes"), "env.split_step", "'auto', 'on', 'off'"),
        (EnvConfig(split_step="on"), "env.split_step", "nothing would overlap"),
    ],
)
def test_bad_config_is_one_line_naming_the_field(cfg, field, mentions):
    with pytest.raises(ValueError) as info:
        validate_env_config(cfg)
    message = str(info.value)
    assert "\n" not in message and message.startswith((field + ":", field + " = ")) and mentions in message


def test_episodic_life_and_clip_reward_report_the_true_game():
    cfg = EnvConfig(id=f"{HELPERS}:make_lives_env", wrappers=("episodic_life", "clip_reward"))
    group = EnvGroup(cfg, 1, 0)
    buf = Buffers(group)
    group.reset(buf.obs)
    ends, games = [], []
    for t in range(1, 14):
        games += buf.step(group)
        assert buf.reward[0] == 1.0  # the game pays 3 a step
        if buf.terminated[0]:
            ends.append(t)
    # 3 lives of 5 game steps; after each life lost the episodic-life reset spends one
    # no-op step of the same game, so training episodes are 5, 4 and 4 steps long.
    assert ends == [5, 9, 13]
    assert games == [(0, 45.0, 15)]


@pytest.mark.parametrize(
    "mode,problem",
    [
        ("raise", "step raised RuntimeError: simulated emulator crash"),
        ("nan", "observation.x contains NaN"),
        ("shape", "observation.x has shape (4,)"),
        ("dtype", "observation.img has dtype float64"),
        ("nan_reward", "reward is NaN"),
    ],
)
def test_misbehaving_env_raises_env_error_and_recreate_recovers(mode, problem):
    B, base_seed = 3, 10
    cfg = EnvConfig(id=f"{HELPERS}:make_faulty_env", kwargs=f'{{"fail_seed": 11, "fail_at": 3, "mode": "{mode}"}}')
    group = EnvGroup(cfg, B, base_seed)
    buf = Buffers(group)
    group.reset(buf.obs)
    buf.step(group)
    buf.step(group)
    with pytest.raises(EnvError) as info:
        buf.step(group)
    err = info.value
    assert err.env_indices == (1,) and err.finished == []
    assert str(err).startswith(f"env '{cfg.id}' #1: {problem}") and "\n" not in str(err)
    np.testing.assert_array_equal(buf.obs.x[:, 0], [3, 2, 3])  # the other envs did step
    np.testing.assert_array_equal(buf.reward, [1.0, 0.0, 1.0])
    np.testing.assert_array_equal(buf.truncated, [False, True, False])
    np.testing.assert_array_equal(buf.final_obs.x[1], buf.obs.x[1])  # the obs the action was taken on

    group.recreate(1, buf.obs)
    np.testing.assert_array_equal(buf.obs.x[1], [0, base_seed + 1 + B, 0])  # fresh env, new seed
    for _ in range(4):
        buf.step(group)
    np.testing.assert_array_equal(buf.obs.x[:, 0], [7, 4, 7])


def test_atari_pong_preprocessing_and_a_whole_game(backend):
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    group = make_env_group(EnvConfig(id="ALE/Pong-v5", wrappers=("atari",), backend=backend), 1, 0)
    example = group.example_observation()
    assert (example.dtype, example.shape) == (np.uint8, (4, 84, 84))  # channels first
    buf = Buffers(group)
    group.reset(buf.obs)
    rng = np.random.default_rng(0)
    rewards, games = [], []
    for t in range(1, 3000):
        buf.actions[:] = rng.integers(0, group.action_space.n)
        games = buf.step(group)
        rewards.append(float(buf.reward[0]))
        if games:
            break
    assert set(rewards) <= {-1.0, 0.0, 1.0} and -1.0 in rewards
    assert buf.terminated[0] and not buf.truncated[0]
    (i, score, length), = games
    assert score == sum(rewards) and -21 <= score < 21  # Pong's points are already +-1
    # + FIRE and RIGHT pressed by the gymnasium backend's first reset; EnvPool's count in no length.
    assert length == t + (2 if backend == "gymnasium" else 0) and length > 300
    assert buf.final_obs[0].max() > 0 and buf.obs[0].max() > 0


def test_minatar_breakout_steps_with_uint8_maps():
    pytest.importorskip("minatar")
    group = EnvGroup(EnvConfig(id="MinAtar/Breakout-v1"), 2, 0)
    example = group.example_observation()
    assert (example.dtype, example.shape) == (np.uint8, (10, 10, 4))
    buf = Buffers(group)
    group.reset(buf.obs)
    games = []
    for t in range(200):
        buf.actions[:] = t % 3
        games += buf.step(group)
        assert set(np.unique(buf.obs)) <= {0, 1}
    assert games and all(length > 0 and score >= 0 for _, score, length in games)
