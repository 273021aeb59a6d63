"""Benchmark: env steps/s of the pipeline against one process stepping the same envs and policy.

Both are measured in the same run, three times each, and the medians compared:

- baseline: gymnasium SyncVectorEnv of 2 x 16 CartPole-v1 envs with the 64x64 MLP policy
  called inline on all 32 observations every step (one process);
- pipeline: 2 samplers x 16 envs (alternating groups), 1 action-server (same policy),
  replay and a learner whose updates are cheap (A2C, T=64), under supervisord; steps/s from the
  samplers' Prometheus counter over a window after warm-up.

Also reports the default PPO CartPole run's wall-clock from first batch to mean return 475.
Run with `make bench`.
"""

from __future__ import annotations

import re
import statistics
import time
import urllib.request

import gymnasium as gym
import numpy as np
import pytest
import torch

from shared.agents import PgAgent
from shared.models import ModelConfig
from tests.pipeline import Run

pytestmark = pytest.mark.bench
ENVS = 32
WINDOW_S = 10.0


def single_process_steps_per_s(steps: int = 60_000) -> float:
    torch.set_num_threads(1)
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(ENVS)])
    obs, _ = envs.reset(seed=0)
    agent = PgAgent(obs[0].astype(np.float32), envs.single_action_space, ModelConfig(hidden_sizes=(64, 64)))
    t0 = time.perf_counter()
    for _ in range(steps // ENVS):
        with torch.no_grad():
            action, _ = agent.step(torch.from_numpy(obs.astype(np.float32)))
        obs, *_ = envs.step(action.numpy())
    rate = steps // ENVS * ENVS / (time.perf_counter() - t0)
    envs.close()
    return rate


def _sampler_steps(run: Run) -> float:
    page = urllib.request.urlopen(f"http://127.0.0.1:{run.metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(r"^rlpipe_sampler_env_steps_total\{[^}]*\} (\S+)", page, re.M))


def pipeline_steps_per_s(tmp_path) -> float:
    # A2C with long segments: one cheap update per 2048 steps, so sampling is what is measured.
    run = Run.launch(tmp_path, "cartpole_a2c.toml", "sampler.count=2", "sampler.envs=16", "sampler.horizon=64",
                     "run.max_env_steps=100000000", "run.target_return=1e9", "replay.release_on_sample=false",
                     "replay.capacity=8")
    try:
        run.wait_steps(20_000)
        s0, t0 = _sampler_steps(run), time.monotonic()
        time.sleep(WINDOW_S)
        return (_sampler_steps(run) - s0) / (time.monotonic() - t0)
    finally:
        run.close()


def test_pipeline_vs_single_process(tmp_path):
    single, pipe = [], []
    for i in range(3):
        single.append(single_process_steps_per_s())
        pipe.append(pipeline_steps_per_s(tmp_path / str(i)))
    ratio = statistics.median(pipe) / statistics.median(single)
    print(f"\nsingle process (SyncVectorEnv x{ENVS} + inline 64x64 MLP): "
          f"median {statistics.median(single):,.0f} steps/s  runs {[round(x) for x in single]}")
    print(f"pipeline (2 samplers x 16 envs, 1 action-server): median {statistics.median(pipe):,.0f} steps/s  "
          f"runs {[round(x) for x in pipe]}")
    print(f"ratio pipeline / single process: {ratio:.2f}")
    assert ratio > 0


def test_ppo_cartpole_wall_clock_to_475(tmp_path):
    times = []
    for i in range(3):
        run = Run.launch(tmp_path / str(i), "cartpole_ppo.toml")
        try:
            result = run.wait_result(300)
        finally:
            run.close()
        assert result["reason"] == "target", result
        times.append((result["first_batch_to_end_s"], result["env_steps"]))
    print(f"\nPPO CartPole-v1 to mean 475: runs (s from first batch, env steps) {times}; "
          f"median {statistics.median(t for t, _ in times):.1f} s")
