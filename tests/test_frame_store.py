"""The Atari frame store: stacks rebuilt from one frame a step equal the env's, across episode
ends, writer seams, lost segments and ring wrap-around; real Pong; bad configurations."""

from __future__ import annotations

import dataclasses
import os
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.replay.tables import make_table
from shared.config import loading, schema
from shared.transport import shm
from shared.agents.config import QAgentInfo
from shared.envs.backends import make_env_group
from shared.envs.group import EnvConfig
from shared.data.layout import segment_spec, step_example
from shared.data.namedarraytuple import buffer_from_example, from_spec, leaves, spec_of, with_leading_dims
from shared.replay.arena import ShmArena, fingerprint
from shared.replay.rate_limiter import RateLimiter
from shared.replay.selectors import Fifo
from shared.replay.storage import StorageConfig
from shared.replay.tables import Table
from shared.replay.transitions import TransitionStorage, TransitionStorageConfig
from tests.pipeline import CONFIGS

H, W = 2, 3


def _frame(fid: int) -> np.ndarray:
    """A frame that spells its id: no two frames of a run are equal."""
    return np.array([fid & 255, (fid >> 8) & 255, (fid >> 16) & 255, 1, 2, 3], np.uint8).reshape(H, W)


def _fid(frame: np.ndarray) -> int:
    return int(frame[0, 0]) | int(frame[0, 1]) << 8 | int(frame[0, 2]) << 16


class FakeEnvs:
    """B columns of gymnasium's FrameStackObservation over an env whose frames all differ:
    reset pads the first stack with copies of the reset frame; final_observation is the
    stack rolled by the episode's last frame."""

    def __init__(self, B: int, K: int, rng, next_id):
        self.B, self.K, self.rng, self.next_id = B, K, rng, next_id
        self.stacks = [self._reset() for _ in range(B)]

    def _reset(self) -> deque:
        f = _frame(self.next_id())
        return deque([f] * self.K, maxlen=self.K)

    def segment(self, T: int, p_done: float):
        seg = buffer_from_example(step_example(np.zeros((self.K, H, W), np.uint8), np.int64(0),
                                               QAgentInfo(value=np.float32(0))), [T, self.B])
        seg.final_observation[:] = 0
        for t in range(T):
            for b in range(self.B):
                seg.observation[t, b] = np.stack(self.stacks[b])
                seg.action[t, b] = self.next_id()  # identifies the transition
                seg.reward[t, b] = self.rng.normal()
                u = self.rng.random()
                seg.terminated[t, b] = u < p_done / 2
                seg.truncated[t, b] = p_done / 2 <= u < p_done
                self.stacks[b].append(_frame(self.next_id()))
                if seg.terminated[t, b] or seg.truncated[t, b]:
                    seg.final_observation[t, b] = np.stack(self.stacks[b])
                    self.stacks[b] = self._reset()
        seg.agent_info.value[:] = 0
        seg.policy_version[:] = 0
        return seg


