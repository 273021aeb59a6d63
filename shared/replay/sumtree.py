"""SumTree: a binary tree of float64 sums over item values, with min/max, vectorised.

The tree answers three questions in O(log capacity) per query, for a batch of queries at
once: the total of all values, which item a prefix sum falls into (to draw item i with
probability value_i / total) and the smallest positive / largest value (for importance
weights and new-item priorities). Parents are recomputed from their children on every
update rather than adjusted by deltas, so rounding never accumulates.
"""

from __future__ import annotations

import numpy as np


class SumTree:
    """Sums, minima and maxima over ``capacity`` non-negative float64 values.

    A value of 0 means "absent": it is never found by ``find`` and does not count for
    ``min``. All values start at 0.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"SumTree capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self._leaves = 1 << max(0, (self.capacity - 1).bit_length())
        self._depth = self._leaves.bit_length() - 1
        # Node i has children 2i and 2i+1; node 1 is the root; leaves are [L, 2L).
        self._sum = np.zeros(2 * self._leaves, dtype=np.float64)
        self._min = np.full(2 * self._leaves, np.inf, dtype=np.float64)
        self._max = np.zeros(2 * self._leaves, dtype=np.float64)

    @property
    def total(self) -> float:
        """Sum of all values."""
        return float(self._sum[1])

    @property
    def min(self) -> float:
        """Smallest positive value (inf when every value is 0)."""
        return float(self._min[1])

    @property
    def max(self) -> float:
        """Largest value (0 when every value is 0)."""
        return float(self._max[1])

    def values(self, indices: np.ndarray) -> np.ndarray:
        """Values at ``indices`` [n] -> [n] float64."""
        return self._sum[self._leaves + np.asarray(indices, dtype=np.int64)]

    def set(self, indices: np.ndarray, values: np.ndarray) -> None:
        """Set item ``indices`` [n] to ``values`` [n] (>= 0, finite); the last one wins on repeats."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        val = np.broadcast_to(np.asarray(values, dtype=np.float64), idx.shape)
        if idx.size == 0:
            return
        if idx.min() < 0 or idx.max() >= self.capacity:
            raise IndexError(f"SumTree index out of range [0, {self.capacity})")
        if not np.all(np.isfinite(val)) or val.min() < 0:
            raise ValueError("SumTree values must be finite and >= 0")
        # Fancy assignment with repeated indices has no defined winner; keep the last.
        uniq, last_rev = np.unique(idx[::-1], return_index=True)
        val = val[::-1][last_rev]
        node = uniq + self._leaves
        self._sum[node] = val
        self._min[node] = np.where(val > 0, val, np.inf)
        self._max[node] = val
        for _ in range(self._depth):
            node = np.unique(node >> 1)
            left, right = 2 * node, 2 * node + 1
            self._sum[node] = self._sum[left] + self._sum[right]
            self._min[node] = np.minimum(self._min[left], self._min[right])
            self._max[node] = np.maximum(self._max[left], self._max[right])

    def find(self, prefix_sums: np.ndarray) -> np.ndarray:
        """Item index for each prefix sum [n] in [0, total): the i with cumsum[i-1] <= u < cumsum[i].

        Descends only into subtrees with a positive sum, so a query at the rounding edge
        (u == total) still lands on an item with a positive value.
        """
        u = np.array(prefix_sums, dtype=np.float64).reshape(-1)
        node = np.ones(u.shape, dtype=np.int64)
        for _ in range(self._depth):
            left = self._sum[2 * node]
            go_right = (u >= left) & (self._sum[2 * node + 1] > 0)
            u = np.where(go_right, u - left, u)
            node = 2 * node + go_right
        return node - self._leaves
