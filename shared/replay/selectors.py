"""Selectors: which of a table's items a sample returns (Reverb's "sampler" part).

A selector knows item *keys* (ints in [0, num_slots)) and nothing about their data. The
table tells it which keys became samplable (``insert``) and which stopped being so
(``remove``); ``sample`` returns keys and their importance weights. Three variants:

- ``Fifo``: a queue; each item is returned once, oldest first, then forgotten.
- ``Uniform``: uniform with replacement over the items present.
- ``Prioritized``: proportional prioritized replay (Schaul et al. 2016) on a SumTree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shared.replay.arena import HEAP, Arena, Cells



class Selector(Protocol):
    removes_on_sample: bool
    """True when ``sample`` forgets the keys it returns (a queue)."""
    prioritized: bool
    """True when items carry priorities: the learner sends new ones for the keys it was given."""

    def allocate(self, num_slots: int, arena: Arena = HEAP) -> None:
        """Size the selector for keys in [0, num_slots); the table calls it once. What must
        survive a restart is asked for from ``arena``; the rest ``restore`` rebuilds."""

    def restore(self, live: np.ndarray) -> None:
        """After a restart: exactly the keys where ``live`` [num_slots] bool is True are present."""

    def insert(self, keys: np.ndarray) -> None:
        """Make ``keys`` [k] (unique, not present) samplable."""

    def remove(self, keys: np.ndarray) -> None:
        """Stop sampling ``keys`` [k] (unique, present)."""

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``n`` keys [n] int64 and their importance weights [n] float32 (requires len >= 1)."""

    def update(self, keys: np.ndarray, priorities: np.ndarray) -> None:
        """New priorities [k] for present ``keys`` [k]; selectors without priorities ignore them."""

    def metrics(self) -> dict[str, float]:
        """Selector-specific gauges for the table's metrics."""

    def __len__(self) -> int:
        """Number of samplable items."""


class Fifo:
    """Queue: ``sample(n)`` returns the n oldest items in insertion order and removes them.

    Removal of an arbitrary key (eviction, policy-lag drop) is lazy: the key's entry stays
    in the insertion log and is skipped when it reaches the head, recognised by its
    sequence number no longer matching. The log is compacted when it fills, so the cost of
    every operation is amortised O(k) in the number of keys it touches.
    """

    removes_on_sample = True
    prioritized = False

    def allocate(self, num_slots: int, arena: Arena = HEAP) -> None:
        self._seq_of = arena.array("fifo.seq", num_slots, np.int64, fill=-1)  # -1: not present
        self._log_keys = np.empty(2 * num_slots, dtype=np.int64)
        self._log_seq = np.empty(2 * num_slots, dtype=np.int64)
        self._head = 0
        self._tail = 0
        self._next_seq = 0
        self._size = 0

    def insert(self, keys: np.ndarray) -> None:
        k = len(keys)
        if self._tail + k > len(self._log_keys):
            self._compact()
        seq = np.arange(self._next_seq, self._next_seq + k, dtype=np.int64)
        self._log_keys[self._tail : self._tail + k] = keys
        self._log_seq[self._tail : self._tail + k] = seq
        self._seq_of[keys] = seq
        self._tail += k
        self._next_seq += k
        self._size += k

    def remove(self, keys: np.ndarray) -> None:
        self._seq_of[keys] = -1
        self._size -= len(keys)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        if n > self._size:
            raise ValueError(f"Fifo: {n} items requested, {self._size} queued")
        parts, need = [np.zeros(0, dtype=np.int64)], n
        while need:
            end = min(self._tail, self._head + max(2 * need, 64))
            keys = self._log_keys[self._head : end]
            valid = np.flatnonzero(self._seq_of[keys] == self._log_seq[self._head : end])[:need]
            parts.append(keys[valid])
            need -= len(valid)
            self._head = self._head + int(valid[-1]) + 1 if need == 0 else end
        out = np.concatenate(parts)
        self._seq_of[out] = -1
        self._size -= n
        return out, np.ones(n, dtype=np.float32)

    def update(self, keys: np.ndarray, priorities: np.ndarray) -> None:
        return None

    def restore(self, live: np.ndarray) -> None:
        """The log again, in insertion order; a live key without a sequence number (taken by a
        sample that never completed) goes first, as the oldest."""
        keys = np.flatnonzero(live)
        keys = keys[np.argsort(self._seq_of[keys], kind="stable")]  # -1 (no number) sorts first
        self._seq_of[:] = -1
        self._head = self._tail = self._size = 0
        self._next_seq = 0
        self.insert(keys)

    def metrics(self) -> dict[str, float]:
        return {}

    def __len__(self) -> int:
        return self._size

    def _compact(self) -> None:
        keys = self._log_keys[self._head : self._tail]
        seq = self._log_seq[self._head : self._tail]
        live = self._seq_of[keys] == seq
        k = int(live.sum())
        self._log_keys[:k] = keys[live]
        self._log_seq[:k] = seq[live]
        self._head, self._tail = 0, k


