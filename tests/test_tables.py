"""Tables: interleaved writers, priority updates, the on-policy queue, bad input, buffers."""

import numpy as np
import pytest

from shared.data.namedarraytuple import from_spec, leaves, namedarraytuple, spec_of
from shared.data.batches import OnPolicyBatch, Transition
from shared.replay.rate_limiter import RateLimiter
from shared.replay.selectors import Fifo, Prioritized, PrioritizedConfig, Uniform
from shared.replay.segments import SegmentStorage
from shared.replay.storage import StorageConfig
from shared.replay.tables import Table
from shared.replay.transitions import TransitionStorage, TransitionStorageConfig

Samples = namedarraytuple(
    "Samples",
    "observation action reward terminated truncated final_observation agent_info policy_version failed",
)
Obs = namedarraytuple("Obs", ["vec", "img"])
AgentInfo = namedarraytuple("AgentInfo", ["value"])


def _segment(w, steps, width, rng, p_term=0.08, p_trunc=0.05):
    """Segment of writer ``w`` for absolute ``steps`` [T]; every field encodes (w, column, step)."""
    T = len(steps)
    step = np.broadcast_to(np.asarray(steps)[:, None], (T, width))
    col = np.broadcast_to(np.arange(width)[None, :], (T, width))
    vec = np.stack([np.full((T, width), w), col, step], axis=-1).astype(np.float32)
    img = np.stack([step % 251, col], axis=-1).astype(np.uint8)
    final_vec = vec.copy()
    final_vec[..., 2] = -(step + 1)
    return Samples(
        observation=Obs(vec, img),
        action=(step * 100 + col).astype(np.int64),
        reward=rng.normal(size=(T, width)).astype(np.float32),
        terminated=rng.random((T, width)) < p_term,
        truncated=rng.random((T, width)) < p_trunc,
        final_observation=Obs(final_vec, 255 - img),
        agent_info=AgentInfo(rng.normal(size=(T, width)).astype(np.float32)),
        policy_version=(step // 7).astype(np.int64),
        failed=np.zeros((T, width), bool),
    )


class Reference:
    """What each writer sent, and the n-step transitions a table must hold, by brute force."""

    def __init__(self, widths, rows, n, gamma):
        self.widths, self.rows, self.n, self.gamma = widths, rows, n, gamma
        self.reward = {w: np.zeros((0, b), np.float32) for w, b in widths.items()}
        self.term = {w: np.zeros((0, b), bool) for w, b in widths.items()}
        self.trunc = {w: np.zeros((0, b), bool) for w, b in widths.items()}
        self.seams = {w: [] for w in widths}  # first step of each new trajectory

    def add(self, w, seg):
        self.reward[w] = np.concatenate([self.reward[w], seg.reward])
        self.term[w] = np.concatenate([self.term[w], seg.terminated])
        self.trunc[w] = np.concatenate([self.trunc[w], seg.truncated])

    def reset(self, w):
        self.seams[w].append(len(self.reward[w]))

    def live(self):
        """{(w, c, t): (return, discount, bootstrap (w, c, step or -(step+1)))}."""
        out = {}
        for w, width in self.widths.items():
            written = len(self.reward[w])
            for t in range(max(0, written - self.rows), written):
                end = min([s for s in self.seams[w] if s > t] + [written])
                for c in range(width):
                    ret, m, target = 0.0, 0, None
                    for k in range(self.n):
                        if t + k >= end:
                            break
                        ret += self.gamma**k * float(self.reward[w][t + k, c])
                        m += 1
                        if self.term[w][t + k, c] or self.trunc[w][t + k, c]:
                            disc = 0.0 if self.term[w][t + k, c] else self.gamma**m
                            target = (ret, disc, (w, c, -(t + k + 1)))
                            break
                    else:
                        if t + self.n < end:
                            target = (ret, self.gamma**self.n, (w, c, t + self.n))
                    if target is not None:
                        out[(w, c, t)] = target
        return out


def _check_batch(dest, live):
    ids = [tuple(int(x) for x in v) for v in dest.observation.vec]
    for i, (w, c, t) in enumerate(ids):
        assert (w, c, t) in live, f"sampled item {(w, c, t)} should not be live"
        ret, disc, boot = live[(w, c, t)]
        assert dest.observation.img[i].tolist() == [t % 251, c]
        assert dest.action[i] == t * 100 + c
        assert dest.policy_version[i] == t // 7
        assert dest.return_[i] == pytest.approx(ret, rel=1e-5, abs=1e-5)
        assert dest.bootstrap_discount[i] == pytest.approx(disc, rel=1e-6)
        assert tuple(int(x) for x in dest.bootstrap_observation.vec[i]) == boot
        img = [boot[2] % 251, c] if boot[2] >= 0 else [255 - (-boot[2] - 1) % 251, 255 - c]
        assert dest.bootstrap_observation.img[i].tolist() == img
    return ids


def test_three_writers_interleaved_are_retrievable_and_correct():
    rng = np.random.default_rng(0)
    widths, lengths = {0: 2, 1: 3, 2: 2}, {0: 4, 1: 5, 2: 7}
    n, gamma, rows = 3, 0.9, 23
    spec = spec_of(_segment(0, np.arange(5), 2, rng))
    size, cfg = StorageConfig(capacity=rows * sum(widths.values())), TransitionStorageConfig(n_step=n, gamma=gamma)
    uniform = Table(TransitionStorage(spec, widths, size, cfg), Uniform(), RateLimiter())
    fifo = Table(TransitionStorage(spec, widths, size, cfg), Fifo(), RateLimiter())
    ref = Reference(widths, rows, n, gamma)
    written = {w: 0 for w in widths}
    dest = from_spec(uniform.storage.batch_spec(64))
    assert type(dest) is Transition
    sampled = set()
    for it in range(90):
        w = int(rng.integers(3))
        if it in (30, 60) and w == 1:
            for table in (uniform, fifo):
                table.reset_writer(1)
            ref.reset(1)
        seg = _segment(w, np.arange(written[w], written[w] + lengths[w]), widths[w], rng)
        written[w] += lengths[w]
        ref.add(w, seg)
        added = [table.insert(w, seg) for table in (uniform, fifo)]
        assert np.array_equal(added[0], added[1])
        live = ref.live()
        assert uniform.size == fifo.size == len(live)
        if uniform.can_sample(64):
            info = uniform.sample_into(dest, 64)
            sampled |= set(_check_batch(dest, live))
            assert info["policy_versions"].tolist() == dest.policy_version.tolist()
    assert len(sampled) > 500
    # the queue returns exactly the live set, each writer's items in step order
    dest_all = from_spec(fifo.storage.batch_spec(fifo.size))
    ids = _check_batch(dest_all, live) if fifo.sample_into(dest_all, fifo.size) else []
    assert set(ids) == set(live)
    for w in widths:
        for c in range(widths[w]):
            steps = [t for (v, col, t) in ids if (v, col) == (w, c)]
            assert steps == sorted(steps)
    assert fifo.size == 0 and uniform.counts.evicted > 0


def test_window_steps_are_the_steps_the_env_produced_up_to_a_done_and_sum_to_the_return():
    rng = np.random.default_rng(2)
    widths, n, gamma, rows = {0: 3, 1: 2}, 4, 0.9, 40
    spec = spec_of(_segment(0, np.arange(6), 3, rng))
    size = StorageConfig(capacity=rows * 5)
    table = Table(TransitionStorage(spec, widths, size, TransitionStorageConfig(n_step=n, gamma=gamma, store_steps=True)),
                  Uniform(), RateLimiter())
    ref = Reference(widths, rows, n, gamma)
    dest = from_spec(table.storage.batch_spec(64))
    assert dest.steps.reward.shape == (64, n) and dest.steps.observation.img.shape == (64, n, 2)
    # Off (the default), a batch is what it was: the same fields, steps None, not a byte more.
    off = dict(TransitionStorage(spec, widths, size, TransitionStorageConfig(n, gamma)).batch_spec(64)["fields"])
    assert off == {**dict(table.storage.batch_spec(64)["fields"]), "steps": None}
    ends = {"termination": 0, "truncation": 0, "window": 0}
    for t0 in range(0, 120, 6):
        for w, width in widths.items():
            seg = _segment(w, np.arange(t0, t0 + 6), width, rng, p_term=0.1, p_trunc=0.1)
            ref.add(w, seg)
            table.insert(w, seg)
        live = ref.live()
        table.sample_into(dest, 64)
        for i, (w, c, t) in enumerate(_check_batch(dest, live)):
            boot = live[(w, c, t)][2][2]
            m = -boot - t if boot < 0 else boot - t  # a done at t + m - 1 bootstraps from its final observation
            ends["window" if boot >= 0 else "termination" if ref.term[w][t + m - 1, c] else "truncation"] += 1
            s = dest.steps[i]
            assert s.observation.vec[:m].astype(int).tolist() == [[w, c, t + k] for k in range(m)]
            assert s.observation.img[:m].tolist() == [[(t + k) % 251, c] for k in range(m)]
            assert s.action[:m].tolist() == [(t + k) * 100 + c for k in range(m)]
            assert s.reward[:m].tolist() == ref.reward[w][t:t + m, c].tolist()  # the float32 bytes sent
            np.testing.assert_allclose(s.discount[:m], gamma ** np.arange(m), rtol=1e-6)
            assert not any(leaf[m:].any() for _, leaf in leaves(s))  # past the window: zeros
            assert dest.return_[i] == pytest.approx((s.discount * s.reward).sum(), rel=1e-5, abs=1e-5)
    assert min(ends.values()) > 50, ends


def test_priority_updates_ignore_items_overwritten_since_sampled():
    rng = np.random.default_rng(1)
    widths = {0: 2}
    spec = spec_of(_segment(0, np.arange(4), 2, rng))
    size = StorageConfig(capacity=2 * 12)
    storage = TransitionStorage(spec, widths, size, TransitionStorageConfig(n_step=1, gamma=0.9))
    sel = Prioritized(PrioritizedConfig(alpha=1.0, eps=1e-6))
    table = Table(storage, sel, RateLimiter())
    for t0 in range(0, 12, 4):
        table.insert(0, _segment(0, np.arange(t0, t0 + 4), 2, rng, p_term=0, p_trunc=0))
    dest = from_spec(storage.batch_spec(16))
    info = table.sample_into(dest, 16)
    steps = dest.observation.vec[:, 2].astype(int)
    # overwrite steps 0..3: their items are replaced by items of steps 12..15
    table.insert(0, _segment(0, np.arange(12, 16), 2, rng, p_term=0, p_trunc=0))
    applied = table.update_priorities(info["keys"], info["generations"], np.full(16, 50.0))
    kept = steps >= 4
    assert applied == kept.sum() and table.counts.priority_updates_ignored == (~kept).sum()
    values = sel._tree.values(info["keys"])
    np.testing.assert_allclose(values[kept], 50.0 + 1e-6)
    # new items under the reused keys have the max priority from before the update (1);
    # step 3's key stays empty: its new item, step 15, waits for observation 16
    np.testing.assert_allclose(values[~kept], np.where(steps[~kept] == 3, 0.0, 1.0 + 1e-6))
    # an item sampled, dropped from a queue and never replaced is ignored too
    q = Table(TransitionStorage(spec, widths, size, storage.config), Fifo(), RateLimiter())
    q.insert(0, _segment(0, np.arange(4), 2, rng))
    qi = q.sample_into(from_spec(q.storage.batch_spec(2)), 2)
    assert q.update_priorities(qi["keys"], qi["generations"], np.ones(2)) == 0


def test_on_policy_queue_order_backpressure_and_policy_lag():
    rng = np.random.default_rng(2)
    T, B = 4, 2
    spec = spec_of(_segment(0, np.arange(T), B, rng))
    storage = SegmentStorage(spec, {0: B, 1: B}, StorageConfig(capacity=3))
    table = Table(storage, Fifo(), RateLimiter())
    segs = [_segment(i % 2, np.arange(7 * i, 7 * i + T), B, rng) for i in range(5)]
    for i in range(3):
        table.insert(i % 2, segs[i], np.full(B, i, np.float32), segs[i].observation[-1])
    assert not table.can_insert(0)
    with pytest.raises(RuntimeError, match="can_insert"):
        table.insert(0, segs[3], np.zeros(B, np.float32), segs[3].observation[-1])
    dest = from_spec(storage.batch_spec(2))
    assert type(dest) is OnPolicyBatch
    info = table.sample_into(dest, 2)
    assert info["policy_versions"].tolist() == [0, 1]  # min version over each segment
    for i in range(2):
        cols = slice(i * B, (i + 1) * B)
        np.testing.assert_array_equal(dest.samples.observation.vec[:, cols], segs[i].observation.vec)
        np.testing.assert_array_equal(dest.samples.reward[:, cols], segs[i].reward)
        np.testing.assert_array_equal(dest.samples.agent_info.value[:, cols], segs[i].agent_info.value)
    np.testing.assert_array_equal(dest.bootstrap_value, [0, 0, 1, 1])
    for i in range(2):
        np.testing.assert_array_equal(dest.bootstrap_observation.vec[i * B:(i + 1) * B], segs[i].observation.vec[-1])
    assert table.can_insert(1)
    table.insert(1, segs[3], np.full(B, 3, np.float32), segs[3].observation[-1])  # reuses a freed slot
    table.insert(0, segs[4], np.full(B, 4, np.float32), segs[4].observation[-1])
    # the learner is at version 4 with max lag 1: segment 2 (version 2) is too old
    assert len(table.drop_older_than(3)) == 1 and table.counts.dropped_stale == 1
    info = table.sample_into(dest, 2)
    np.testing.assert_array_equal(dest.bootstrap_value, [3, 3, 4, 4])
    assert info["policy_versions"].tolist() == [3, 4]
    assert table.size == 0 and table.rate_limiter.size == 0


def test_bad_input_is_rejected_without_changing_the_table():
    rng = np.random.default_rng(3)
    spec = spec_of(_segment(0, np.arange(4), 2, rng))
    table = Table(
        TransitionStorage(spec, {0: 2, 1: 3}, StorageConfig(capacity=50), TransitionStorageConfig(n_step=2)),
        Fifo(),
        RateLimiter(),
    )
    table.insert(0, _segment(0, np.arange(4), 2, rng))
    before = (table.size, table.storage.ring.written.tolist())
    good = _segment(0, np.arange(4, 8), 2, rng)
    bad_shape = good._replace(observation=Obs(good.observation.vec[..., :2], good.observation.img))
    with pytest.raises(ValueError, match=r"observation\.vec.*shape \[2\].*shape \[3\]"):
        table.insert(0, bad_shape)
    with pytest.raises(ValueError, match=r"reward: dtype <f8"):
        table.insert(0, good._replace(reward=good.reward.astype(np.float64)))
    with pytest.raises(ValueError, match=r"leading dims \[4, 2\], expected \[T, B\] = \[4, 3\]"):
        table.insert(1, good)
    with pytest.raises(ValueError, match="unknown writer_id 7"):
        table.insert(7, good)
    with pytest.raises(ValueError, match="T=30"):
        table.insert(0, _segment(0, np.arange(30), 2, rng))
    assert (table.size, table.storage.ring.written.tolist()) == before
    # a wrong destination is refused before the queue gives anything away
    with pytest.raises(ValueError, match="destination Transition batch"):
        table.sample_into(from_spec(table.storage.batch_spec(3)), 2)
    assert table.size == before[0]
    with pytest.raises(ValueError, match="capacity=20"):
        TransitionStorage(spec, {0: 2, 1: 3}, StorageConfig(capacity=20), TransitionStorageConfig(n_step=2))
    with pytest.raises(ValueError, match="same B"):
        SegmentStorage(spec, {0: 2, 1: 3})
