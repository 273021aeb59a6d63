"""The R2D1 sequence table: which sequences exist, what a sample returns, seams, eviction."""

from __future__ import annotations

import numpy as np
import pytest

from shared.agents.config import ModelConfig, info_example
from shared.data.layout import step_example
from shared.data.namedarraytuple import buffer_from_example, from_spec
from shared.replay.rate_limiter import RateLimiter, RateLimiterConfig
from shared.replay.selectors import Prioritized, Uniform
from shared.replay.sequences import SequenceStorage, SequenceStorageConfig
from shared.replay.storage import StorageConfig
from shared.replay.tables import Table
from shared.data.layout import segment_spec

H, T = 3, 4
MODEL = ModelConfig(lstm_size=H, lstm_prev_action=True)


def _example():
    return step_example(np.zeros(2, np.float32), np.int64(0), info_example("q", MODEL, np.int64(0)))


def _segment(writer: int, s0: int, B: int, done_at=()):
    """Steps s0..s0+T-1 of writer's B columns; every field encodes (writer, step, column) so a
    gathered value tells where it came from: value = 1000 * writer + 10 * step + column."""
    seg = buffer_from_example(_example(), [T, B])
    code = 1000 * writer + 10 * np.arange(s0, s0 + T)[:, None] + np.arange(B)[None, :]
    seg.observation[:] = code[..., None]
    seg.final_observation[:] = -1
    seg.action[:] = code
    seg.reward[:] = code
    seg.terminated[:] = False
    seg.truncated[:] = False
    for s, b in done_at:
        seg.terminated[s - s0, b] = True
    m = seg.agent_info.memory
    m.prev_action[:] = code + 1
    m.prev_reward[:] = code + 2
    m.state.h[:] = code[..., None, None] + 0.5  # [T, B, cores = 1, H]
    m.state.c[:] = code[..., None, None] + 0.25
    seg.agent_info.value[:] = 0
    seg.policy_version[:] = np.arange(s0, s0 + T)[:, None]
    return seg


def _storage(L=6, P=3, capacity=2 * 40, columns=None):
    columns = columns or {0: 2}
    spec = segment_spec(_example(), T, max(columns.values()))["fields"][0][1]
    return SequenceStorage(spec, columns, StorageConfig(capacity), SequenceStorageConfig(length=L, period=P))


def _decode(key, storage):
    row, col = divmod(int(key), storage.ring.B_total)
    return row, col


def test_sequences_start_every_period_and_live_once_complete():
    st = _storage(L=6, P=3)
    added = []
    for k in range(4):  # steps 0..15
        _, keys = st.write(0, _segment(0, 4 * k, 2))
        added.append(sorted(_decode(x, st) for x in keys))
    # starts 0, 3, 6, 9 (complete at steps 5, 8, 11, 14); rows are step % rows with 40 rows.
    assert added == [[], [(0, 0), (0, 1)], [(3, 0), (3, 1), (6, 0), (6, 1)], [(9, 0), (9, 1)]]


def test_a_sample_returns_the_stored_start_state_and_the_steps_in_order():
    st = _storage(L=6, P=3)
    for k in range(4):
        st.write(0, _segment(0, 4 * k, 2))
    keys = np.array([3 * 2 + 1, 6 * 2 + 0])  # start step 3 column 1, start step 6 column 0
    dest = from_spec(st.batch_spec(2))
    st.gather(keys, np.array([0.5, 1.0], np.float32), dest)
    code = 10 * np.array([[3], [6]]) + np.array([[1], [0]])  # [n, 1]
    steps = code.T + 10 * np.arange(6)[:, None]  # [L, n]
    np.testing.assert_array_equal(dest.observation[..., 0], steps)
    np.testing.assert_array_equal(dest.action, steps)
    np.testing.assert_array_equal(dest.reward, steps)
    np.testing.assert_array_equal(dest.prev_action, steps + 1)
    np.testing.assert_array_equal(dest.prev_reward, steps + 2)
    np.testing.assert_array_equal(dest.start_state.h, code[:, :, None] + 0.5 + np.zeros((2, 1, H)))
    np.testing.assert_array_equal(dest.start_state.c, code[:, :, None] + 0.25 + np.zeros((2, 1, H)))
    np.testing.assert_array_equal(dest.is_weight, [0.5, 1.0])
    np.testing.assert_array_equal(dest.policy_version, [3, 6])


