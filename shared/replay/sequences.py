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

from shared.data.namedarraytuple import drop_leading_dims, map_leaves, spec_field, with_leading_dims
from shared.data.batches import SequenceBatch
from shared.replay.arena import HEAP, Arena, Cells
from shared.replay.ring import RingStorage
from shared.replay.storage import F32, NO_KEYS, StorageConfig, check_dest, take_into


@dataclass(frozen=True)
class SequenceStorageConfig:
    """What a sequence is (its size is the ``StorageConfig``'s)."""
    length: int = 80
    """Sequence table: L, steps per sequence including the learner's burn-in."""
    period: int = 40
    """Sequence table: a new sequence starts every this many steps of an env (< length: overlap)."""


def _memory_spec(step_spec):
    info = spec_field(step_spec, "agent_info")
    try:
        return spec_field(info, "memory")
    except ValueError:
        raise ValueError("the sequence table stores recurrent agents' steps: agent_info has no memory "
                         "(set model.lstm_size > 0)") from None


def sequence_batch_spec(step_spec, length: int, n: int) -> Any:
    """Spec of a SequenceBatch of ``n`` sequences of ``length`` steps laid out as ``step_spec`` (Samples)."""
    memory = _memory_spec(step_spec)
    seq = lambda f, src=step_spec: with_leading_dims(spec_field(src, f), [length, n])  # noqa: E731
    by_field = {
        "observation": seq("observation"),
        "action": seq("action"),
        "reward": seq("reward"),
        "terminated": seq("terminated"),
        "truncated": seq("truncated"),
        "failed": seq("failed"),
        "prev_action": seq("prev_action", memory),
        "prev_reward": seq("prev_reward", memory),
        "start_state": with_leading_dims(spec_field(memory, "state"), [n]),
        "is_weight": {"dtype": F32, "shape": [n]},
        "policy_version": with_leading_dims(spec_field(step_spec, "policy_version"), [n]),
    }
    return {"type": "SequenceBatch", "fields": [[f, by_field[f]] for f in SequenceBatch._fields]}


class SequenceStorage(RingStorage):
    """Items are sequences of ``config.length`` steps, keyed by their first step's ring key."""

    def __init__(self, segment_spec, columns_per_writer: dict[int, int],
                 storage: StorageConfig = StorageConfig(), config: SequenceStorageConfig = SequenceStorageConfig(),
                 arena: Arena = HEAP):
        """segment_spec: spec of a Samples segment [T, B] of a recurrent agent (agent_info.memory).
        arena: where the ring lives (shared/replay/arena.py)."""
        if config.length < 2 or not 1 <= config.period <= config.length:
            raise ValueError(f"SequenceStorageConfig: need length >= 2 and 1 <= period <= length, got "
                             f"length={config.length}, period={config.period}")
        _memory_spec(drop_leading_dims(segment_spec, 2))
        # Final observations are never read (windows closed by a truncation are masked), so
        # the frame store keeps only the one write's worth the ring requires.
        super().__init__(segment_spec, columns_per_writer, storage, config.length, "SequenceStorageConfig.length", arena)
        self.config = config
        self._offsets = np.arange(config.length, dtype=np.int64)[:, None] * self.ring.B_total  # [L, 1]
        # frame_store: sequences never made live because a stack did not rebuild
        self.counts = Cells(arena, "sequences", unrebuilt=0)

    def metrics(self) -> dict[str, float]:
        return {"frames_unrebuilt_items": float(self.counts.unrebuilt)}

    def make_batch_spec(self, n: int) -> Any:
        return sequence_batch_spec(self.step_spec, self.config.length, n)

    def items_per_write(self, writer_id: int) -> int:
        """Sequences one segment completes per column, rounded up (a bound for the rate limiter)."""
        return -(-self.T // self.config.period) * self.ring.width(writer_id)

    def write(self, writer_id: int, samples, bootstrap_value=None, bootstrap_observation=None):
        """Append a segment [T, B_w]; return (keys of sequences whose first step it overwrote,
        keys of sequences it completed)."""
        ring, L, P = self.ring, self.config.length, self.config.period
        T = self.check_write(writer_id, samples)
        s0, start = ring.written[writer_id], ring.traj_start[writer_id]
        overwritten, _ = ring.write(writer_id, samples)
        # Sequences [s, s + L) completed by this write: s + L - 1 in [s0, s0 + T), s >= start, s = start mod P.
        lo = max(start, s0 - L + 1)
        first = start + -(-(lo - start) // P) * P
        starts = np.arange(first, s0 + T - L + 1, P, dtype=np.int64)
        if starts.size == 0:
            return overwritten, NO_KEYS
        keys = ring.keys(writer_id, starts).reshape(-1)  # time-major: [S, B_w]
        if ring.frames is not None:
            steps = (keys[None, :] + self._offsets) % self.num_slots  # [L, S * B_w]
            ok = ring.observation_ok(steps.reshape(-1)).reshape(steps.shape).all(0)
            self.counts.unrebuilt += int(ok.size - ok.sum())
            keys = keys[ok]
        return overwritten, keys

    def restore(self, live: np.ndarray) -> np.ndarray:
        """Nothing to check: sequences never read final observations."""
        return NO_KEYS

    def check_dest(self, dest, n: int) -> None:
        check_dest(dest, self.batch_spec(n), "destination SequenceBatch", contiguous=True)

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
            take_into(flat_view(getattr(dest, name)), src, steps)
        take_into(dest.start_state, memory.state, keys)
        dest.is_weight[:] = is_weights
        np.take(flat.policy_version, keys, axis=0, out=dest.policy_version)
