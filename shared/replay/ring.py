"""The column ring (trajectory steps per env column) and ``RingStorage``, the base of the
storages whose items are made of its steps (transitions.py, sequences.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from shared.data.namedarraytuple import leading_len, map_leaves, spec_field, spec_nbytes, with_leading_dims
from shared.replay.arena import HEAP, Arena
from shared.replay.frames import FrameStacks, frame_stack_shape
from shared.replay.storage import NO_KEYS, StorageConfig, check_segment, segment_dims, take_into


class ColumnRing:
    """Trajectory steps in a ring of ``rows`` steps per env column: leaves [rows, B_total, ...].

    Writer w owns the column block [offset_w, offset_w + B_w) and its own write cursor, so
    samplers that insert at different rates each overwrite only their own oldest steps.
    Step s of writer w lives in row s % rows; its key is row * B_total + column. Shared by
    the transition storage and the sequence storage for R2D1, which read observations
    only through ``gather_observation`` / ``gather_final_observation`` and ask
    ``observation_ok`` / ``final_observation_ok`` before making an item live.

    With ``frame_stack`` (Atari: observations are [K, H, W] uint8 rolling frame stacks) the
    observation and final_observation fields are not stored as such: an injected
    ``FrameStacks`` part (frames.py) keeps each step's newest frame once, final frames of
    done steps only, and rebuilds the stacks. The ring then holds ``live_rows + K - 1`` rows:
    a step counts as overwritten (``write`` returns its key) K - 1 steps before its row is
    reused, so the frames a live step's stack needs are always present.
    """

    def __init__(self, step_spec, columns_per_writer: dict[int, int], live_rows: int, arena: Arena = HEAP,
                 frame_stack: bool = False, final_slots: int = 0):
        """live_rows: steps per column an item may live in. frame_stack: deduplicate frame
        stacks (observation must be one [K, H, W] uint8 array). final_slots: frame_stack only,
        final frames kept (>= the done steps of one write). arena: where the steps and the
        writers' cursors live (shared/replay/arena.py)."""
        if not columns_per_writer or min(columns_per_writer.values()) < 1 or min(columns_per_writer) < 0:
            raise ValueError(f"columns_per_writer needs writer ids >= 0 with >= 1 column each, got {columns_per_writer}")
        self.offsets: dict[int, int] = {}
        self.widths = dict(columns_per_writer)
        for w in sorted(columns_per_writer):
            self.offsets[w] = sum(self.widths[v] for v in self.offsets)
        self.B_total = sum(self.widths.values())
        self.live_rows = int(live_rows)
        self.frames: FrameStacks | None = None
        stored = step_spec
        if frame_stack:
            K, H, W = frame_stack_shape(spec_field(step_spec, "observation"))
            stored = {"type": step_spec["type"], "fields": [
                [f, None if f in ("observation", "final_observation") else c] for f, c in step_spec["fields"]]}
        self.rows = self.live_rows + (K - 1 if frame_stack else 0)
        self.steps_spec = with_leading_dims(stored, [self.rows, self.B_total])
        self.data = arena.tree("ring", self.steps_spec)
        self.flat = map_leaves(lambda a: a.reshape(self.rows * self.B_total, *a.shape[2:]), self.data)
        if frame_stack:
            self.frames = FrameStacks(K, H, W, self.rows, self.B_total, final_slots, arena)
        cursors = arena.array("ring.cursors", (max(self.widths) + 1, 2), np.int64)
        self.written = cursors[:, 0]  # steps written by writer w since the table began
        self.traj_start = cursors[:, 1]  # first step of w's current trajectory

    @property
    def nbytes(self) -> int:
        """Bytes of the steps and frames."""
        return spec_nbytes(self.steps_spec) + (0 if self.frames is None else self.frames.nbytes)

    def width(self, writer_id: int) -> int:
        """B of ``writer_id``; ValueError for a writer the table was not built for."""
        if writer_id not in self.widths:
            raise ValueError(f"unknown writer_id {writer_id}; writers are {sorted(self.widths)}")
        return self.widths[writer_id]

    def keys(self, writer_id: int, steps: np.ndarray) -> np.ndarray:
        """Keys [len(steps), B_w] of absolute ``steps`` [S] of ``writer_id``."""
        off = self.offsets[writer_id]
        cols = np.arange(off, off + self.widths[writer_id])
        return (np.asarray(steps) % self.rows)[:, None] * self.B_total + cols[None, :]

    def read(self, writer_id: int, field: str, start: int, stop: int) -> np.ndarray:
        """Leaf ``field`` (a top-level array field) of steps [start, stop) -> [stop - start, B_w, ...]."""
        off = self.offsets[writer_id]
        rows = np.arange(start, stop) % self.rows
        return getattr(self.data, field)[rows, off : off + self.widths[writer_id]]

    def write(self, writer_id: int, samples) -> tuple[np.ndarray, np.ndarray]:
        """Append segment ``samples`` [T, B_w]; return (keys [T * B_w] of the steps it made
        unreadable, keys of earlier done steps whose final observation it dropped)."""
        T = leading_len(samples)
        s0 = self.written[writer_id]
        steps = np.arange(s0, s0 + T)
        off, Bw = self.offsets[writer_id], self.widths[writer_id]
        lost_final = NO_KEYS
        if self.frames is not None:
            done = samples.terminated | samples.truncated
            start = np.empty((T, Bw), dtype=bool)
            start[1:] = done[:-1]
            if s0 > self.traj_start[writer_id]:  # else a seam: the first step starts an episode
                prev = self.read(writer_id, "terminated", s0 - 1, s0)[0] | self.read(writer_id, "truncated", s0 - 1, s0)[0]
                start[0] = prev
                prev_back = self.frames.data.back[(s0 - 1) % self.rows, off : off + Bw]
            else:
                start[0] = True
                prev_back = np.zeros(Bw, dtype=np.uint8)
            lost_final = self.frames.write(self.keys(writer_id, steps), samples.observation,
                                           samples.final_observation, done, start, prev_back.copy())
        self.data[steps % self.rows, off : off + Bw] = samples
        self.written[writer_id] = s0 + T
        gone = steps[steps >= self.live_rows] - self.live_rows
        return self.keys(writer_id, gone).reshape(-1), lost_final

    def reset_writer(self, writer_id: int) -> None:
        self.width(writer_id)
        self.traj_start[writer_id] = self.written[writer_id]

    def cursor(self, writer_id: int) -> int:
        """Steps ``writer_id`` has written (ValueError for an unknown writer)."""
        self.width(writer_id)
        return int(self.written[writer_id])

    def torn_write(self, writer_id: int, cursor: int, T: int, window: int) -> np.ndarray:
        """A write of ``T`` steps of ``writer_id`` from step ``cursor`` was cut by a kill.
        Skip past its rows (they start no trajectory: a seam) and return the keys of every
        item it may have touched: items of the steps it wrote and of the ``window`` steps
        before (whose multi-step windows reach into them), and those it evicted."""
        end = cursor + T
        steps = np.concatenate([np.arange(max(cursor - window, 0), end),
                                np.arange(max(cursor - self.live_rows, 0), max(end - self.live_rows, 0))])
        keys = self.keys(writer_id, steps).reshape(-1)
        self.written[writer_id] = self.traj_start[writer_id] = end
        if self.frames is not None:
            self.frames.stack_ok[keys] = self.frames.final_ok[keys] = False
        return keys

    def gather_observation(self, keys: np.ndarray, out) -> None:
        """out[i] = the observation of step ``keys[i]``; ``out`` leaves [n, ...] as Samples.observation."""
        if self.frames is None:
            take_into(out, self.flat.observation, keys)
        else:
            self.frames.gather_stacks(keys, out)

    def gather_final_observation(self, keys: np.ndarray, out) -> None:
        """out[i] = the final_observation of done step ``keys[i]`` (see ``final_observation_ok``)."""
        if self.frames is None:
            take_into(out, self.flat.final_observation, keys)
        else:
            self.frames.gather_final_stacks(keys, out)

    def observation_ok(self, keys: np.ndarray) -> np.ndarray:
        """bool [n]: ``gather_observation`` returns exactly what the env produced for ``keys``
        (always, without frame_stack; with it, where the rebuilt stack matched at write)."""
        if self.frames is None:
            return np.ones(len(keys), dtype=bool)
        return self.frames.stack_ok[keys]

    def final_observation_ok(self, keys: np.ndarray) -> np.ndarray:
        """bool [n]: as ``observation_ok`` for the final_observation of done steps ``keys``."""
        if self.frames is None:
            return np.ones(len(keys), dtype=bool)
        return self.frames.final_ok[keys]