class Uniform:
    """Uniform sampling with replacement over the items present; all weights 1.

    Present keys are kept dense in ``_dense[:size]`` with their positions in ``_pos``, so
    a sample is one ``integers`` draw and removal fills holes from the tail (O(k)).
    """

    removes_on_sample = False
    prioritized = False

    def allocate(self, num_slots: int, arena: Arena = HEAP) -> None:
        self._dense = np.empty(num_slots, dtype=np.int64)
        self._pos = np.full(num_slots, -1, dtype=np.int64)
        self._size = 0

    def restore(self, live: np.ndarray) -> None:
        self._pos[:] = -1
        self._size = 0
        self.insert(np.flatnonzero(live))

    def insert(self, keys: np.ndarray) -> None:
        k = len(keys)
        self._dense[self._size : self._size + k] = keys
        self._pos[keys] = np.arange(self._size, self._size + k)
        self._size += k

    def remove(self, keys: np.ndarray) -> None:
        new_size = self._size - len(keys)
        pos = self._pos[keys]
        self._pos[keys] = -1
        holes = pos[pos < new_size]
        tail = self._dense[new_size : self._size]
        movers = tail[self._pos[tail] >= 0]  # same count as holes
        self._dense[holes] = movers
        self._pos[movers] = holes
        self._size = new_size

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        if self._size == 0:
            raise ValueError("Uniform: cannot sample from an empty table")
        return self._dense[rng.integers(0, self._size, size=n)], np.ones(n, dtype=np.float32)

    def update(self, keys: np.ndarray, priorities: np.ndarray) -> None:
        return None

    def metrics(self) -> dict[str, float]:
        return {}

    def __len__(self) -> int:
        return self._size


WEIGHT_NORMS = ("batch_max", "table_min")
"""Prioritized importance-weight normalisers (``PrioritizedConfig.weight_norm``)."""


@dataclass(frozen=True)
class PrioritizedConfig:
    alpha: float = 0.6
    """Priority exponent: P(i) = p_i^alpha / sum_j p_j^alpha (0 = uniform)."""
    beta0: float = 0.4
    """Importance-sampling exponent at the first sample call."""
    beta_final: float = 1.0
    """Importance-sampling exponent reached after beta_steps sample calls (linear anneal)."""
    beta_steps: int = 100_000
    """Number of sample calls (learner batches) over which beta goes from beta0 to beta_final."""
    eps: float = 1e-6
    """Added to every priority so that no item's probability is exactly 0."""
    weight_norm: str = "batch_max"
    """What importance weights are divided by: batch_max (the batch's largest weight, as rlpyt,
    Acme's R2D2 and Dopamine do) or table_min (the largest weight any item could have, from the
    table's smallest priority, as the paper writes it; one low-priority item anywhere then
    shrinks every weight)."""


