"""Benchmark: env steps/s of the pipeline against one process stepping the same envs and policy.

All of them are measured in the same run, alternating, three times each, and the medians compared:

- baseline: gymnasium SyncVectorEnv of 2 x 16 CartPole-v1 envs with the 64x64 MLP policy
  called inline on all 32 observations every step (one process);
- local: 2 samplers x 16 envs, each acting with its own copy of the policy and a ring of 2
  segments, replay and a learner whose updates are cheap (A2C, T=64), under supervisord;
- server: the same with 1 action-server batching both samplers' alternating env groups;
  with one group of 16 envs a sampler (``sampler.alternating = false``); and with one group
  and one action-server a sampler (``action_server.count = 2``): on this 2-vCPU machine a
  wake-up on the other CPU costs ~30 us (a pipe round trip between two processes: 58-61 us
  across CPUs, 2.6 us on one), so each sampler and its own action-server share a CPU best.

And the cross-node data path: the local run over TCP with samplers and learner placed on
other nodes than replay (segments, batches and parameters as ZeroMQ frames) against the
same run over TCP on one node (shared-memory descriptors), alternating, three times each.

Pipeline steps/s come from the samplers' Prometheus counter over a window after warm-up.
Run with `make bench`.
"""

from __future__ import annotations

import os
import re
import statistics
import time
import urllib.request

import gymnasium as gym
import numpy as np
import pytest
import torch

from shared.agents.pg import PgAgent
from shared.agents.models import ModelConfig
from tests.pipeline import Run, free_port, rate_medians

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


def _updates(run: Run) -> tuple[float, float]:
    """(updates, wall seconds) of the learner's latest progress row."""
    rows = run.progress()
    return (float(rows[-1]["updates"]), float(rows[-1]["wall_s"])) if rows else (0.0, 0.0)


def pipeline_rates(tmp_path, config: str, overrides: list[str], warm_steps: int, window_s: float,
                   timeout: float = 120) -> dict[str, float]:
    """Env steps/s (the samplers' counter) and learner updates/s (its progress rows) of a run of
    ``config`` over ``window_s`` once it has made ``warm_steps`` env steps."""
    run = Run.launch(tmp_path, config, *overrides)
    try:
        run.wait_steps(warm_steps, timeout)
        s0, t0, (u0, w0) = _sampler_steps(run), time.monotonic(), _updates(run)
        time.sleep(window_s)
        s1, t1, (u1, w1) = _sampler_steps(run), time.monotonic(), _updates(run)
        return {"env_steps_per_s": (s1 - s0) / (t1 - t0), "updates_per_s": (u1 - u0) / (w1 - w0) if w1 > w0 else 0.0}
    finally:
        run.close()


def sampling_rate(tmp_path, config: str, overrides: list[str], window_s: float, warm_steps: int = 4_000) -> float:
    """Env steps/s of a run of ``config`` over ``window_s`` once its samplers have made
    ``warm_steps``, both from the samplers' counter (a run whose learner never trains counts no
    steps in progress rows)."""
    run = Run.launch(tmp_path, config, *overrides)
    try:
        run.wait_for(lambda: _sampler_steps(run) >= warm_steps, 120, f"{warm_steps} sampled env steps")
        s0, t0 = _sampler_steps(run), time.monotonic()
        time.sleep(window_s)
        return (_sampler_steps(run) - s0) / (time.monotonic() - t0)
    finally:
        run.close()


def pipeline_steps_per_s(tmp_path, inference: str, *overrides: str) -> float:
    # A2C with long segments: one cheap update per 2048 steps, so sampling is what is measured.
    # A ring of 2 segments lets a sampler fill the next one while replay copies the last
    # (with 1 it waits for that round trip once a segment: measured 26-27k vs 33-37k steps/s).
    return pipeline_rates(tmp_path, "cartpole_a2c.toml",
                          ["sampler.count=2", "sampler.envs=16", "sampler.horizon=64", "sampler.ring=2",
                           "run.max_env_steps=100000000", "run.target_return=1e9", "replay.release_on_sample=false",
                           "replay.capacity=8", f"sampler.inference={inference}", *overrides],
                          20_000, WINDOW_S)["env_steps_per_s"]


