"""Segment storage: items are whole segments, the on-policy queue."""

from __future__ import annotations

from typing import Any

import numpy as np

from shared.data.namedarraytuple import leaves, spec_field, spec_nbytes
from shared.data.layout import segments_spec
from shared.replay.arena import HEAP, Arena
from shared.replay.storage import NO_KEYS, StorageConfig, check_dest, check_segment, segment_dims


class SegmentStorage:
    """Items are whole segments [T, B] plus bootstrap_value [B], in ``capacity`` slots.

    Stored as one OnPolicyBatch with dims [T, capacity * B]: slot k owns columns
    [k * B, (k + 1) * B), so n sampled slots are gathered into a destination [T, n * B]
    with one ``take`` per leaf. All writers must have the same B.
    """

    def __init__(
        self,
        segment_spec,
        columns_per_writer: dict[int, int],
        config: StorageConfig = StorageConfig(capacity=4),
        arena: Arena = HEAP,
    ):
        """segment_spec: spec of a Samples segment (leaves lead with [T, B]); arena: where
        the slots live (shared/replay/arena.py)."""
        self.T, self.step_spec = segment_dims(segment_spec)
        spec_field(self.step_spec, "policy_version")
        widths = set(columns_per_writer.values())
        if len(widths) != 1:
            raise ValueError(f"SegmentStorage needs the same B for every writer, got {columns_per_writer}")
        if config.capacity < 1:
            raise ValueError(f"StorageConfig.capacity must be >= 1, got {config.capacity}")
        self.B = widths.pop()
        self.writer_ids = sorted(columns_per_writer)
        self.num_slots = config.capacity
        self.storage_spec = self.batch_spec(config.capacity)
        self.data = arena.tree("queue", self.storage_spec)
        self.occupied = arena.array("occupied", self.num_slots, bool)
        self.version = arena.array("version", self.num_slots, np.int64, fill=-1)

    @property
    def nbytes(self) -> int:
        """Bytes of the slots."""
        return spec_nbytes(self.storage_spec)

    def batch_spec(self, n: int) -> Any:
        return segments_spec(self.step_spec, self.T, n * self.B)

    def items_per_write(self, writer_id: int) -> int:
        return 1

    def can_write(self, writer_id: int) -> bool:
        return not self.occupied.all()

    def write(self, writer_id: int, samples, bootstrap_value, bootstrap_observation) -> tuple[np.ndarray, np.ndarray]:
        if writer_id not in self.writer_ids:
            raise ValueError(f"unknown writer_id {writer_id}; writers are {self.writer_ids}")
        T = check_segment(samples, self.step_spec, self.B, f"segment of writer {writer_id}")
        if T != self.T:
            raise ValueError(f"segment of writer {writer_id}: T={T}, the queue stores T={self.T}")
        bv = np.asarray(bootstrap_value)
        if bv.shape != (self.B,):
            raise ValueError(f"bootstrap_value of writer {writer_id}: shape {bv.shape}, expected ({self.B},)")
        free = np.flatnonzero(~self.occupied)
        if free.size == 0:
            raise RuntimeError("SegmentStorage is full: check can_write before write")
        k = int(free[0])
        cols = slice(k * self.B, (k + 1) * self.B)
        self.data.samples[:, cols] = samples
        self.data.bootstrap_value[cols] = bv
        self.data.bootstrap_observation[cols] = bootstrap_observation
        self.occupied[k] = True
        self.version[k] = int(np.min(samples.policy_version))
        return NO_KEYS, np.array([k], dtype=np.int64)

    def reset_writer(self, writer_id: int) -> None:
        """No-op: a segment is self-contained (it carries its own bootstrap_value)."""

    def cursor(self, writer_id: int) -> int:
        return 0

    def torn_write(self, writer_id: int, cursor: int) -> np.ndarray:
        """Nothing of another item: a write fills one free slot, which ``restore`` frees."""
        return NO_KEYS

    def restore(self, live: np.ndarray) -> np.ndarray:
        """Free the slots of items that never became live (a torn write) or left by a torn sample."""
        self.occupied &= live
        return NO_KEYS

    def check_dest(self, dest, n: int) -> None:
        check_dest(dest, self.batch_spec(n), "destination OnPolicyBatch", contiguous=True)

    def gather(self, keys: np.ndarray, is_weights: np.ndarray, dest) -> None:
        """``is_weights`` is unused: a queue returns each segment once, weight 1."""
        n, T, K, B = len(keys), self.T, self.num_slots, self.B
        for (_, d), (_, s) in zip(leaves(dest.samples), leaves(self.data.samples)):
            rest = s.shape[2:]
            np.take(s.reshape(T, K, B, *rest), keys, axis=1, out=d.reshape(T, n, B, *rest))
        np.take(self.data.bootstrap_value.reshape(K, B), keys, axis=0, out=dest.bootstrap_value.reshape(n, B))
        for (_, d), (_, s) in zip(leaves(dest.bootstrap_observation), leaves(self.data.bootstrap_observation)):
            rest = s.shape[1:]
            np.take(s.reshape(K, B, *rest), keys, axis=0, out=d.reshape(n, B, *rest))

    def release(self, keys: np.ndarray) -> None:
        self.occupied[keys] = False

    def policy_version(self, keys: np.ndarray) -> np.ndarray:
        return self.version[keys]

