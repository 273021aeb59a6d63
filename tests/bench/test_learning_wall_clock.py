"""Benchmark: how long learning CartPole-v1 takes on this machine, start to target.

- rlpipe PPO (deploy/configs/cartpole_ppo.toml) and DQN (cartpole_dqn.toml): from the
  moment `rlpipe launch` starts to the moment the learner writes result.json with the
  target reached (mean return 475 over 100 episodes); 5 seeds each; env steps too.
- Stable-Baselines3 PPO (when installed: the `bench` extra), one process, with the tuned
  CartPole hyperparameters of rl-baselines3-zoo (8 envs, n_steps 32, 20 epochs of batch
  256, lr and clip range annealed), stopped by a callback once its mean return over the
  last 100 episodes reaches 475; same seeds, alternating with rlpipe's runs.

Medians and spreads; the ratio rlpipe / SB3 is what the issue bounds (<= 0.5).
Run with `make bench`.
"""

from __future__ import annotations


import pytest

from tests.pipeline import rlpipe_to_target, sb3_to_target, summary

pytestmark = pytest.mark.bench
SEEDS = range(5)
TARGET = 475.0


def sb3_ppo_to_target(seed: int) -> tuple[float, int]:
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    def linear(start: float):
        return lambda remaining: remaining * start

    def make():
        env = make_vec_env("CartPole-v1", n_envs=8, seed=seed)
        return PPO("MlpPolicy", env, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20,
                   ent_coef=0.0, learning_rate=linear(1e-3), clip_range=linear(0.2), seed=seed, device="cpu",
                   verbose=0), env

    return sb3_to_target(make, 500_000, TARGET, 100)


def test_ppo_cartpole_launch_to_475_vs_stable_baselines3(tmp_path):
    try:
        import stable_baselines3  # noqa: F401
    except ImportError:
        stable_baselines3 = None
    ours, theirs = [], []
    for seed in SEEDS:
        ours.append(rlpipe_to_target(tmp_path / f"ppo{seed}", "cartpole_ppo.toml", seed))
        if stable_baselines3 is not None:
            theirs.append(sb3_ppo_to_target(seed))
    print()
    median = summary("rlpipe PPO CartPole-v1, `rlpipe launch` -> mean 475", ours)
    if theirs:
        peer = summary("Stable-Baselines3 PPO (rl-zoo hyperparameters), one process -> mean 475", theirs)
        print(f"ratio rlpipe / SB3 (medians): {median / peer:.2f}")
    else:
        print("stable-baselines3 is not installed (pip install -e '.[bench]'): no peer to compare with")


def test_dqn_cartpole_launch_to_475(tmp_path):
    runs = [rlpipe_to_target(tmp_path / f"dqn{seed}", "cartpole_dqn.toml", seed) for seed in SEEDS]
    print()
    summary("rlpipe DQN CartPole-v1, `rlpipe launch` -> mean 475", runs)