MODES = {"local": ["local"], "server": ["server"], "server, one env group": ["server", "sampler.alternating=false"],
         "server, one env group and action-server a sampler": ["server", "sampler.alternating=false",
                                                               "action_server.count=2"]}


def test_pipeline_vs_single_process(tmp_path):
    rates = {"single": [], **{mode: [] for mode in MODES}}
    for i in range(3):
        rates["single"].append(single_process_steps_per_s())
        for j, (mode, args) in enumerate(MODES.items()):
            rates[mode].append(pipeline_steps_per_s(tmp_path / f"{j}.{i}", *args))
    rate_medians(rates, "single", {"single": f"single process (SyncVectorEnv x{ENVS} + inline 64x64 MLP)",
                                   **{m: f"pipeline, {m} inference (2 samplers x 16 envs)" for m in MODES}})
    assert all(r > 0 for mode in MODES for r in rates[mode])


def test_cross_node_frames_vs_shared_memory(tmp_path):
    tcp = ["network.transport='tcp'"]
    placed = {"shm": [], "frames": ["placement.sampler='b'", "placement.learner='c'"]}
    rates = {"shm": [], "frames": []}
    for i in range(3):
        for path, overrides in placed.items():
            rates[path].append(pipeline_steps_per_s(tmp_path / f"{path}{i}", "local", *tcp, *overrides,
                                                    f"network.base_port={free_port()}"))
    shm, frames = statistics.median(rates["shm"]), statistics.median(rates["frames"])
    print(f"\nTCP, one node (shared memory): median {shm:,.0f} steps/s  runs {[round(x) for x in rates['shm']]}")
    print(f"TCP, samplers and learner on other nodes (frames): median {frames:,.0f} steps/s  "
          f"runs {[round(x) for x in rates['frames']]}  ratio to shared memory {frames / shm:.2f}")
    assert all(r > 0 for r in rates["shm"] + rates["frames"])


def pipe_round_trip_us(cpus: tuple[int, int], trips: int = 20_000) -> float:
    """A one-byte ping-pong over two pipes between this process (on ``cpus[0]``) and a forked
    child (on ``cpus[1]``): the doorbell's cost per step without the work around it."""
    ping, pong = os.pipe(), os.pipe()
    child = os.fork()
    if child == 0:  # the child only echoes
        os.sched_setaffinity(0, {cpus[1]})
        for _ in range(trips):
            os.read(ping[0], 8)
            os.write(pong[1], b"r")
        os._exit(0)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})
    try:
        t0 = time.perf_counter()
        for _ in range(trips):
            os.write(ping[1], b"q")
            os.read(pong[0], 8)
        elapsed = time.perf_counter() - t0
    finally:
        os.sched_setaffinity(0, before)
        os.waitpid(child, 0)
        for fd in (*ping, *pong):
            os.close(fd)
    return elapsed / trips * 1e6


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_wake_up_across_cpus_vs_on_one():
    """Why one action-server a sampler beats one for both on a small CPU machine: a sampler
    and its action-server that share a CPU hand over in a context switch; across CPUs each
    step pays a wake-up of the other CPU (in a VM, often out of halt)."""
    a, b = sorted(os.sched_getaffinity(0))[:2]
    same = statistics.median(pipe_round_trip_us((a, a)) for _ in range(3))
    across = statistics.median(pipe_round_trip_us((a, b)) for _ in range(3))
    print(f"\npipe round trip between two processes: on one CPU {same:.1f} us, across two {across:.1f} us "
          f"({across / same:.1f}x)")
    assert same > 0 and across > 0
