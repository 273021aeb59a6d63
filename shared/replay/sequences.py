"""Sequence storage for R2D1: items are runs of L consecutive steps of one env column.

Steps live in a ``ColumnRing`` (so the Atari frame store works unchanged); an item is
keyed by the ring key of its first step. In each column a new sequence starts every
``period`` steps of a trajectory (``period < length`` gives overlapping sequences, R2D2's
80 / 40), counted from the writer's last seam, and becomes live once its L steps are
written. A sequence never spans a seam (``reset_writer``): the LSTM state stored at its
start would belong to another trajectory, and after a seam the envs may be mid-episode
with a ``first`` flag that the samples do not record. Sequences do cross episode ends:
the learner zeroes the state after a done step (``memory.sequence_reset``).

An item leaves when the ring overwrites its first step (its oldest), so every step of a
live item is readable. A sample gathers a ``SequenceBatch`` [L, n]: the per-step data, the
stored LSTM state of step 0 only (the learner recomputes the others, so later stored
states need not travel), the importance weight and the first step's policy version.
n-step targets are computed by the learner from the sequence's rewards and dones
(shared/algos/r2d1.py), so the storage keeps no per-item targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.data.namedarraytuple import leaves, map_leaves, spec_of, with_leading_dims
from shared.data.batches import SequenceBatch
from shared.replay.arena import HEAP, Arena, Cells
from shared.replay.ring import ColumnRing
from shared.replay.storage import _check_like, _check_segment, _field, _segment_dims, _take_into


@dataclass(frozen=True)
class SequenceStorageConfig:
    capacity: int = 100_000
    """Steps held in total (each env column keeps capacity // columns); sequences held ~ capacity / period."""
    length: int = 80
    """L: steps per sequence, burn-in included."""
    period: int = 40
    """A new sequence starts every this many steps of a column (period < length: overlap)."""
    frame_store: bool = False
    """Keep each frame of [K, H, W] uint8 frame-stack observations once (Atari; see frames.py)."""

    def __post_init__(self) -> None:
        if self.length < 2 or not 1 <= self.period <= self.length:
            raise ValueError(f"SequenceStorageConfig: need length >= 2 and 1 <= period <= length, got "
                             f"length={self.length}, period={self.period}")


def _memory_spec(step_spec):
    info = _field(step_spec, "agent_info")
    try:
        return _field(info, "memory")
    except ValueError:
        raise ValueError("the sequence table stores recurrent agents' steps: agent_info has no memory "
                         "(set model.lstm_size > 0)") from None


def sequence_batch_spec(step_spec, length: int, n: int) -> Any:
    """Spec of a SequenceBatch of ``n`` sequences of ``length`` steps laid out as ``step_spec`` (Samples)."""
    memory = _memory_spec(step_spec)
    seq = lambda f, src=step_spec: with_leading_dims(_field(src, f), [length, n])  # noqa: E731
    by_field = {
        "observation": seq("observation"),
        "action": seq("action"),
        "reward": seq("reward"),
        "terminated": seq("terminated"),
        "truncated": seq("truncated"),
        "failed": seq("failed"),
        "prev_action": seq("prev_action", memory),
        "prev_reward": seq("prev_reward", memory),
        "start_state": with_leading_dims(_field(memory, "state"), [n]),
        "is_weight": {"dtype": np.dtype(np.float32).str, "shape": [n]},
        "policy_version": with_leading_dims(_field(step_spec, "policy_version"), [n]),
    }
    return {"type": "SequenceBatch", "fields": [[f, by_field[f]] for f in SequenceBatch._fields]}


class SequenceStorage:
    """Items are sequences of ``config.length`` steps, keyed by their first step's ring key."""

    def __init__(self, segment_spec, columns_per_writer: dict[int, int],
                 config: SequenceStorageConfig = SequenceStorageConfig(), arena: Arena = HEAP):
        """segment_spec: spec of a Samples segment [T, B] of a recurrent agent (agent_info.memory).
        arena: where the ring lives (shared/replay/arena.py)."""
        self.T, step_spec = _segment_dims(segment_spec)
        _memory_spec(step_spec)
        B_total = sum(columns_per_writer.values())
        rows = config.capacity // max(B_total, 1)
        if rows < config.length + self.T:
            raise ValueError(f"SequenceStorageConfig.capacity={config.capacity} gives {rows} steps per column for "
                             f"{B_total} columns; need >= length + T = {config.length + self.T}: raise capacity")
        self.config, self.step_spec = config, step_spec
        # Final observations are never read (windows closed by a truncation are masked), so
        # the frame store keeps only the one write's worth it requires.
        self.ring = ColumnRing(step_spec, columns_per_writer, rows, arena, frame_stack=config.frame_store,
                               final_slots=self.T * max(columns_per_writer.values()))
        self.writer_ids = sorted(columns_per_writer)
        self.num_slots = self.ring.rows * self.ring.B_total
        self._offsets = np.arange(config.length, dtype=np.int64)[:, None] * self.ring.B_total  # [L, 1]
        self._batch_specs: dict[int, Any] = {}
        # frame_store: sequences never made live because a stack did not rebuild
        self.counts = Cells(arena, "sequences", unrebuilt=0)

    def metrics(self) -> dict[str, float]:
        return {"frames_unrebuilt_items": float(self.counts.unrebuilt)}

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes

    def batch_spec(self, n: int) -> Any:
        spec = self._batch_specs.get(n)
        if spec is None:
            spec = self._batch_specs[n] = sequence_batch_spec(self.step_spec, self.config.length, n)
        return spec

    def items_per_write(self, writer_id: int) -> int:
        """Sequences one segment completes per column, rounded up (a bound for the rate limiter)."""
        return -(-self.T // self.config.period) * self.ring.width(writer_id)

    def can_write(self, writer_id: int) -> bool:
        return True

    def write(self, writer_id: int, samples, bootstrap_value=None, bootstrap_observation=None):
        """Append a segment [T, B_w]; return (keys of sequences whose first step it overwrote,
        keys of sequences it completed)."""
        ring, L, P = self.ring, self.config.length, self.config.period
        T = _check_segment(samples, self.step_spec, ring.width(writer_id), f"segment of writer {writer_id}")
        if T + L > ring.live_rows:
            raise ValueError(f"segment of writer {writer_id}: T={T} > rows - length = {ring.live_rows - L}")
        s0, start = ring.written[writer_id], ring.traj_start[writer_id]
        overwritten, _ = ring.write(writer_id, samples)
        # Sequences [s, s + L) completed by this write: s + L - 1 in [s0, s0 + T), s >= start, s = start mod P.
        lo = max(start, s0 - L + 1)
        first = start + -(-(lo - start) // P) * P
        starts = np.arange(first, s0 + T - L + 1, P, dtype=np.int64)
        if starts.size == 0:
            return overwritten, np.zeros(0, dtype=np.int64)
        keys = ring.keys(writer_id, starts).reshape(-1)  # time-major: [S, B_w]
        if ring.frames is not None:
            steps = (keys[None, :] + self._offsets) % self.num_slots  # [L, S * B_w]
            ok = ring.observation_ok(steps.reshape(-1)).reshape(steps.shape).all(0)
            self.counts.unrebuilt += int(ok.size - ok.sum())
            keys = keys[ok]
        return overwritten, keys

    def reset_writer(self, writer_id: int) -> None:
        self.ring.reset_writer(writer_id)

    def cursor(self, writer_id: int) -> int:
        return self.ring.cursor(writer_id)

    def torn_write(self, writer_id: int, cursor: int) -> np.ndarray:
        return self.ring.torn_write(writer_id, cursor, self.T, self.config.length)

    def restore(self, live: np.ndarray) -> np.ndarray:
        """Nothing to check: sequences never read final observations."""
        return np.zeros(0, dtype=np.int64)

    def check_dest(self, dest, n: int) -> None:
        _check_like(spec_of(dest), self.batch_spec(n), "destination SequenceBatch")
        for path, leaf in leaves(dest):
            if not leaf.flags.c_contiguous:
                raise ValueError(f"destination SequenceBatch.{path} must be C-contiguous (use from_spec)")

    def gather(self, keys: np.ndarray, is_weights: np.ndarray, dest) -> None:
        ring, flat = self.ring, self.ring.flat
        n, L = len(keys), self.config.length
        steps = ((keys[None, :] + self._offsets) % self.num_slots).reshape(-1)  # [L * n], time-major

        def flat_view(tree):
            return map_leaves(lambda a: a.reshape(L * n, *a.shape[2:]), tree)

        ring.gather_observation(steps, flat_view(dest.observation))
        memory = flat.agent_info.memory
        for name, src in (("action", flat.action), ("reward", flat.reward), ("terminated", flat.terminated),
                          ("truncated", flat.truncated), ("failed", flat.failed), ("prev_action", memory.prev_action),
                          ("prev_reward", memory.prev_reward)):
            _take_into(flat_view(getattr(dest, name)), src, steps)
        _take_into(dest.start_state, memory.state, keys)
        dest.is_weight[:] = is_weights
        np.take(flat.policy_version, keys, axis=0, out=dest.policy_version)

    def release(self, keys: np.ndarray) -> None:
        """No-op: the ring overwrites steps in order."""

    def policy_version(self, keys: np.ndarray) -> np.ndarray:
        """The first step's version (the oldest of the sequence)."""
        return self.ring.flat.policy_version[keys].astype(np.int64)