def test_episode_ends_inside_a_sequence_are_kept_for_the_learners_resets():
    """A done inside a sequence stays in it (terminated at its step), so the learner resets
    the state before the next step (memory.sequence_reset) and masks the targets."""
    from shared.agents.memory import sequence_reset
    import torch

    st = _storage(L=6, P=3)
    st.write(0, _segment(0, 0, 2, done_at=[(2, 1)]))
    _, keys = st.write(0, _segment(0, 4, 2))
    dest = from_spec(st.batch_spec(2))
    st.gather(np.sort(keys), np.ones(2, np.float32), dest)
    np.testing.assert_array_equal(dest.terminated[:, 1], [0, 0, 1, 0, 0, 0])
    assert not dest.terminated[:, 0].any()
    reset = sequence_reset(torch.as_tensor(dest.terminated), torch.as_tensor(dest.truncated))
    np.testing.assert_array_equal(reset[:, 1].numpy(), [0, 0, 0, 1, 0, 0])


def test_no_sequence_spans_a_writer_seam_and_starts_realign_after_it():
    st = _storage(L=6, P=3)
    _, keys = st.write(0, _segment(0, 0, 1 + 1))  # steps 0..3: nothing complete
    assert keys.size == 0
    st.reset_writer(0)  # steps 4.. start a new trajectory
    _, keys = st.write(0, _segment(0, 4, 2))
    assert keys.size == 0  # [0, 6) would cross the seam
    _, keys = st.write(0, _segment(0, 8, 2))
    assert sorted(_decode(k, st)[0] for k in keys) == [4, 4]  # first sequence [4, 10)


def test_writers_own_their_columns_and_sequences_leave_when_their_first_step_is_overwritten():
    columns = {0: 2, 1: 1}
    spec = segment_spec(_example(), T, 2)["fields"][0][1]
    st = SequenceStorage(spec, columns, StorageConfig(3 * 12), SequenceStorageConfig(length=6, period=3))
    assert st.ring.rows == 12
    table = Table(st, Uniform(), RateLimiter(RateLimiterConfig(min_size_to_sample=1)))
    for k in range(3):
        table.insert(0, _segment(0, 4 * k, 2))
        b1 = _segment(1, 4 * k, 1)
        table.insert(1, b1)
    assert table.size == 3 * 3  # starts 0, 3, 6 in 3 columns
    table.insert(0, _segment(0, 12, 2))  # overwrites steps 0..3 of writer 0: start 0 and 3 leave
    live = sorted(_decode(k, st) for k in np.flatnonzero(table.live))
    assert (0, 0) not in live and (3, 0) not in live and (9, 0) in live  # rows 0..3 reused; start 9 complete
    assert (0, 2) in live  # writer 1's column keeps its own
    dest = from_spec(st.batch_spec(8))
    table.sample_into(dest, 8)
    first = dest.observation[0, :, 0]
    assert np.all(np.diff(dest.observation[..., 0], axis=0) == 10)  # consecutive steps of one column
    assert set((first // 1000).astype(int)) <= {0, 1}


def test_config_rejects_a_capacity_below_one_sequence_and_a_non_recurrent_layout():
    with pytest.raises(ValueError, match="raise capacity"):
        _storage(L=30, capacity=2 * 20)
    ff = step_example(np.zeros(2, np.float32), np.int64(0), info_example("q"))
    with pytest.raises(ValueError, match="lstm_size"):
        SequenceStorage(segment_spec(ff, T, 2)["fields"][0][1], {0: 2}, StorageConfig(80), SequenceStorageConfig(length=6, period=3))


def test_prioritized_sequences_take_the_learners_priorities():
    st = _storage(L=6, P=3)
    table = Table(st, Prioritized(), RateLimiter(RateLimiterConfig(min_size_to_sample=1)))
    for k in range(4):
        table.insert(0, _segment(0, 4 * k, 2))
    keys = np.flatnonzero(table.live)
    gens = table.generation[keys]
    pr = np.zeros(len(keys))
    pr[0] = 100.0
    assert table.update_priorities(keys, gens, pr) == len(keys)
    dest = from_spec(st.batch_spec(16))
    info = table.sample_into(dest, 16)
    assert (info["keys"] == keys[0]).mean() > 0.9
