"""Replay tables: ``Table(storage, selector, rate_limiter)`` and the storages items live in.

A *storage* holds the data and decides what an item is: ``TransitionStorage`` (one n-step
transition per step and env column) or ``SegmentStorage`` (one whole segment, the on-policy
queue). A *selector* (selectors.py) decides which items a sample returns; a *rate
limiter* (rate_limiter.py) decides when inserts and samples may happen. The table joins
them and keeps per-item bookkeeping: which keys are live and a generation counter per key,
so that priority updates for items overwritten since they were sampled are ignored.

Writers are sampler instances, each owning ``columns_per_writer[w]`` env columns. A
segment from writer w is the ``Samples`` structure with leading dims [T, B_w].
"""

from __future__ import annotations

import numpy as np

from shared.runtime import faults
from shared.replay.arena import HEAP, OP_DROP, OP_INSERT, OP_NAMES, OP_PRIORITIES, OP_SAMPLE, Arena, Cells
from shared.replay.rate_limiter import RateLimiter
from shared.replay.selectors import Selector
from shared.replay.storage import NO_KEYS, Storage


class Table:
    """A replay table composed of a storage, a selector and a rate limiter.

    The caller (the replay service) asks ``can_insert`` / ``can_sample`` and waits while they
    are False; ``insert`` and ``sample_into`` raise if called anyway, before changing
    anything. Key bookkeeping: ``live[key]`` is True while the selector may return the
    key; ``generation[key]`` counts how many items have lived under the key, so a priority
    update carrying the generation seen at sample time is applied only to that same item.
    """

    def __init__(self, storage: Storage, selector: Selector, rate_limiter: RateLimiter, seed: int = 0,
                 arena: Arena = HEAP):
        """``arena``: where the table's state lives, the same one its storage and rate limiter
        were given (shared/replay/arena.py). A restored arena (a replay restarted after a kill)
        is checked and repaired here (``recover``)."""
        self.storage = storage
        self.selector = selector
        self.rate_limiter = rate_limiter
        self.arena = arena
        selector.allocate(storage.num_slots, arena)
        self.live = arena.array("live", storage.num_slots, bool)
        self.generation = arena.array("generation", storage.num_slots, np.int64)
        # Per writer id: the incarnation that said hello and the serial of its last inserted segment.
        self.writers = arena.array("writers", (max(storage.writer_ids) + 1, 2), np.int64)
        self.rng = np.random.default_rng([seed, arena.restarts] if arena.restarts else seed)
        self.counts = Cells(arena, "table", evicted=0, dropped_stale=0, priority_updates=0,
                            priority_updates_ignored=0, torn_items=0)
        self.recovered = self.recover() if arena.restored else None
        arena.ready()

    @property
    def size(self) -> int:
        """Items that can be sampled now."""
        return len(self.selector)

    def can_insert(self, writer_id: int) -> bool:
        return self.storage.can_write(writer_id) and self.rate_limiter.can_insert(
            self.storage.items_per_write(writer_id)
        )

    def attach_writer(self, writer_id: int, incarnation: int) -> int:
        """Writer ``writer_id`` said hello. Returns the serial of the last segment inserted from
        this ``incarnation`` (the table outlived its replay process, the writer did not), or 0
        for a new incarnation, whose first segment then starts a new trajectory.
        ValueError for a writer the table was not built for."""
        if writer_id not in self.storage.writer_ids:
            raise ValueError(f"unknown writer_id {writer_id}; writers are {self.storage.writer_ids}")
        if self.writers[writer_id, 0] == incarnation:
            return self.last_serial(writer_id)
        self.storage.reset_writer(writer_id)
        self.writers[writer_id] = incarnation, 0
        return 0

    def last_serial(self, writer_id: int) -> int:
        """The serial of the last segment inserted from ``writer_id``'s attached incarnation."""
        return int(self.writers[writer_id, 1])

    def insert(self, writer_id: int, samples, bootstrap_value=None, bootstrap_observation=None,
               serial: int | None = None) -> np.ndarray:
        """Copy one segment (Samples [T, B_w]; bootstrap_value [B_w] f32 and bootstrap_observation
        [B_w, ...], needed by SegmentStorage) into the table; return the keys of the items that
        became samplable. The segment's memory may be released as soon as this returns.
        ``serial``: the writer's number for the segment, recorded with it (``attach_writer``)."""
        if not self.can_insert(writer_id):
            raise RuntimeError(f"Table.insert from writer {writer_id} while can_insert is False")
        self.arena.begin(OP_INSERT, writer_id, self.storage.cursor(writer_id))
        try:
            overwritten, added = self.storage.write(writer_id, samples, bootstrap_value, bootstrap_observation)
            faults.point("replay.insert")
            evicted = overwritten[self.live[overwritten]]
            self._forget(evicted)
            self.counts.evicted += len(evicted)
            self.generation[added] += 1
            self.live[added] = True
            self.selector.insert(added)
            self.rate_limiter.on_insert(len(added))
            if serial is not None:
                self.writers[writer_id, 1] = serial
        finally:
            self.arena.end()
        return added

    def reset_writer(self, writer_id: int) -> None:
        """The writer restarted: never join its next segment to what it sent before."""
        self.storage.reset_writer(writer_id)

    def can_sample(self, n: int) -> bool:
        enough = len(self.selector) >= (n if self.selector.removes_on_sample else 1)
        return enough and self.rate_limiter.can_sample(n)

    def sample_into(self, dest, n: int) -> dict[str, np.ndarray]:
        """Write ``n`` items into ``dest`` (from_spec(storage.batch_spec(n))) and return
        {"keys": [n] int64, "generations": [n] int64, "is_weights": [n] f32,
        "policy_versions": [n] int64}; pass keys and generations back to
        ``update_priorities``."""
        self.storage.check_dest(dest, n)
        if not self.can_sample(n):
            raise RuntimeError(f"Table.sample_into({n}) while can_sample is False")
        self.arena.begin(OP_SAMPLE)
        try:
            keys, weights = self.selector.sample(n, self.rng)
            info = {
                "keys": keys,
                "generations": self.generation[keys],
                "is_weights": weights,
                "policy_versions": self.storage.policy_version(keys),
            }
            self.storage.gather(keys, weights, dest)
            if self.selector.removes_on_sample:
                self.live[keys] = False
                self.storage.release(keys)
                self.rate_limiter.on_delete(n)
            self.rate_limiter.on_sample(n)
        finally:
            self.arena.end()
        return info

    def update_priorities(self, keys: np.ndarray, generations: np.ndarray, priorities: np.ndarray) -> int:
        """Set priorities [k] of sampled items; entries whose item has left the table or
        been replaced since it was sampled are ignored. Returns the number applied."""
        keys = np.asarray(keys, dtype=np.int64)
        generations = np.asarray(generations, dtype=np.int64)
        priorities = np.asarray(priorities, dtype=np.float64)
        if not keys.shape == generations.shape == priorities.shape or keys.ndim != 1:
            raise ValueError(
                f"update_priorities: keys {keys.shape}, generations {generations.shape} and "
                f"priorities {priorities.shape} must be equal 1-d shapes"
            )
        if keys.size and (keys.min() < 0 or keys.max() >= self.storage.num_slots):
            raise ValueError(f"update_priorities: keys must be in [0, {self.storage.num_slots})")
        ok = self.live[keys] & (self.generation[keys] == generations)
        self.arena.begin(OP_PRIORITIES)
        try:
            self.selector.update(keys[ok], priorities[ok])
        finally:
            self.arena.end()
        applied = int(ok.sum())
        self.counts.priority_updates += applied
        self.counts.priority_updates_ignored += len(keys) - applied
        return applied

    def drop_older_than(self, min_version: int) -> np.ndarray:
        """Remove items whose policy version is < ``min_version`` (the on-policy lag bound);
        returns their keys. Scans all slots: meant for the small on-policy queue."""
        keys = np.flatnonzero(self.live)
        stale = keys[self.storage.policy_version(keys) < min_version]
        if stale.size:
            self.arena.begin(OP_DROP)
            try:
                self._forget(stale)
            finally:
                self.arena.end()
        self.counts.dropped_stale += len(stale)
        return stale

    def recover(self) -> dict[str, object]:
        """After a restart on a restored arena: repair what an operation cut by the kill left
        (a torn insert drops the items it touched; a torn sample, priority update or drop
        leaves the items as they are), drop items whose data is not intact, and rebuild the
        selector and the rate limiter's size from the items present.
        Returns {"op": the torn operation or "none", "dropped": items dropped, "size": items kept,
        "inserts", "samples": the rate limiter's counters, and the selector's metrics}."""
        op, writer, cursor = self.arena.torn()
        drop = self.storage.torn_write(writer, cursor) if op == OP_INSERT else NO_KEYS
        dropped = int(self.live[drop].sum())
        self.live[drop] = False
        bad = self.storage.restore(self.live)
        dropped += int(self.live[bad].sum())
        self.live[bad] = False
        self.selector.restore(self.live)
        self.rate_limiter.restore(int(self.live.sum()))
        self.counts.torn_items += dropped
        return {"op": OP_NAMES[op], "dropped": dropped, "size": self.size, "inserts": self.rate_limiter.inserts,
                "samples": self.rate_limiter.samples, **self.selector.metrics()}

    def metrics(self) -> dict[str, float]:
        out = {
            "size": float(self.size),
            "evicted": float(self.counts.evicted),
            "dropped_stale": float(self.counts.dropped_stale),
            "priority_updates": float(self.counts.priority_updates),
            "priority_updates_ignored": float(self.counts.priority_updates_ignored),
            "torn_items": float(self.counts.torn_items),
            "restarts": float(self.arena.restarts),
        }
        out.update(self.rate_limiter.metrics())
        out.update(self.selector.metrics())
        out.update(getattr(self.storage, "metrics", dict)())
        return out

    def _forget(self, keys: np.ndarray) -> None:
        self.selector.remove(keys)
        self.live[keys] = False
        self.storage.release(keys)
        self.rate_limiter.on_delete(len(keys))
