"""Benchmark: replay table insert and sample throughput against a plain numpy ring buffer.

Capacity 1M transitions of CartPole-sized steps, segments of 64 steps x 16 envs, batches
of 256; uniform and prioritized (n-step 3) tables against a ring that stores the same
arrays and samples uniform indices with fancy indexing, measured in the same run, median
of 5 repetitions. Then R2D1's hot path in batches/s: a prioritized sample of 256 plus the
priority update of those 256, from a full 1M-item table, against the ring's uniform sample
of 256. Run with `make bench`.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest

from shared.data.layout import step_example
from shared.data.namedarraytuple import buffer_from_example, from_spec, leaves, spec_of, with_leading_dims
from shared.replay.rate_limiter import RateLimiter, RateLimiterConfig
from shared.replay.selectors import Prioritized, PrioritizedConfig, Uniform
from shared.replay.storage import StorageConfig
from shared.replay.tables import Table
from shared.replay.transitions import TransitionStorage, TransitionStorageConfig
from shared.agents.config import QAgentInfo

pytestmark = pytest.mark.bench
CAPACITY, T, B, BATCH, REPEAT = 1_000_000, 64, 16, 256, 5


def _segment(rng):
    example = step_example(np.zeros(4, np.float32), np.int64(0), QAgentInfo(value=np.float32(0)))
    seg = buffer_from_example(example, [T, B])
    seg.observation[:] = rng.standard_normal((T, B, 4))
    seg.final_observation[:] = seg.observation
    seg.action[:] = rng.integers(0, 2, (T, B))
    seg.reward[:] = 1.0
    seg.terminated[:] = rng.random((T, B)) < 0.01
    seg.truncated[:] = False
    seg.agent_info.value[:] = 0.0
    seg.policy_version[:] = 0
    return example, seg


class NumpyRing:
    """The baseline: one preallocated array per field, a write cursor, uniform fancy-index sampling."""

    def __init__(self, example, capacity: int):
        self.data = buffer_from_example(example, [capacity])
        self.capacity, self.cursor, self.size = capacity, 0, 0

    def insert(self, seg) -> None:
        n = T * B
        idx = (self.cursor + np.arange(n)) % self.capacity
        for (_, dst), (_, src) in zip(leaves(self.data), leaves(seg)):
            dst[idx] = src.reshape(n, *src.shape[2:])
        self.cursor = (self.cursor + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, rng) -> list:
        idx = rng.integers(0, self.size, BATCH)
        return [leaf[idx] for _, leaf in leaves(self.data)]


def _fill_and_time(insert, sample, seg, rng, inserts_before: int, n_inserts: int, n_samples: int):
    for _ in range(inserts_before):
        insert(seg)
    t0 = time.perf_counter()
    for _ in range(n_inserts):
        insert(seg)
    t_insert = (time.perf_counter() - t0) / n_inserts
    t0 = time.perf_counter()
    for _ in range(n_samples):
        sample()
    t_sample = (time.perf_counter() - t0) / n_samples
    return T * B / t_insert, BATCH / t_sample


def test_replay_tables_vs_numpy_ring():
    rng = np.random.default_rng(0)
    example, seg = _segment(rng)
    fill = CAPACITY // (T * B) // 2  # half full: sampling sees a large table
    results = {"numpy ring": [], "uniform": [], "prioritized": []}
    for _ in range(REPEAT):
        ring = NumpyRing(example, CAPACITY)
        results["numpy ring"].append(_fill_and_time(ring.insert, lambda: ring.sample(rng), seg, rng, fill, 50, 500))
        for name, selector in (("uniform", Uniform()), ("prioritized", Prioritized(PrioritizedConfig()))):
            storage = TransitionStorage(with_leading_dims(spec_of(example), [T, B]), {0: B},
                                        StorageConfig(CAPACITY), TransitionStorageConfig(n_step=3, gamma=0.99))
            table = Table(storage, selector, RateLimiter(RateLimiterConfig()))
            dest = from_spec(storage.batch_spec(BATCH))

            def sample():
                info = table.sample_into(dest, BATCH)
                if name == "prioritized":
                    table.update_priorities(info["keys"], info["generations"], rng.random(BATCH))

            results[name].append(_fill_and_time(lambda s: table.insert(0, s), sample, seg, rng, fill, 50, 500))
    base_ins = statistics.median(r[0] for r in results["numpy ring"])
    base_smp = statistics.median(r[1] for r in results["numpy ring"])
    print()
    for name, rows in results.items():
        ins, smp = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        print(f"{name:12s} insert {ins:12,.0f} transitions/s ({ins / base_ins:5.2f}x ring)   "
              f"sample {smp:12,.0f} transitions/s ({smp / base_smp:5.2f}x ring)")
    assert base_ins > 0 and base_smp > 0


def test_prioritized_batches_vs_numpy_ring():
    """Batches/s of 256 from full 1M-item tables, median of 5 alternating repetitions.

    "selector": Prioritized.sample (keys and importance weights) + Prioritized.update, the
    sum-tree work alone. "table": Table.sample_into (also gathers the n-step transitions)
    + Table.update_priorities, what the replay service does per learner batch.
    """
    rng = np.random.default_rng(0)
    example, seg = _segment(rng)
    fill = -(-CAPACITY // (T * B))  # enough segments to fill every slot
    ring = NumpyRing(example, CAPACITY)
    for _ in range(fill):
        ring.insert(seg)
    selector = Prioritized(PrioritizedConfig())
    selector.allocate(CAPACITY)
    selector.insert(np.arange(CAPACITY))
    selector.update(np.arange(CAPACITY), rng.random(CAPACITY))
    storage = TransitionStorage(with_leading_dims(spec_of(example), [T, B]), {0: B},
                                StorageConfig(CAPACITY), TransitionStorageConfig(n_step=3, gamma=0.99))
    table = Table(storage, Prioritized(PrioritizedConfig()), RateLimiter(RateLimiterConfig()))
    for _ in range(fill):
        table.insert(0, seg)
    dest = from_spec(storage.batch_spec(BATCH))

    def selector_batch():
        keys, _ = selector.sample(BATCH, rng)
        selector.update(keys, rng.random(BATCH))

    def table_batch():
        info = table.sample_into(dest, BATCH)
        table.update_priorities(info["keys"], info["generations"], rng.random(BATCH))

    runs = {"numpy ring": lambda: ring.sample(rng), "selector": selector_batch, "table": table_batch}
    results = {name: [] for name in runs}
    for _ in range(REPEAT):
        for name, batch in runs.items():
            for _ in range(20):  # warm caches (and the compiled tree loops)
                batch()
            n = 1000
            t0 = time.perf_counter()
            for _ in range(n):
                batch()
            results[name].append(n / (time.perf_counter() - t0))
    base = statistics.median(results["numpy ring"])
    print()
    print(f"{len(selector):,} prioritized items, {table.size:,} in the table, batches of {BATCH}")
    for name, what in (("numpy ring", "uniform sample"), ("selector", "prioritized sample + update"),
                       ("table", "sample_into + update_priorities")):
        rate = statistics.median(results[name])
        print(f"{name:10s} {what:32s} {rate:9,.0f} batches/s ({rate / base:5.2f}x ring)   "
              f"reps {' '.join(f'{r:,.0f}' for r in results[name])}")
    assert base > 0 and len(selector) == CAPACITY and table.size > 0.99 * CAPACITY
