"""Every experiment shipped in deploy/configs loads, and the Atari one runs an update."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.serial import train_serial
from shared.config import loading as config
from tests.pipeline import CONFIGS


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_config_is_valid(path):
    exp = config.load(path)
    assert exp.sampler.count >= 1 and exp.run.max_env_steps > 0


def test_the_connect_four_pool_config_is_connect_four_ppo_with_a_pool():
    """TOML has no include: the pool config copies connect_four_ppo.toml, and must stay a copy."""
    pool, plain = (config.load(CONFIGS / f"{name}.toml") for name in ("connect_four_pool_ppo", "connect_four_ppo"))
    assert pool.selfplay.pool == "prioritised" and not plain.selfplay.on
    assert replace(pool, selfplay=plain.selfplay, run=replace(pool.run, name=plain.run.name)) == plain


def test_the_connect_four_board_config_is_the_pool_config_with_the_measured_settings():
    """connect_four_board_ppo.toml is the pool config with the settings of its measured row
    (docs/benchmarks.md), and must stay so."""
    board = config.load(CONFIGS / "connect_four_board_ppo.toml")
    measured = config.load(CONFIGS / "connect_four_pool_ppo.toml", [
        "run.name='connect_four_board_ppo'", "run.max_env_steps=9000000", "selfplay.scripted={ heuristic = 0.5 }",
        "model.encoder='board_cnn'", "agent.shared_encoder=true"])
    assert board == measured


def test_the_mappo_config_is_simple_spread_ppo_with_a_centralised_value():
    mappo, plain = (config.load(CONFIGS / f"{name}.toml") for name in ("simple_spread_mappo", "simple_spread_ppo"))
    assert mappo.env.global_state and not plain.env.global_state
    assert replace(mappo, env=plain.env, run=replace(mappo.run, name=plain.run.name)) == plain


def test_atari_pong_ppo_runs_one_update_in_serial_mode():
    exp = config.load(CONFIGS / "atari_pong_ppo.toml", ["run.max_env_steps=512", "sampler.count=1",
                                                        "sampler.envs=4", "sampler.horizon=64",
                                                        "learner.batch_segments=1", "replay.capacity=1",
                                                        "algo.epochs=1"])
    result = train_serial(exp)
    assert result["reason"] == "budget" and result["updates"] >= 1


@pytest.mark.parametrize("name", ["minatar_breakout_dqn", "atari_pong_dqn"])
def test_dqn_configs_run_updates_in_serial_mode(name):
    exp = config.load(CONFIGS / f"{name}.toml", ["run.max_env_steps=1024", "sampler.count=1", "sampler.envs=4",
                                                 "sampler.horizon=16", "replay.capacity=2000",
                                                 "replay.min_size_to_sample=256", "replay.samples_per_insert=0.5"])
    result = train_serial(exp)
    assert result["reason"] == "budget" and result["updates"] >= 1


def test_minatar_breakout_impala_runs_updates_in_serial_mode():
    """The paper's settings as ImpalaConfig has them: RMSprop, the summed loss, the annealed rate."""
    exp = config.load(CONFIGS / "minatar_breakout_impala.toml", ["run.max_env_steps=1280"])
    assert (exp.algo.optimizer, exp.algo.loss_reduction, exp.algo.anneal_lr) == ("rmsprop", "sum", True)
    result = train_serial(exp)
    assert result["reason"] == "budget" and result["updates"] >= 2


@pytest.mark.parametrize("name", ["halfcheetah_sac", "halfcheetah_td3", "halfcheetah_crossq", "pendulum_ddpg",
                                  "pendulum_tqc", "pendulum_crossq_cpu"])
def test_continuous_control_configs_run_updates_in_serial_mode(name):
    """MuJoCo HalfCheetah-v5 (the mujoco extra) and Pendulum with the configs' own networks:
    past the random warm-up, the actor acts and the learner updates."""
    exp = config.load(CONFIGS / f"{name}.toml", ["run.max_env_steps=600", "agent.random_steps=200",
                                                 "replay.min_size_to_sample=256", "replay.samples_per_insert=64"])
    result = train_serial(exp)
    assert result["reason"] == "budget" and result["updates"] >= 50


def test_atari_pong_r2d1_runs_updates_in_serial_mode():
    """The frame store under the sequence table, the CNN + LSTM agent, burn-in over the
    config's own 80-step sequences; a small batch keeps CPU time down."""
    exp = config.load(CONFIGS / "atari_pong_r2d1.toml", ["run.max_env_steps=960", "sampler.count=1", "sampler.envs=4",
                                                          "sampler.horizon=40", "replay.capacity=2000",
                                                          "replay.min_size_to_sample=8", "replay.samples_per_insert=0.5",
                                                          "algo.batch_size=4"])
    result = train_serial(exp)
    assert result["reason"] == "budget" and result["updates"] >= 2


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("atari_*.toml")), ids=lambda p: p.stem)
def test_atari_configs_train_with_the_episodic_life_their_comments_promise(path):
    assert "episodic life" in " ".join(path.read_text().replace("#", " ").split())
    assert "episodic_life" in config.load(path).env.wrappers  # "atari" alone does not turn it on


def test_a_breakout_copy_of_the_pong_config_loses_a_life_and_signals_it():
    """Issue 26: a Breakout copy of the Pong DQN config ends the training episode
    (terminated) at the first life lost, while the game goes on (its score is not final)."""
    import numpy as np

    from shared.envs.group import make_env

    exp = config.load(CONFIGS / "atari_pong_dqn.toml", ["env.id='ALE/Breakout-v5'"])
    env, tracker = make_env(exp.env)
    try:
        env.reset(seed=0)
        ale = env.unwrapped.ale
        lives = ale.lives()
        rng = np.random.default_rng(0)
        for _ in range(2000):
            _, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
            if terminated or truncated:
                break
        assert terminated and not truncated
        assert ale.lives() == lives - 1 > 0 and not ale.game_over()
        assert tracker.finished is None  # not a game over: no episode return reported yet
    finally:
        env.close()
