"""SumTree: a binary tree of float64 sums and minima over item values, walked by compiled loops.

The tree answers three questions in O(log capacity) per query, for a batch of queries at
once: the total of all values, which item a prefix sum falls into (to draw item i with
probability value_i / total) and the smallest positive value (for importance weights).
Parents are recomputed from their children on every update rather than adjusted by
deltas, so rounding never accumulates and the tree is an exact function of its leaves.

The walks are numba loops over the batch, one tree level at a time: a batch of 256
updates or queries on a 1M-item tree (20 levels) is ~10k node visits, which compiled code
does in less time than numpy spends on the fixed cost of its one call per level and array
(~300 calls; docs/benchmarks.md, "Prioritized sampling with the compiled sum-tree"). Level
by level rather than item by item because the deep levels miss the cache: the 256 loads of
one level are independent, so the CPU overlaps their misses, where one item's walk to the
root is a chain of dependent loads. The loops are compiled on import with explicit
signatures and cached on disk (``cache=True``), so no sample pays for compilation.
"""

from __future__ import annotations

import numba
import numpy as np

_F64 = numba.float64[::1]
_I64_IN = numba.types.Array(numba.int64, 1, "C", readonly=True)
_F64_IN = numba.types.Array(numba.float64, 1, "C", readonly=True)
_OK, _BAD_INDEX, _BAD_VALUE = 0, 1, 2


@numba.njit(numba.int64(_F64, _F64, numba.int64, numba.int64, _I64_IN, _F64_IN), cache=True, nogil=True)
def _set(sum_, min_, leaves, capacity, idx, val):
    for i in range(idx.size):  # check all before writing any, so bad input changes nothing
        if idx[i] < 0 or idx[i] >= capacity:
            return _BAD_INDEX
        if not (val[i] >= 0 and val[i] < np.inf):  # also rejects NaN
            return _BAD_VALUE
    nodes = np.empty(idx.size, dtype=np.int64)
    for i in range(idx.size):  # in order, so the last write to a repeated leaf wins
        node = leaves + idx[i]
        sum_[node] = val[i]
        min_[node] = val[i] if val[i] > 0 else np.inf
        nodes[i] = node >> 1
    while leaves > 1:  # one pass per level above the leaves; children are final
        prev = -1
        for i in range(idx.size):
            node = nodes[i]
            if node != prev:  # a repeat would write the same value again
                left = 2 * node
                sum_[node] = sum_[left] + sum_[left + 1]
                min_[node] = min(min_[left], min_[left + 1])
                prev = node
            nodes[i] = node >> 1
        leaves >>= 1
    return _OK


@numba.njit(numba.void(_F64, numba.int64, _F64, numba.int64[::1]), cache=True, nogil=True)
def _find(sum_, leaves, u, out):
    # u is the caller's scratch copy: it becomes each query's remainder inside its subtree.
    # Branch-free: a mispredicted branch (half of them) would discard the loads the CPU has
    # started for the next queries (docs/benchmarks.md, "Prioritized sampling with the compiled sum-tree").
    out[:] = 1
    level = leaves
    while level > 1:
        for i in range(u.size):
            left = 2 * out[i]
            s = sum_[left]
            go_right = np.int64(u[i] >= s) & np.int64(sum_[left + 1] > 0)
            u[i] -= s * go_right  # s * 0 = 0 exactly: s is finite
            out[i] = left + go_right
        level >>= 1
    out -= leaves


class SumTree:
    """Sums and minima over ``capacity`` non-negative float64 values.

    A value of 0 means "absent": it is never found by ``find`` and does not count for
    ``min``. All values start at 0.
    """

    def __init__(self, capacity: int, arena=None):
        """``arena``: where the nodes live (shared/replay/arena.py; None: the heap)."""
        if capacity < 1:
            raise ValueError(f"SumTree capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self._leaves = 1 << max(0, (self.capacity - 1).bit_length())
        # Node i has children 2i and 2i+1; node 1 is the root; leaves are [L, 2L).
        if arena is None:
            self._sum = np.zeros(2 * self._leaves, dtype=np.float64)
            self._min = np.full(2 * self._leaves, np.inf, dtype=np.float64)
        else:
            self._sum = arena.array("sumtree.sum", 2 * self._leaves, np.float64)
            self._min = arena.array("sumtree.min", 2 * self._leaves, np.float64, fill=np.inf)

    @property
    def total(self) -> float:
        """Sum of all values."""
        return float(self._sum[1])

    @property
    def min(self) -> float:
        """Smallest positive value (inf when every value is 0)."""
        return float(self._min[1])

    def values(self, indices: np.ndarray) -> np.ndarray:
        """Values at ``indices`` [n] -> [n] float64."""
        return self._sum[self._leaves + np.asarray(indices, dtype=np.int64)]

    def set(self, indices: np.ndarray, values: np.ndarray) -> None:
        """Set item ``indices`` [n] to ``values`` [n] (>= 0, finite); the last one wins on repeats."""
        idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        val = np.ascontiguousarray(values, dtype=np.float64)
        if val.shape != idx.shape:  # one value for all (np.broadcast_to is not free: only then)
            val = np.broadcast_to(val, idx.shape).copy()
        err = _set(self._sum, self._min, self._leaves, self.capacity, idx, val)
        if err == _BAD_INDEX:
            raise IndexError(f"SumTree index out of range [0, {self.capacity})")
        if err == _BAD_VALUE:
            raise ValueError("SumTree values must be finite and >= 0")

    def rebuild(self, keep: np.ndarray) -> None:
        """Zero the values where ``keep`` [capacity] bool is False and recompute every parent
        from the leaves (after a restart, when a torn update may have left parents stale)."""
        L = self._leaves
        leaves = self._sum[L : L + self.capacity]
        leaves[~keep] = 0.0
        self._min[L : 2 * L] = np.where(self._sum[L : 2 * L] > 0, self._sum[L : 2 * L], np.inf)
        while L > 1:
            self._sum[L // 2 : L] = self._sum[L : 2 * L : 2] + self._sum[L + 1 : 2 * L : 2]
            self._min[L // 2 : L] = np.minimum(self._min[L : 2 * L : 2], self._min[L + 1 : 2 * L : 2])
            L //= 2

    def find(self, prefix_sums: np.ndarray) -> np.ndarray:
        """Item index for each prefix sum [n] in [0, total): the i with cumsum[i-1] <= u < cumsum[i].

        Descends only into subtrees with a positive sum, so a query at the rounding edge
        (u == total) still lands on an item with a positive value.
        """
        u = np.array(prefix_sums, dtype=np.float64).reshape(-1)  # a copy: _find overwrites it
        out = np.empty(u.size, dtype=np.int64)
        _find(self._sum, self._leaves, u, out)
        return out
