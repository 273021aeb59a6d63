"""n-step targets against hand-computed references: termination, truncation, ring wrap, seams."""

import numpy as np
import pytest

from shared.data.namedarraytuple import from_spec, namedarraytuple, spec_of
from shared.replay.nstep import nstep_targets
from shared.replay.rate_limiter import RateLimiter
from shared.replay.selectors import Fifo
from shared.replay.storage import StorageConfig
from shared.replay.tables import Table
from shared.replay.transitions import TransitionStorage, TransitionStorageConfig

Samples = namedarraytuple(
    "Samples",
    "observation action reward terminated truncated final_observation agent_info policy_version failed",
)


def test_window_reference_n3():
    # gamma 0.5, n 3. Column 0: termination at step 2. Column 1: truncation at step 1,
    # termination at step 5.
    reward = np.array([[1, 10], [2, 20], [3, 30], [4, 40], [5, 50], [6, 60], [7, 70]], dtype=np.float32)
    term = np.zeros((7, 2), bool)
    trunc = np.zeros((7, 2), bool)
    term[2, 0] = trunc[1, 1] = term[5, 1] = True
    tg = nstep_targets(reward, term, trunc, n_step=3, gamma=0.5)
    # (return, discount, bootstrap offset, from final, complete) per position, by hand
    col0 = [
        (1 + 0.5 * 2 + 0.25 * 3, 0.0, 2, True, True),  # ends on the termination at 2
        (2 + 0.5 * 3, 0.0, 1, True, True),
        (3, 0.0, 0, True, True),
        (4 + 0.5 * 5 + 0.25 * 6, 0.125, 3, False, True),  # observation[6] is in the window
        None, None, None,  # observation[7..9] not seen yet
    ]
    col1 = [
        (10 + 0.5 * 20, 0.25, 1, True, True),  # truncation at 1: bootstrap from final obs
        (20, 0.5, 0, True, True),
        (30 + 0.5 * 40 + 0.25 * 50, 0.125, 3, False, True),
        (40 + 0.5 * 50 + 0.25 * 60, 0.0, 2, True, True),
        (50 + 0.5 * 60, 0.0, 1, True, True),
        (60, 0.0, 0, True, True),
        None,
    ]
    for b, col in enumerate([col0, col1]):
        for j, want in enumerate(col):
            if want is None:
                assert not tg.complete[j, b], (j, b)
                continue
            ret, disc, off, final, complete = want
            got = (tg.return_[j, b], tg.discount[j, b], tg.bootstrap_offset[j, b],
                   tg.from_final[j, b], tg.complete[j, b])
            assert got == (pytest.approx(ret), pytest.approx(disc), off, final, complete), (j, b)


def test_termination_wins_over_truncation_and_n1():
    reward = np.array([[1.0], [2.0], [3.0]], dtype=np.float32)
    term = np.array([[False], [True], [False]])
    trunc = np.array([[False], [True], [False]])
    tg = nstep_targets(reward, term, trunc, n_step=1, gamma=0.9)
    np.testing.assert_allclose(tg.return_[:, 0], [1, 2, 3])
    np.testing.assert_allclose(tg.discount[:2, 0], [0.9, 0.0])
    assert tg.complete[:, 0].tolist() == [True, True, False]
    assert tg.from_final[:2, 0].tolist() == [False, True]
    assert tg.bootstrap_offset[:2, 0].tolist() == [1, 0]


# ---------------------------------------------------------------- through the table


def _segment(steps, term=(), trunc=(), failed=()):
    """B = 1 segment of absolute ``steps``: observation = step, reward = step + 1,
    final_observation = 100 + step, policy_version = step; ``failed`` steps as a sampler records
    them (truncated, reward 0, final_observation = observation)."""
    s = np.asarray(steps)
    T = len(s)
    col = lambda a, dt: np.asarray(a, dtype=dt).reshape(T, 1)
    fail = np.isin(s, failed)
    return Samples(
        observation=col(s, np.float32)[..., None],
        action=col(s, np.int64),
        reward=col(np.where(fail, 0, s + 1), np.float32),
        terminated=col(np.isin(s, term), bool),
        truncated=col(np.isin(s, trunc) | fail, bool),
        final_observation=col(np.where(fail, s, 100 + s), np.float32)[..., None],
        agent_info=None,
        policy_version=col(s, np.int64),
        failed=col(fail, bool),
    )