class RingStorage:
    """Base of the storages whose items are made of ``ColumnRing`` steps: it owns the ring and
    what follows from it alone (writers, slots, seams, cursors, the repair of a torn write,
    policy versions). A subclass says what an item is: ``write``, ``gather``, ``items_per_write``,
    ``make_batch_spec``, ``restore``, ``check_dest`` and ``metrics``.

    ``window``: the steps an item spans (n_step, a sequence's length): a torn write drops the
    items of the ``window`` steps before it too, and a segment must leave ``window`` rows."""

    def __init__(self, segment_spec, columns_per_writer: dict[int, int], storage: StorageConfig, window: int,
                 window_name: str, arena: Arena, final_slots: int | None = None):
        """segment_spec: spec of a Samples segment (leaves lead with [T, B]; B is ignored,
        ``columns_per_writer`` gives each writer's); storage.capacity: steps held in total, split
        evenly over the columns; window_name: the config field ``window`` comes from, for
        errors (``TransitionStorageConfig.n_step``); final_slots: frame_store only, final frames kept (None: one write's)."""
        self.T, self.step_spec = segment_dims(segment_spec)
        self.window, self.window_name = int(window), window_name
        B_total = sum(columns_per_writer.values())
        rows = storage.capacity // max(B_total, 1)
        if rows < self.T + self.window:
            raise ValueError(f"StorageConfig.capacity={storage.capacity} gives {rows} steps per column for {B_total} "
                             f"columns; need >= T + {window_name} = {self.T + self.window}: raise capacity")
        # A write never drops the final frames it adds itself.
        one_write = self.T * max(columns_per_writer.values())
        self.ring = ColumnRing(self.step_spec, columns_per_writer, rows, arena, frame_stack=storage.frame_store,
                               final_slots=max(final_slots or 0, one_write))
        self.writer_ids = sorted(columns_per_writer)
        self.num_slots = self.ring.rows * self.ring.B_total
        self._batch_specs: dict[int, Any] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the ring (steps and frames; per-item state comes on top)."""
        return self.ring.nbytes

    def batch_spec(self, n: int) -> Any:
        spec = self._batch_specs.get(n)
        if spec is None:
            spec = self._batch_specs[n] = self.make_batch_spec(n)
        return spec

    def check_write(self, writer_id: int, samples) -> int:
        """Validate a segment of ``writer_id``; its T."""
        T = check_segment(samples, self.step_spec, self.ring.width(writer_id), f"segment of writer {writer_id}")
        if T + self.window > self.ring.live_rows:
            raise ValueError(f"segment of writer {writer_id}: T={T} > rows - {self.window_name} = "
                             f"{self.ring.live_rows - self.window}")
        return T

    def can_write(self, writer_id: int) -> bool:
        """Always True: a ring makes room by overwriting the writer's oldest steps."""
        return True

    def reset_writer(self, writer_id: int) -> None:
        self.ring.reset_writer(writer_id)

    def cursor(self, writer_id: int) -> int:
        return self.ring.cursor(writer_id)

    def torn_write(self, writer_id: int, cursor: int) -> np.ndarray:
        return self.ring.torn_write(writer_id, cursor, self.T, self.window)

    def release(self, keys: np.ndarray) -> None:
        """No-op: the steps stay (other items may use them); the ring overwrites them in order."""

    def policy_version(self, keys: np.ndarray) -> np.ndarray:
        """The version of each item's key step, its oldest."""
        return self.ring.flat.policy_version[keys].astype(np.int64)
