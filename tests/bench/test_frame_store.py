"""Benchmark: the Atari frame store against the naive stacked transition storage.

Pong-shaped steps ([4, 84, 84] uint8 stacks, n-step 3, 2 samplers x 4 envs, segments of
32): bytes per transition from ``storage.nbytes`` / capacity, the memory a 1M-transition
buffer needs (the frame store is built, its frame pages are never touched; the naive one is
computed, it would need ~56 GB), and insert and sample throughput of both storages holding
the same 16k transitions of synthetic frame stacks, alternating, median of 5 rounds. Run
with `make bench` (or `flock /tmp/rlpipe-bench.lock python -m pytest -s -m bench
tests/bench/test_frame_store.py`).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest

from shared.agents.config import QAgentInfo
from shared.data.layout import step_example
from shared.data.namedarraytuple import buffer_from_example, from_spec, spec_of, with_leading_dims
from shared.replay.rate_limiter import RateLimiter
from shared.replay.selectors import Uniform
from shared.replay.storage import StorageConfig
from shared.replay.tables import Table
from shared.replay.transitions import TransitionStorage, TransitionStorageConfig

pytestmark = pytest.mark.bench
K, H, W, T, N_STEP, REPEAT = 4, 84, 84, 32, 3, 5
WIDTHS = {0: 4, 1: 4}
EXAMPLE = step_example(np.zeros((K, H, W), np.uint8), np.int64(0), QAgentInfo(value=np.float32(0)))
SPEC = with_leading_dims(spec_of(EXAMPLE), [T, 4])


def _storage(capacity: int, frame_store: bool) -> TransitionStorage:
    return TransitionStorage(SPEC, WIDTHS, StorageConfig(capacity, frame_store), TransitionStorageConfig(n_step=N_STEP, gamma=0.99))


class Stacks:
    """B envs of random frames stacked as FrameStackObservation does; an episode ends with p=0.01."""

    def __init__(self, B: int, rng):
        self.rng, self.B = rng, B
        self.stack = np.repeat(self._frames()[:, None], K, axis=1)

    def _frames(self):
        return self.rng.integers(0, 256, (self.B, H, W), dtype=np.uint8)

    def segment(self):
        seg = buffer_from_example(EXAMPLE, [T, self.B])
        seg.action[:] = self.rng.integers(0, 6, (T, self.B))
        seg.reward[:] = self.rng.choice([-1.0, 0.0, 1.0], (T, self.B))
        seg.terminated[:] = self.rng.random((T, self.B)) < 0.01
        seg.truncated[:] = False
        seg.agent_info.value[:] = 0
        seg.policy_version[:] = 0
        for t in range(T):
            seg.observation[t] = self.stack
            self.stack = np.concatenate([self.stack[:, 1:], self._frames()[:, None]], axis=1)
            seg.final_observation[t] = self.stack
            done = seg.terminated[t]
            self.stack[done] = np.repeat(self._frames()[done][:, None], K, axis=1)
        return seg


def _rate(fn, items: int, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return items * calls / (time.perf_counter() - t0)


def test_frame_store_memory_and_throughput():
    per_transition = {}
    for name, fs in (("naive", False), ("frame store", True)):
        s = _storage(8 * 2000, fs)
        per_transition[name] = s.nbytes / s.config.capacity
    big = _storage(1_000_000, True)  # np.empty frames: pages untouched
    heap = (big.return_.nbytes + big.discount.nbytes + big.bootstrap_key.nbytes + big.bootstrap_final.nbytes)
    print()
    print(f"bytes/transition: naive {per_transition['naive']:,.0f}, frame store {per_transition['frame store']:,.0f} "
          f"({per_transition['naive'] / per_transition['frame store']:.2f}x less); frame alone {H * W:,}")
    print(f"1M-transition Pong buffer: frame store {big.nbytes / 1e9:.2f} GB in the ring (+{heap / 1e9:.3f} GB "
          f"n-step arrays on the heap, {big.ring.frames.F:,} final frames); naive "
          f"{per_transition['naive'] * 1e6 / 1e9:.1f} GB")
    assert big.nbytes <= 7.5e9
    del big

    rng = np.random.default_rng(0)
    capacity = 16_000
    streams = {w: Stacks(b, rng) for w, b in WIDTHS.items()}
    segments = [(w, streams[w].segment()) for _ in range(capacity // (T * 8) + 4) for w in WIDTHS]
    tables = {name: Table(_storage(capacity, fs), Uniform(), RateLimiter())
              for name, fs in (("naive", False), ("frame store", True))}
    rates = {(name, what): [] for name in tables for what in ("insert", 32, 256)}
    for _ in range(REPEAT):
        for name, table in tables.items():
            it = iter(segments)
            rates[(name, "insert")].append(_rate(lambda: table.insert(*next(it)), T * 4, len(segments)))
            for n in (32, 256):
                dest = from_spec(table.storage.batch_spec(n))
                rates[(name, n)].append(_rate(lambda: table.sample_into(dest, n), n, 4000 // n * 4))
    med = {k: statistics.median(v) for k, v in rates.items()}
    for what in ("insert", 32, 256):
        label = "insert" if what == "insert" else f"sample batch {what}"
        print(f"{label:16s} naive {med[('naive', what)]:12,.0f} transitions/s   frame store "
              f"{med[('frame store', what)]:12,.0f} ({med[('frame store', what)] / med[('naive', what)]:.2f}x)")
    assert tables["frame store"].size == tables["naive"].size
