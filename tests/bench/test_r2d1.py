"""Benchmark: the R2D1 sequence table's sampling throughput, and R2D1 updates per second on Pong.

Sampling: a prioritized sequence table of 1M CartPoleNoVel-sized steps (LSTM 64 state stored
per step) with sequences of 20 steps every 10, half full, batches of 32 and 64 sequences,
against a plain numpy fancy-index gather of the same [L, n] windows from the same ring;
median of 5 repetitions. Pong: a direct ``algo.update`` loop on a real Pong sequence batch
(atari_pong_r2d1.toml's network: Nature CNN + LSTM 512, L = 80 with 40 of burn-in) at batch
sizes 8 and 64, on this machine's CPUs. Run with `make bench` (under the bench lock).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np
import pytest
import torch

from shared.agents.config import ModelConfig, info_example
from shared.data.layout import segment_spec, step_example
from shared.data.namedarraytuple import buffer_from_example, from_spec
from shared.replay.rate_limiter import RateLimiter, RateLimiterConfig
from shared.replay.selectors import Prioritized
from shared.replay.sequences import SequenceStorage, SequenceStorageConfig
from shared.replay.storage import StorageConfig
from shared.replay.tables import Table

pytestmark = pytest.mark.bench
CAPACITY, T, B, L, P, REPEAT = 1_000_000, 64, 16, 20, 10, 5


def _segment(rng):
    example = step_example(np.zeros(2, np.float32), np.int64(0),
                           info_example("q", ModelConfig(lstm_size=64, lstm_prev_action=True), np.int64(0)))
    seg = buffer_from_example(example, [T, B])
    seg.observation[:] = rng.standard_normal((T, B, 2))
    seg.action[:] = rng.integers(0, 2, (T, B))
    seg.reward[:] = 1.0
    seg.terminated[:] = rng.random((T, B)) < 0.01
    seg.truncated[:] = False
    seg.agent_info.memory.state.h[:] = rng.standard_normal(seg.agent_info.memory.state.h.shape)  # [T, B, layers, 64]
    return example, seg


def test_sequence_table_sampling_throughput():
    rng = np.random.default_rng(0)
    example, seg = _segment(rng)
    storage = SequenceStorage(segment_spec(example, T, B)["fields"][0][1], {0: B},
                              StorageConfig(CAPACITY), SequenceStorageConfig(length=L, period=P))
    table = Table(storage, Prioritized(), RateLimiter(RateLimiterConfig(min_size_to_sample=1)))
    for _ in range(CAPACITY // (T * B) // 2):
        table.insert(0, seg)
    ring = storage.ring.flat
    print(f"\nsequence table: {table.size:,} sequences of {L} steps live")
    for n in (32, 64):
        dest = from_spec(storage.batch_spec(n))
        per = {"table": [], "numpy": []}
        for _ in range(REPEAT):
            t0 = time.perf_counter()
            for _ in range(50):
                info = table.sample_into(dest, n)
                table.update_priorities(info["keys"], info["generations"], rng.random(n))
            per["table"].append(50 * n / (time.perf_counter() - t0))
            keys = np.flatnonzero(table.live)
            t0 = time.perf_counter()
            for _ in range(50):  # the baseline: uniform keys, the same [L, n] windows by fancy indexing
                k = rng.choice(keys, n)
                steps = (k[None, :] + np.arange(L)[:, None] * B) % storage.num_slots
                [ring.observation[steps], ring.action[steps], ring.reward[steps], ring.terminated[steps],
                 ring.truncated[steps], ring.agent_info.memory.prev_action[steps],
                 ring.agent_info.memory.prev_reward[steps], ring.agent_info.memory.state.h[k],
                 ring.agent_info.memory.state.c[k]]
            per["numpy"].append(50 * n / (time.perf_counter() - t0))
        t, b = statistics.median(per["table"]), statistics.median(per["numpy"])
        print(f"batch {n}: prioritized sequence table {t:,.0f} sequences/s (sample + priority update), "
              f"numpy gather {b:,.0f} sequences/s, ratio {t / b:.2f}x")


def pong_r2d1_update_s(batch_size: int, device: torch.device, repeats: int = 3, around=contextlib.nullcontext,
                       prepare=lambda agent: None) -> tuple[float, int]:
    """(median seconds, sequence length) of one R2D1 ``algo.update`` of atari_pong_r2d1.toml's network on ``device``,
    on a Pong-shaped sequence batch of ``batch_size`` (random frames and rewards); each update runs
    inside ``around()`` (e.g. an autocast), and ``prepare(agent)`` runs once the algorithm is built."""
    from services.serial import train_serial  # noqa: F401  (imports the services the way a run does)
    from shared.config import loading as config
    from services.build import batch_spec, env_probe, example_step, make_agent, make_algo
    from shared.data.namedarraytuple import torchify
    from tests.pipeline import CONFIGS

    exp = config.load(CONFIGS / "atari_pong_r2d1.toml", [f"algo.batch_size={batch_size}", f"run.device='{device}'"])
    probe = env_probe(exp)
    agent = make_agent(exp, probe).to(device)
    algo = make_algo(exp, agent)
    prepare(agent)
    batch = from_spec(batch_spec(exp, example_step(exp, probe)))
    probe.close()
    rng = np.random.default_rng(0)
    batch.observation[:] = rng.integers(0, 256, batch.observation.shape, dtype=np.uint8)
    batch.action[:] = rng.integers(0, 6, batch.action.shape)
    batch.prev_action[:] = batch.action
    batch.reward[:] = rng.choice([-1.0, 0.0, 1.0], batch.reward.shape, p=[0.01, 0.98, 0.01])
    batch.terminated[:] = False
    batch.truncated[:] = False
    batch.is_weight[:] = 1.0
    tb = torchify(batch, device)
    times = []
    for i in range(repeats + 1):  # the first is warm-up
        t0 = time.perf_counter()
        with around():
            algo.update(tb, 0.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), exp.replay.sequences.length


def test_r2d1_pong_updates_per_second():
    print(f"\ntorch threads {torch.get_num_threads()}")
    for n in (8, 64):
        med, length = pong_r2d1_update_s(n, torch.device("cpu"))
        print(f"Pong R2D1 update, batch {n} x {length} steps: {med:.2f} s median "
              f"({1 / med:.2f} updates/s, {n * length / med:,.0f} sequence steps/s)")