def _drain(table):
    items = []
    while table.can_sample(1):
        dest = from_spec(table.storage.batch_spec(1))
        table.sample_into(dest, 1)
        items.append((int(dest.observation[0, 0]), float(dest.return_[0]),
                      float(dest.bootstrap_discount[0]), float(dest.bootstrap_observation[0, 0])))
    return items


def test_ring_wraparound_and_seam_reference():
    # rows = capacity / columns = 5 steps; T = 2, n = 2, gamma = 0.5; termination at
    # step 3, truncation at step 7; the writer restarts after step 9.
    storage = TransitionStorage(
        spec_of(_segment([0, 1])), {0: 1}, StorageConfig(capacity=5), TransitionStorageConfig(n_step=2, gamma=0.5)
    )
    table = Table(storage, Fifo(), RateLimiter())
    ev = dict(term=[3], trunc=[7])
    for t0 in (0, 2, 4):
        table.insert(0, _segment([t0, t0 + 1], **ev))
    # item 0 was evicted by step 5; item 4 waits for observation 6
    assert _drain(table) == [
        (1, 2 + 0.5 * 3, 0.25, 3.0),
        (2, 3 + 0.5 * 4, 0.0, 103.0),  # termination at 3: final observation, discount 0
        (3, 4.0, 0.0, 103.0),
    ]
    table.insert(0, _segment([6, 7], **ev))
    assert _drain(table) == [
        (4, 5 + 0.5 * 6, 0.25, 6.0),  # rows 4, 0, 1: the window wraps around the ring
        (5, 6 + 0.5 * 7, 0.25, 7.0),
        (6, 7 + 0.5 * 8, 0.25, 107.0),  # truncation at 7: bootstrap from its final observation
        (7, 8.0, 0.5, 107.0),
    ]
    table.insert(0, _segment([8, 9], **ev))
    assert _drain(table) == []  # 8 and 9 wait for observations 10 and 11
    table.reset_writer(0)
    table.insert(0, _segment([10, 11]))  # a new trajectory: 8 and 9 never complete
    table.insert(0, _segment([12, 13]))
    assert _drain(table) == [(10, 11 + 0.5 * 12, 0.25, 12.0), (11, 12 + 0.5 * 13, 0.25, 13.0)]
    assert table.counts.evicted == 1  # item 0; the other overwritten items had been sampled
    assert table.rate_limiter.size == table.size == 0


def test_a_window_that_reaches_a_failed_step_ends_before_it():
    # gamma 0.5, n 3; step 3 failed (marked truncated too, as the sampler records it).
    reward = np.array([[1.0], [2.0], [3.0], [0.0], [5.0], [6.0], [7.0]])
    failed = np.zeros((7, 1), bool)
    failed[3] = True
    tg = nstep_targets(reward, np.zeros((7, 1), bool), failed.copy(), 3, 0.5, failed)
    assert tg.valid[:, 0].tolist() == [True, True, True, False, True, True, True]
    np.testing.assert_allclose(tg.return_[:3, 0], [1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3])
    np.testing.assert_allclose(tg.discount[:3, 0], [0.125, 0.25, 0.5])
    assert tg.bootstrap_offset[:3, 0].tolist() == [3, 2, 1]  # observation[3]: the failed step's own
    assert not tg.from_final[:3, 0].any() and tg.complete[:3, 0].all()


def test_a_failed_step_is_in_no_sampled_transition():
    """The table serves no item at a failed step, and the items before it bootstrap from the
    observation it was taken in, one step sooner than a truncation would."""
    storage = TransitionStorage(
        spec_of(_segment([0, 1])), {0: 1}, StorageConfig(capacity=50), TransitionStorageConfig(n_step=2, gamma=0.5)
    )
    table = Table(storage, Fifo(), RateLimiter())
    for t0 in (0, 2, 4, 6):
        table.insert(0, _segment([t0, t0 + 1], failed=[3]))
    items = _drain(table)
    assert [i[0] for i in items] == [0, 1, 2, 4, 5]  # step 3 failed; 6 and 7 wait for 8 and 9
    assert items[1] == (1, 2 + 0.5 * 3, 0.25, 3.0)
    assert items[2] == (2, 3.0, 0.5, 3.0)  # bootstraps V(observation 3): no reward of the failed step
