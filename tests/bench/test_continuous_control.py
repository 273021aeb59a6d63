"""Benchmark: DDPG-family learning wall-clock on this machine.

- Pendulum-v1, SAC and TD3 with the shipped configs (the rl-zoo hyperparameters: SAC
  256x256 with 100 random steps, TD3 400x300 with 10k random steps, one update of batch 256
  per env step): from the moment `rlpipe launch` starts to result.json with the mean return
  of the last 10 episodes at -200; 3 seeds each; env steps too.
- Stable-Baselines3 SAC (when installed: the `bench` extra), one process, with the same
  hyperparameters (rl-zoo's sac.yml Pendulum-v1), stopped by a callback at the same target;
  same seeds, alternating with rlpipe's runs. The ratio rlpipe / SB3 says what the pipeline
  buys on this machine.
- MuJoCo HalfCheetah-v5 SAC (shipped config): the mean return of the last 10 episodes and
  of 10 greedy evaluation episodes after 100k env steps (issue target >= 3000), and the
  wall-clock. One seed: it runs for the better part of an hour on 2 cores.

Run with `make bench`.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.pipeline import Run, rlpipe, rlpipe_to_target, sb3_to_target, summary

pytestmark = pytest.mark.bench
SEEDS = range(3)
TARGET = -200.0


def sb3_sac_to_target(seed: int) -> tuple[float, int]:
    import gymnasium as gym
    from stable_baselines3 import SAC
    from stable_baselines3.common.monitor import Monitor

    def make():
        env = Monitor(gym.make("Pendulum-v1"))
        return SAC("MlpPolicy", env, learning_rate=1e-3, seed=seed, device="cpu", verbose=0), env

    return sb3_to_target(make, 20_000, TARGET, 10)


def test_pendulum_sac_and_td3_launch_to_minus_200(tmp_path):
    try:
        import stable_baselines3  # noqa: F401
    except ImportError:
        stable_baselines3 = None
    sac, td3, peer = [], [], []
    for seed in SEEDS:
        sac.append(rlpipe_to_target(tmp_path / f"sac{seed}", "pendulum_sac.toml", seed))
        td3.append(rlpipe_to_target(tmp_path / f"td3{seed}", "pendulum_td3.toml", seed))
        if stable_baselines3 is not None:
            peer.append(sb3_sac_to_target(seed))
    print()
    median = summary("rlpipe SAC Pendulum-v1 (256x256), `rlpipe launch` -> mean of 10 episodes -200", sac)
    summary("rlpipe TD3 Pendulum-v1 (400x300, 10k random steps), `rlpipe launch` -> -200", td3)
    if peer:
        theirs = summary("Stable-Baselines3 SAC (rl-zoo hyperparameters), one process -> -200", peer)
        print(f"ratio rlpipe SAC / SB3 SAC (medians): {median / theirs:.2f}")
    else:
        print("stable-baselines3 is not installed (pip install -e '.[bench]'): no peer to compare with")


def test_halfcheetah_sac_return_after_100k_steps(tmp_path):
    t0 = time.time()
    run = Run.launch(tmp_path, "halfcheetah_sac.toml", "run.max_env_steps=100000")
    try:
        result = run.wait_result(3 * 3600)
        seconds = (run.dir / "result.json").stat().st_mtime - t0
        out = rlpipe("evaluate", str(run.dir), "--episodes", "10", timeout=600)
    finally:
        run.close()
    print(f"\nrlpipe SAC HalfCheetah-v5, 100k env steps: {seconds:.0f} s from launch, {result['updates']} updates, "
          f"mean return of the last 10 training episodes {result['mean_return']:.0f}; greedy evaluation: "
          f"{out.stdout.strip()}")
    print(json.dumps(result))
