"""Selectors: sampling frequencies, importance weights, priority updates, queue order."""

import numpy as np
import pytest

from shared.replay.selectors import Fifo, Prioritized, PrioritizedConfig, Uniform


def _chi2_threshold(dof: int, z: float = 3.09) -> float:
    """Upper 0.999 quantile of chi-square(dof) (Wilson-Hilferty approximation)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * np.sqrt(a)) ** 3


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def _counts(selector, num_slots: int, batches: int, n: int, rng) -> np.ndarray:
    keys = np.concatenate([selector.sample(n, rng)[0] for _ in range(batches)])
    return np.bincount(keys, minlength=num_slots)


def test_prioritized_frequencies_match_p_alpha():
    rng = np.random.default_rng(0)
    cfg = PrioritizedConfig(alpha=0.6, eps=1e-6)
    sel = Prioritized(cfg)
    sel.allocate(64)
    keys = np.arange(40)
    sel.insert(keys)
    pri = rng.uniform(0.05, 5.0, size=40)
    sel.update(keys, pri)
    counts = _counts(sel, 64, batches=300, n=128, rng=rng)
    assert counts[40:].sum() == 0  # absent keys are never drawn
    p = (pri + cfg.eps) ** cfg.alpha
    stat = _chi2(counts[:40], p / p.sum())
    assert stat < _chi2_threshold(39)
    # the test has power: the same counts reject the distribution without the exponent
    assert _chi2(counts[:40], pri / pri.sum()) > 10 * _chi2_threshold(39)


@pytest.mark.parametrize("weight_norm", ["batch_max", "table_min"])
def test_prioritized_is_weights_match_formula_and_beta_anneals(weight_norm):
    rng = np.random.default_rng(1)
    cfg = PrioritizedConfig(alpha=0.7, beta0=0.4, beta_final=1.0, beta_steps=10, eps=0.01, weight_norm=weight_norm)
    sel = Prioritized(cfg)
    sel.allocate(16)
    keys = np.arange(10)
    sel.insert(keys)
    pri = np.linspace(0.1, 3.0, 10)
    sel.update(keys, pri)
    p = (pri + cfg.eps) ** cfg.alpha
    P = p / p.sum()
    N = 10
    for call in range(12):
        beta = 0.4 + 0.6 * min(1.0, call / 10)
        assert sel.beta == pytest.approx(beta)
        got_keys, w = sel.sample(32, rng)
        lowest = P[got_keys].min() if weight_norm == "batch_max" else P.min()
        expected = (N * P[got_keys]) ** -beta / (N * lowest) ** -beta
        np.testing.assert_allclose(w, expected, rtol=1e-6)
        if weight_norm == "batch_max":
            assert w.max() == pytest.approx(1.0)  # the batch's rarest item
    assert sel.beta == pytest.approx(1.0)
    assert w.max() <= 1.0


def test_equal_priority_weights_do_not_depend_on_an_unrelated_low_priority_item():
    """Issue 26: with the table-min normaliser one item of priority ~0 anywhere in the table
    (an R2D1 sequence with nothing to train on) shrank every weight; batch-max weights of
    items of equal priority are 1 whatever else the table holds."""
    cfg = PrioritizedConfig(alpha=0.6, beta0=1.0, beta_final=1.0, eps=1e-6)
    weights = {}
    for with_low in (False, True):
        sel = Prioritized(cfg)
        sel.allocate(101)
        sel.insert(np.arange(101 if with_low else 100))
        sel.update(np.arange(100), np.ones(100))
        if with_low:
            sel.update(np.array([100]), np.array([0.0]))
        keys, w = sel.sample(32, np.random.default_rng(5))
        assert (keys < 100).all()  # the low one (P ~ 1e-10) is not drawn
        weights[with_low] = w
    np.testing.assert_array_equal(weights[True], weights[False])
    np.testing.assert_array_equal(weights[True], np.ones(32, np.float32))
    # the table-min form, kept as an option, is the one the low item moves
    sel = Prioritized(PrioritizedConfig(alpha=0.6, beta0=1.0, beta_final=1.0, eps=1e-6, weight_norm="table_min"))
    sel.allocate(101)
    sel.insert(np.arange(101))
    sel.update(np.arange(101), np.r_[np.ones(100), 0.0])
    w = sel.sample(32, np.random.default_rng(5))[1]
    np.testing.assert_allclose(w, (1e-6 / (1 + 1e-6)) ** 0.6, rtol=1e-5)


def test_prioritized_rejects_an_unknown_weight_norm():
    with pytest.raises(ValueError, match="weight_norm"):
        Prioritized(PrioritizedConfig(weight_norm="max"))


def test_prioritized_updates_take_effect_and_new_items_get_max():
    rng = np.random.default_rng(2)
    sel = Prioritized(PrioritizedConfig(alpha=1.0, eps=1e-6))
    sel.allocate(8)
    sel.insert(np.arange(4))
    counts = _counts(sel, 8, 200, 64, rng)
    assert abs(counts[0] / counts.sum() - 0.25) < 0.02  # all start at the same priority
    sel.update(np.array([0, 1, 2, 3]), np.array([9.0, 1.0, 0.0, 0.0]))
    counts = _counts(sel, 8, 200, 64, rng)
    assert abs(counts[0] / counts.sum() - 0.9) < 0.01
    assert counts[2] + counts[3] == 0  # ~eps priority: ~1e-7 chance
    sel.insert(np.array([5]))  # gets the max priority so far (9): now 9/19 of the mass
    counts = _counts(sel, 8, 200, 64, rng)
    assert abs(counts[5] / counts.sum() - 9 / 19) < 0.015
    sel.remove(np.array([0, 5]))
    counts = _counts(sel, 8, 50, 64, rng)
    assert counts[0] == counts[5] == 0 and len(sel) == 3


def test_uniform_tracks_membership_and_is_uniform():
    rng = np.random.default_rng(3)
    sel = Uniform()
    sel.allocate(100)
    present = set()
    for _ in range(200):
        absent = np.array(sorted(set(range(100)) - present))
        add = rng.choice(absent, size=min(len(absent), rng.integers(0, 8)), replace=False)
        sel.insert(add)
        present |= set(add.tolist())
        cur = np.array(sorted(present))
        drop = rng.choice(cur, size=min(len(cur), rng.integers(0, 8)), replace=False)
        sel.remove(drop)
        present -= set(drop.tolist())
        assert len(sel) == len(present)
        assert set(sel._dense[: len(sel)].tolist()) == present
    keys = np.array(sorted(present))
    counts = _counts(sel, 100, 400, 128, rng)
    assert set(np.flatnonzero(counts).tolist()) == present
    stat = _chi2(counts[keys], np.full(len(keys), 1 / len(keys)))
    assert stat < _chi2_threshold(len(keys) - 1)
    w = sel.sample(5, rng)[1]
    np.testing.assert_array_equal(w, np.ones(5, np.float32))


def test_fifo_returns_each_item_once_in_insertion_order():
    rng = np.random.default_rng(4)
    sel = Fifo()
    sel.allocate(10)
    order = []  # reference queue
    for _ in range(300):  # many cycles: the log compacts repeatedly
        free = sorted(set(range(10)) - set(order))
        add = np.array(free[: rng.integers(0, len(free) + 1)], dtype=np.int64)
        rng.shuffle(add)
        sel.insert(add)
        order += add.tolist()
        if order and rng.random() < 0.3:  # an eviction from the middle
            gone = order.pop(int(rng.integers(len(order))))
            sel.remove(np.array([gone]))
        n = int(rng.integers(0, len(order) + 1))
        got, w = sel.sample(n, rng)
        assert got.tolist() == order[:n]
        assert w.shape == (n,)
        order = order[n:]
        assert len(sel) == len(order)
    with pytest.raises(ValueError):
        sel.sample(len(order) + 1, rng)
