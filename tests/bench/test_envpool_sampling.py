"""Benchmark: Atari Pong sampling through the pipeline on the EnvPool backend against the
machine's limit, raw EnvPool with the same policy inline in one process.

All measured in the same run, alternating, three times each, and the medians compared:

- raw: one EnvPool pool of 16 Pong envs (the ``atari`` preprocessing, worker threads on all
  CPUs) stepped in a loop with the run's Nature-CNN Q agent acting inline (torch, one thread,
  as a sampler acts) on all 16 observations every step;
- envpool: the pipeline with 1 sampler x 16 envs on the EnvPool backend (threads on all
  CPUs), local inference (the same agent), replay (uniform table, frame store) and a learner
  that never updates in the window (``min_size_to_sample`` above what is sampled), so that
  sampling is what is measured;
- gymnasium: the same pipeline on the gymnasium backend, 2 samplers x 8 envs (one env stepped
  at a time, so one sampler a CPU).

And, in a second test against the same raw baseline, server inference: the EnvPool sampler's
16 envs in two alternating groups of 8, one action-server running the agent (one torch
thread), each group's step split in two (``env.split_step = "on"``: group 0 steps in EnvPool's
threads while the sampler waits for and sends group 1) or not (``"off"``); on Pong and on
CartPole (DQN's MLP), where the envs and the sampler's own work weigh more.

Pipeline steps/s come from the samplers' Prometheus counter over a window after warm-up.
Run with `make bench`.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from shared.config import loading
from tests.bench.test_pipeline_throughput import sampling_rate
from tests.pipeline import CONFIGS, rate_medians

pytestmark = pytest.mark.bench
envpool = pytest.importorskip("envpool")

ENVS = 16
WINDOW_S = 8.0
CONFIG = "atari_pong_dqn.toml"
# A learner that never samples (the window inserts far fewer than min_size_to_sample) and an
# unthrottled replay: the samplers run at their own pace.
CHEAP = ["replay.capacity=60000", "replay.min_size_to_sample=60000", "replay.samples_per_insert=0.0",
         "run.target_return=1e9", "sampler.horizon=32", "sampler.ring=2"]
BACKENDS = {"envpool": ["sampler.inference=local", "env.backend='envpool'", "sampler.count=1",
                        f"sampler.envs={ENVS}"],
            "gymnasium": ["sampler.inference=local", "sampler.count=2", f"sampler.envs={ENVS // 2}"]}
SERVER = ["sampler.inference=server", "sampler.alternating=true", "action_server.count=1", "env.backend='envpool'",
          "sampler.count=1", f"sampler.envs={ENVS}"]
SPLIT = {"split": [*SERVER, "env.split_step='on'"], "sync": [*SERVER, "env.split_step='off'"]}
# CartPole's samplers insert far more in a window: a table its learner never samples from either.
LARGER = {"cartpole_dqn.toml": ["replay.capacity=1000000", "replay.min_size_to_sample=1000000"]}


def raw_steps_per_s(seconds: float = WINDOW_S, config: str = CONFIG) -> float:
    """Raw EnvPool and the run's agent inline, one process."""
    from services.build import env_probe, make_agent
    from shared.agents.actor import Actor
    from shared.envs.envpool_backend import default_threads, pool_options
    from shared.runtime.process import torch_device

    torch_device("cpu")  # one torch thread, as a sampler
    exp = loading.load(CONFIGS / config, ["env.backend='envpool'", f"sampler.envs={ENVS}"])
    agent = make_agent(exp, env_probe(exp)).eval()
    act = Actor(agent, np.random.SeedSequence(0))
    task, options, _ = pool_options(exp.env)  # the options the backend gives the same env section
    pool = envpool.make_gymnasium(task, num_envs=ENVS, batch_size=ENVS, num_threads=default_threads(ENVS),
                                  seed=list(range(ENVS)), **options)
    obs, _ = pool.reset()
    env_index, first, reward = np.arange(ENVS), np.zeros(ENVS, bool), np.zeros(ENVS, np.float32)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        action, _ = act(obs, env_index, first, reward, 0, ENVS)
        obs, reward, terminated, truncated, _ = pool.step(np.asarray(action).astype(np.int32))
        first = terminated | truncated  # EnvPool resets these on their next step
        steps += ENVS
    rate = steps / (time.perf_counter() - t0)
    pool.close()
    return rate


def pipeline_steps_per_s(tmp_path, overrides: list[str], config: str = CONFIG) -> float:
    return sampling_rate(tmp_path, config, [*CHEAP, *LARGER.get(config, []), *overrides], WINDOW_S)


def test_pong_sampling_envpool_pipeline_vs_raw_envpool(tmp_path):
    rates = {"raw": [], **{b: [] for b in BACKENDS}}
    for i in range(3):
        rates["raw"].append(raw_steps_per_s())
        for backend in BACKENDS:
            rates[backend].append(pipeline_steps_per_s(tmp_path / f"{backend}{i}", BACKENDS[backend]))
        print(f"\nround {i}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()), flush=True)
    rate_medians(rates, "raw", {
        "raw": f"raw EnvPool x{ENVS} Pong + inline Nature-CNN Q agent ({len(os.sched_getaffinity(0))} CPUs)",
        **{b: f"pipeline, {b} backend ({' '.join(BACKENDS[b][-2:])}), local inference" for b in BACKENDS}})
    assert all(r > 0 for rs in rates.values() for r in rs)


@pytest.mark.parametrize("config", [CONFIG, "cartpole_dqn.toml"])
def test_sampling_envpool_server_inference_with_and_without_split_steps(tmp_path, config):
    """Pong (the Nature CNN: inference is the limit) and CartPole (a 64x64 MLP: the envs and the
    sampler's own work are)."""
    rates = {"raw": [], **{mode: [] for mode in SPLIT}}
    for i in range(3):
        rates["raw"].append(raw_steps_per_s(config=config))
        for mode in SPLIT if i % 2 == 0 else reversed(SPLIT):  # neither always runs first
            rates[mode].append(pipeline_steps_per_s(tmp_path / f"{mode}{i}", SPLIT[mode], config))
        print(f"\nround {i}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()), flush=True)
    medians = rate_medians(rates, "raw", {
        "raw": f"{config}: raw EnvPool x{ENVS} + the agent inline ({len(os.sched_getaffinity(0))} CPUs)",
        **{m: f"pipeline, envpool backend, server inference, 2 alternating groups of {ENVS // 2}, {SPLIT[m][-1]}"
           for m in SPLIT}})
    print(f"split / sync: {medians['split'] / medians['sync']:.2f}")
    assert all(r > 0 for rs in rates.values() for r in rs)
