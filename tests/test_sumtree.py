"""SumTree: consistent with a brute-force array under random inserts, overwrites and updates."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.replay.sumtree import SumTree


def _check_against(tree: SumTree, ref: np.ndarray, rng: np.random.Generator) -> None:
    assert tree.total == ref.sum()  # integer values: sums are exact
    positive = ref[ref > 0]
    assert tree.min == (positive.min() if positive.size else np.inf)
    np.testing.assert_array_equal(tree.values(np.arange(len(ref))), ref)
    if ref.sum() > 0:
        cum = np.cumsum(ref)
        # every integer boundary, the half-way points, and random points in [0, total)
        u = np.concatenate([np.arange(cum[-1]), np.arange(cum[-1]) + 0.5, rng.random(64) * cum[-1]])
        np.testing.assert_array_equal(tree.find(u), np.searchsorted(cum, u, side="right"))


ops = st.lists(
    st.tuples(
        st.lists(st.integers(0, 36), min_size=1, max_size=12),  # indices (repeats allowed)
        st.lists(st.integers(0, 9), min_size=12, max_size=12),  # values (0 = absent)
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 37), ops=ops, seed=st.integers(0, 2**31 - 1))
def test_matches_brute_force(capacity, ops, seed):
    rng = np.random.default_rng(seed)
    tree, ref = SumTree(capacity), np.zeros(capacity)
    for idx, vals in ops:
        idx = np.array(idx) % capacity
        vals = np.array(vals[: len(idx)], dtype=np.float64)
        tree.set(idx, vals)
        for i, v in zip(idx, vals):  # sequential semantics: the last write wins
            ref[i] = v
        _check_against(tree, ref, rng)


def test_find_at_total_lands_on_positive_item():
    tree = SumTree(8)
    tree.set(np.arange(8), [0.1, 0.2, 0.3, 0, 0, 0, 0, 0])
    found = tree.find([tree.total, np.nextafter(tree.total, 0)])
    assert set(found) == {2}


def test_large_tree_matches_brute_force():
    """2^20 + 3 items (21 levels, one more than a 1M replay table), batches of 256 with repeats."""
    rng = np.random.default_rng(0)
    capacity = (1 << 20) + 3
    tree, ref = SumTree(capacity), np.zeros(capacity)
    ref[:] = rng.integers(0, 10, capacity)
    tree.set(np.arange(capacity), ref)
    for _ in range(20):
        idx = rng.integers(capacity - 300, capacity, 256)  # the last, lone subtree; repeats
        vals = rng.integers(0, 10, 256).astype(np.float64)
        tree.set(idx, vals)
        for i, v in zip(idx, vals):
            ref[i] = v
    assert tree.total == ref.sum()
    assert tree.min == ref[ref > 0].min()
    np.testing.assert_array_equal(tree.values(np.arange(capacity)), ref)
    cum = np.cumsum(ref)
    u = np.concatenate([rng.random(4096) * cum[-1], [cum[-1]], cum[-300:]])
    expected = np.minimum(np.searchsorted(cum, u, side="right"), np.flatnonzero(ref)[-1])
    np.testing.assert_array_equal(tree.find(u), expected)


def test_rejects_bad_input_and_keeps_values():
    tree = SumTree(4)
    tree.set([0, 1], [1.0, 2.0])
    with pytest.raises(IndexError):
        tree.set([1, 4], [5.0, 1.0])
    with pytest.raises(IndexError):
        tree.set([-1], [1.0])
    with pytest.raises(ValueError):
        tree.set([1, 0], [5.0, -1.0])
    with pytest.raises(ValueError):
        tree.set([1, 0], [5.0, np.nan])
    with pytest.raises(ValueError):
        tree.set([1, 0], [5.0, np.inf])
    np.testing.assert_array_equal(tree.values(np.arange(4)), [1.0, 2.0, 0.0, 0.0])
    assert tree.total == 3.0 and tree.min == 1.0


def test_capacity_one():
    tree = SumTree(1)
    assert tree.total == 0.0 and tree.min == np.inf
    tree.set([0, 0], [3.0, 2.0])
    assert tree.total == 2.0 and tree.min == 2.0
    np.testing.assert_array_equal(tree.find([0.0, 1.9, 2.0]), [0, 0, 0])
