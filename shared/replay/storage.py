"""What a replay table asks of its storage (``Storage``), and the checks every storage makes
of the segments written to it and the destinations gathered into."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from shared.data.namedarraytuple import check_spec, drop_leading_dims, leaves, spec_leading_len, spec_leaves, spec_of

F32 = np.dtype(np.float32).str
NO_KEYS = np.zeros(0, dtype=np.int64)
"""No item keys (int64)."""


@dataclass(frozen=True)
class StorageConfig:
    """What every storage is given, whatever its items."""
    capacity: int = 100_000
    """Items held: segments for the queue (one per sampler keeps policy lag at 1), else steps, of
    which each env column keeps capacity // (total columns) (transitions: one item a step; the
    sequence table holds about capacity / sequence_period sequences)."""
    frame_store: bool = False
    """Off-policy: store each frame of [K, H, W] uint8 frame-stack observations once and rebuild
    the stacks at sample time (Atari: ~8 KB a transition instead of ~56 KB; frames.py)."""


def segment_dims(segment_spec) -> tuple[int, Any]:
    """(T, spec of one step) of a segment spec whose leaves lead with [T, B]."""
    return spec_leading_len(segment_spec), drop_leading_dims(segment_spec, 2)


def take_into(dest_tree, src_tree, idx: np.ndarray) -> None:
    """dest leaf[i] = src leaf[idx[i]] for every leaf; src leaves are flat [slots, ...]."""
    for (_, d), (_, s) in zip(leaves(dest_tree), leaves(src_tree)):
        np.take(s, idx, axis=0, out=d)


def check_segment(samples, step_spec, width: int, what: str) -> int:
    """Validate a segment against the table's step spec and width; return its T."""
    got = spec_of(samples)
    T = None
    for path, leaf in spec_leaves(got):
        lead = leaf["shape"][:2]
        if T is None:
            T = lead[0] if lead else None
        if lead != [T, width]:
            raise ValueError(f"{what}.{path}: leading dims {lead}, expected [T, B] = [{T}, {width}]")
    check_spec(drop_leading_dims(got, 2), step_spec, what)
    return int(T)


def check_dest(dest, want_spec, what: str, contiguous: bool = False) -> None:
    """ValueError unless ``dest`` is laid out as ``want_spec`` (and, where the storage gathers
    into reshaped views of it, ``contiguous``)."""
    check_spec(spec_of(dest), want_spec, what)
    if contiguous:
        for path, leaf in leaves(dest):
            if not leaf.flags.c_contiguous:
                raise ValueError(f"{what}.{path} must be C-contiguous (use from_spec)")


# ---------------------------------------------------------------- storage protocol


class Storage(Protocol):
    num_slots: int
    """Item keys are in [0, num_slots)."""
    writer_ids: list[int]
    """The writers it stores segments of."""

    def batch_spec(self, n: int) -> Any:
        """Spec of a destination for ``n`` items (``from_spec`` it, in shm or on the heap)."""

    def items_per_write(self, writer_id: int) -> int:
        """Items one segment of ``writer_id`` adds (what the rate limiter is asked for)."""

    def can_write(self, writer_id: int) -> bool:
        """False when a segment of ``writer_id`` cannot be stored now (back-pressure)."""

    def write(self, writer_id: int, samples, bootstrap_value, bootstrap_observation) -> tuple[np.ndarray, np.ndarray]:
        """Store one segment (Samples [T, B_w]; its bootstrap value [B_w] and observation [B_w, ...]); return (keys whose data it overwrote, keys that became items)."""

    def reset_writer(self, writer_id: int) -> None:
        """The writer restarted: its next segment does not continue the previous one."""

    def check_dest(self, dest, n: int) -> None:
        """Raise ValueError unless ``dest`` is a valid destination for ``n`` items."""

    def gather(self, keys: np.ndarray, is_weights: np.ndarray, dest) -> None:
        """Write items ``keys`` [n] (with their weights [n]) into ``dest``."""

    def release(self, keys: np.ndarray) -> None:
        """Items ``keys`` left the table; their space may be reused."""

    def policy_version(self, keys: np.ndarray) -> np.ndarray:
        """Policy version [n] int64 of items ``keys`` (the oldest step's, for multi-step items)."""

    def cursor(self, writer_id: int) -> int:
        """Where the next write of ``writer_id`` goes (recorded before a write: see ``torn_write``)."""

    def torn_write(self, writer_id: int, cursor: int) -> np.ndarray:
        """A write of ``writer_id`` at ``cursor`` was cut by a kill: repair the writer's cursors
        and return the keys of the items it may have touched (the table drops them)."""

    def restore(self, live: np.ndarray) -> np.ndarray:
        """After a restart with ``live`` [num_slots] the items present: free what no item holds
        and return the keys of live items whose data is not intact (the table drops them)."""