class Prioritized:
    """Proportional prioritized sampling (Schaul et al. 2016, "Prioritized Experience Replay").

    P(i) = (p_i + eps)^alpha / sum_j (p_j + eps)^alpha over the N items present. New items
    get the largest priority set so far (1.0 before any update), so each is likely to be
    seen at least once. A batch of n is drawn stratified: one prefix sum uniform in each of
    n equal slices of the total, which keeps the marginal frequencies at P and lowers
    their variance.

    Importance weights: w_i = (N * P(i))^-beta / max_j w_j, every weight in (0, 1]. With
    ``weight_norm = "batch_max"`` (the default, as in rlpyt, Acme's R2D2 and Dopamine) j runs
    over the batch, so w_i = (P(i) / P_min,batch)^-beta and the batch's rarest item gets 1;
    with ``"table_min"`` it runs over the whole table (the paper's formula), max_j w_j = (N *
    P_min)^-beta with P_min from the tree's smallest priority. The table-wide form lets one
    unrelated low-priority item (e.g. a sequence with nothing to train on) shrink every
    weight, and with it the effective learning rate. beta anneals linearly from beta0 to
    beta_final over beta_steps sample calls.
    """

    removes_on_sample = False
    prioritized = True

    def __init__(self, config: PrioritizedConfig = PrioritizedConfig()):
        if config.alpha < 0 or config.eps <= 0 or config.beta_steps < 1:
            raise ValueError(
                f"PrioritizedConfig: need alpha >= 0, eps > 0, beta_steps >= 1; got {config}"
            )
        if config.weight_norm not in WEIGHT_NORMS:
            raise ValueError(f"PrioritizedConfig.weight_norm = {config.weight_norm!r}: allowed: {', '.join(WEIGHT_NORMS)}")
        self.config = config

    def allocate(self, num_slots: int, arena: Arena = HEAP) -> None:
        # Imported here: loading the sum-tree's compiled code (numba) is a large part of a replay
        # process's start-up, which runs with a queue or a uniform table should not pay
        # (docs/benchmarks.md, "Prioritized sampling with the compiled sum-tree").
        from shared.replay.sumtree import SumTree

        self._tree = SumTree(num_slots, None if arena is HEAP else arena)
        self._size = 0
        # max_priority: the raw priority new items get; sample_calls: for beta's anneal.
        self.state = Cells(arena, "prioritized", np.float64, max_priority=1.0, sample_calls=0)

    def restore(self, live: np.ndarray) -> None:
        """Priorities stay as they were; an item made live by an insert that never completed
        gets the priority of new items."""
        self._tree.rebuild(live)
        fresh = np.flatnonzero(live & (self._tree.values(np.arange(len(live))) == 0))
        self._tree.set(fresh, (self.state.max_priority + self.config.eps) ** self.config.alpha)
        self._size = int(live.sum())

    @property
    def beta(self) -> float:
        """The importance-sampling exponent the next ``sample`` call uses."""
        c = self.config
        frac = min(1.0, self.state.sample_calls / c.beta_steps)
        return c.beta0 + frac * (c.beta_final - c.beta0)

    def insert(self, keys: np.ndarray) -> None:
        self._tree.set(keys, (self.state.max_priority + self.config.eps) ** self.config.alpha)
        self._size += len(keys)

    def remove(self, keys: np.ndarray) -> None:
        self._tree.set(keys, 0.0)
        self._size -= len(keys)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        if self._size == 0:
            raise ValueError("Prioritized: cannot sample from an empty table")
        total = self._tree.total
        keys = self._tree.find((np.arange(n) + rng.random(n)) * (total / n))
        values = self._tree.values(keys)
        lowest = values.min() if self.config.weight_norm == "batch_max" else self._tree.min
        ratio = values / lowest  # P(i) / P_min
        weights = ratio ** (-self.beta)
        self.state.sample_calls += 1
        return keys, weights.astype(np.float32)

    def update(self, keys: np.ndarray, priorities: np.ndarray) -> None:
        """``priorities`` [k] >= 0 (e.g. |TD error|) in raw units, before eps and alpha."""
        p = np.asarray(priorities, dtype=np.float64)
        if p.size == 0:
            return
        lo, hi = float(p.min()), float(p.max())
        if not (lo >= 0 and hi < np.inf):  # also False for NaN
            raise ValueError("Prioritized.update: priorities must be finite and >= 0")
        self.state.max_priority = max(self.state.max_priority, hi)
        self._tree.set(keys, (p + self.config.eps) ** self.config.alpha)

    def metrics(self) -> dict[str, float]:
        """priority_max: raw priority new items get; priority_alpha_mean: mean (p+eps)^alpha; beta."""
        mean = self._tree.total / self._size if self._size else 0.0
        return {"priority_max": self.state.max_priority, "priority_alpha_mean": mean, "beta": self.beta}

    def __len__(self) -> int:
        return self._size