def _all_items(table: Table) -> dict[int, tuple]:
    """{action: (observation, bootstrap observation, return, discount, window steps or None)} of every live item."""
    n = table.size
    if n == 0:
        return {}
    dest = from_spec(table.storage.batch_spec(n))
    table.sample_into(dest, n)
    return {int(dest.action[i]): (dest.observation[i], dest.bootstrap_observation[i], float(dest.return_[i]),
                                  float(dest.bootstrap_discount[i]), None if dest.steps is None else dest.steps[i]) for i in range(n)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(K=st.sampled_from([1, 2, 4]), T=st.integers(1, 4), n=st.integers(1, 3),
       widths=st.lists(st.integers(1, 3), min_size=1, max_size=3), extra_rows=st.integers(0, 6),
       p_done=st.sampled_from([0.0, 0.1, 0.4]), ops=st.lists(st.integers(0, 99), min_size=1, max_size=40),
       seed=st.integers(0, 2**16), store_steps=st.booleans())
def test_frame_store_returns_the_stacks_a_naive_store_returns(K, T, n, widths, extra_rows, p_done, ops, seed,
                                                              store_steps):
    rng = np.random.default_rng(seed)
    counter = iter(range(1, 1 << 24))
    widths = dict(enumerate(widths))
    envs = {w: FakeEnvs(b, K, rng, lambda: next(counter)) for w, b in widths.items()}
    spec = spec_of(FakeEnvs(1, K, rng, lambda: 0).segment(T, 0.0))
    capacity = (T + n + extra_rows) * sum(widths.values())
    cfg = TransitionStorageConfig(n_step=n, gamma=0.9, store_steps=store_steps)
    naive = Table(TransitionStorage(spec, widths, StorageConfig(capacity), cfg), Fifo(), RateLimiter())
    store = TransitionStorage(spec, widths, StorageConfig(capacity, frame_store=True),
                              dataclasses.replace(cfg, final_frames=1))
    frames = Table(store, Fifo(), RateLimiter())
    F = store.ring.frames.F
    seen = {(w, b): set() for w in widths for b in range(widths[w])}  # frame ids replay got since the seam
    trajectory = {}  # frame id -> the ``seen`` set of the trajectory it was inserted in
    dones = []  # frame id of the final frame of every done step, in the order the ring stores them
    for op in ops:
        w = op % len(widths)
        if op >= 80:  # the sampler restarted: new envs, a seam
            envs[w] = FakeEnvs(widths[w], K, rng, lambda: next(counter))
            for table in (naive, frames):
                table.reset_writer(w)
            seen.update({(w, b): set() for b in range(widths[w])})
            continue
        seg = envs[w].segment(T, p_done)
        if op >= 70:  # a segment lost on the way (a gap in serial numbers): a seam mid-episode
            for table in (naive, frames):
                table.reset_writer(w)
            seen.update({(w, b): set() for b in range(widths[w])})
            continue
        for table in (naive, frames):
            table.insert(w, seg)
        for t in range(T):
            for b in range(widths[w]):
                seen[(w, b)].add(_fid(seg.observation[t, b, -1]))
                trajectory[_fid(seg.observation[t, b, -1])] = seen[(w, b)]
        for t, b in zip(*np.nonzero(seg.terminated | seg.truncated)):
            seen[(w, b)].add(_fid(seg.final_observation[t, b, -1]))
            dones.append(_fid(seg.final_observation[t, b, -1]))
    kept_finals, all_finals = set(dones[-F:]), set(dones)
    want, got = _all_items(naive), _all_items(frames)
    expected = set()
    for action, (obs, boot, *_) in want.items():
        column = trajectory[_fid(obs[-1])]
        ids = {_fid(f) for f in obs} | {_fid(f) for f in boot}
        from_final = _fid(boot[-1]) in all_finals  # a final frame never shows in an observation
        if ids <= column and (not from_final or _fid(boot[-1]) in kept_finals):
            expected.add(action)
    assert set(got) == expected
    for action in got:
        obs, boot, ret, disc, steps = got[action]
        np.testing.assert_array_equal(obs, want[action][0])
        np.testing.assert_array_equal(boot, want[action][1])
        assert (ret, disc) == want[action][2:4]
        assert (steps is None) == (not store_steps)
        for (_, leaf), (_, naive_leaf) in zip(leaves(steps), leaves(want[action][4])):  # each step's stack too
            np.testing.assert_array_equal(leaf, naive_leaf)


def _pong_segments(T: int, B: int, n_segments: int, backend: str):
    envs = make_env_group(EnvConfig(id="ALE/Pong-v5", kwargs='{"repeat_action_probability": 0.0}',
                                    wrappers=("atari", "episodic_life"), max_episode_steps=45, backend=backend),
                          B, base_seed=3)
    example = step_example(envs.example_observation(), np.int64(0), QAgentInfo(value=np.float32(0)))
    obs = buffer_from_example(example.observation, [B])
    envs.reset(obs)
    rng = np.random.default_rng(0)
    segments = []
    for _ in range(n_segments):
        seg = buffer_from_example(example, [T, B])
        for t in range(T):
            seg.observation[t] = obs
            seg.action[t] = rng.integers(0, 6, B)
            envs.step(seg.action[t], obs, seg.reward[t], seg.terminated[t], seg.truncated[t], seg.final_observation[t])
        seg.agent_info.value[:] = 0
        seg.policy_version[:] = 0
        segments.append(seg)
    envs.close()
    return example, segments


@pytest.mark.parametrize("backend", ["gymnasium", "envpool"])
def test_pong_stacks_come_back_exactly_also_from_a_table_reattached_in_shared_memory(backend):
    if backend == "envpool":
        pytest.importorskip("envpool")
    T, B = 16, 2
    example, segments = _pong_segments(T, B, 12, backend)  # 384 steps, a truncation every 45
    spec = with_leading_dims(spec_of(example), [T, B])
    cfg = TransitionStorageConfig(n_step=3, gamma=0.99)
    naive = Table(TransitionStorage(spec, {0: B}, StorageConfig(B * 150), cfg), Fifo(), RateLimiter())
    run_id = f"framestore{os.getpid()}"

    def shm_table():
        arena = ShmArena(run_id, 0, fingerprint("pong", B * 150))
        return Table(TransitionStorage(spec, {0: B}, StorageConfig(B * 150, frame_store=True), cfg, arena), Fifo(),
                     RateLimiter(arena=arena), arena=arena)

    table = shm_table()
    try:
        for seg in segments:
            naive.insert(0, seg)
            table.insert(0, seg)
        done = np.concatenate([s.terminated | s.truncated for s in segments])
        assert done.sum() >= 8 and table.size == naive.size > 200
        want = _all_items(naive)
        # What a replay restarted after kill -9 finds: the same items, nothing dropped.
        again = shm_table()
        assert again.arena.restored
        assert (again.recovered["op"], again.recovered["dropped"], again.recovered["size"]) == ("none", 0, table.size)
        assert again.metrics()["frames_unrebuilt_items"] == 0 and again.metrics()["final_frame_evictions"] == 0
        got = _all_items(again)  # a queue: this takes them all (from the one table in shared memory)
        assert set(got) == set(want)
        for action, (obs, boot, ret, disc, _) in got.items():
            np.testing.assert_array_equal(obs, want[action][0])
            np.testing.assert_array_equal(boot, want[action][1])
            assert (ret, disc) == want[action][2:4]
        assert table.storage.nbytes < naive.storage.nbytes / 4
    finally:
        table.arena.unlink()
    assert not shm.run_segments(run_id)


def test_frame_store_needs_frame_stack_observations():
    example = step_example(np.zeros(4, np.float32), np.int64(0), QAgentInfo(value=np.float32(0)))
    exp = loading.load(CONFIGS / "cartpole_dqn.toml", ["replay.frame_store=true"])
    with pytest.raises(ValueError, match=r"replay.frame_store: needs observations that are one \[K, H, W\] uint8.*"
                                         r"dtype float32 shape \[4\]"):
        make_table(exp.replay, {0: 4}, segment_spec(example, 8, 4), sample_size=32)
    with pytest.raises(schema.ConfigError, match="replay.frame_store = true: only the off-policy tables"):
        loading.load(CONFIGS / "cartpole_ppo.toml", ["replay.frame_store=true"])
