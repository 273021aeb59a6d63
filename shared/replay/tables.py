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

from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import numpy as np

from shared.data.namedarraytuple import leading_len, leaves, map_leaves, spec_nbytes, spec_of, with_leading_dims
from shared.runtime import faults
from shared.data.batches import Transition, WindowSteps
from shared.replay.arena import HEAP, OP_DROP, OP_INSERT, OP_NAMES, OP_PRIORITIES, OP_SAMPLE, Arena, Cells
from shared.replay.frames import FrameStacks, frame_stack_shape
from shared.replay.nstep import nstep_targets
from shared.replay.rate_limiter import RateLimiter
from shared.replay.selectors import Selector

_F32 = np.dtype(np.float32).str
_NO_KEYS = np.zeros(0, dtype=np.int64)


# ---------------------------------------------------------------- specs and checks


def _strip_leading(spec, k: int) -> Any:
    """``spec`` without its first ``k`` leading dims on every leaf."""
    if spec is None:
        return None
    if "fields" in spec:
        return {"type": spec["type"], "fields": [[f, _strip_leading(c, k)] for f, c in spec["fields"]]}
    return {"dtype": spec["dtype"], "shape": list(spec["shape"][k:])}


def _leaf_specs(spec, path: str = "") -> Iterator[tuple[str, dict]]:
    if spec is None:
        return
    if "fields" in spec:
        for f, child in spec["fields"]:
            yield from _leaf_specs(child, f"{path}.{f}" if path else f)
    else:
        yield path, spec


def _field(spec, name: str):
    for f, child in spec["fields"]:
        if f == name:
            return child
    raise ValueError(f"segment spec has no field {name!r}; the replay tables need it (fields: "
                     f"{[f for f, _ in spec['fields']]})")


def _check_like(got_spec, want_spec, what: str) -> None:
    """Raise ValueError naming the first leaf where ``got_spec`` differs from ``want_spec``."""
    got, want = dict(_leaf_specs(got_spec)), dict(_leaf_specs(want_spec))
    if list(got) != list(want):
        raise ValueError(f"{what}: fields {list(got)} do not match the table's {list(want)}")
    for path, w in want.items():
        if got[path] != w:
            raise ValueError(
                f"{what}.{path}: dtype {got[path]['dtype']} shape {got[path]['shape']}, "
                f"expected dtype {w['dtype']} shape {w['shape']}"
            )


def _segment_dims(segment_spec) -> tuple[int, Any]:
    """(T, spec of one step) of a segment spec whose leaves lead with [T, B]."""
    T = next(_leaf_specs(segment_spec))[1]["shape"][0]
    return int(T), _strip_leading(segment_spec, 2)


def _take_into(dest_tree, src_tree, idx: np.ndarray) -> None:
    """dest leaf[i] = src leaf[idx[i]] for every leaf; src leaves are flat [slots, ...]."""
    for (_, d), (_, s) in zip(leaves(dest_tree), leaves(src_tree)):
        np.take(s, idx, axis=0, out=d)


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

    def write(self, writer_id: int, samples, bootstrap_value) -> tuple[np.ndarray, np.ndarray]:
        """Store one segment; return (keys whose data it overwrote, keys that became items)."""

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


# ---------------------------------------------------------------- column ring


class ColumnRing:
    """Trajectory steps in a ring of ``rows`` steps per env column: leaves [rows, B_total, ...].

    Writer w owns the column block [offset_w, offset_w + B_w) and its own write cursor, so
    samplers that insert at different rates each overwrite only their own oldest steps.
    Step s of writer w lives in row s % rows; its key is row * B_total + column. Shared by
    the transition storage and (later) a sequence storage for R2D1, which read observations
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
            K, H, W = frame_stack_shape(_field(step_spec, "observation"))
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
        lost_final = _NO_KEYS
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
            _take_into(out, self.flat.observation, keys)
        else:
            self.frames.gather_stacks(keys, out)

    def gather_final_observation(self, keys: np.ndarray, out) -> None:
        """out[i] = the final_observation of done step ``keys[i]`` (see ``final_observation_ok``)."""
        if self.frames is None:
            _take_into(out, self.flat.final_observation, keys)
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


# ---------------------------------------------------------------- transitions


@dataclass(frozen=True)
class TransitionStorageConfig:
    capacity: int = 100_000
    """Transitions held in total; each env column keeps capacity // (total columns) steps."""
    n_step: int = 1
    """Rewards summed per transition before bootstrapping."""
    gamma: float = 0.99
    """Discount per step."""
    frame_store: bool = False
    """Keep each frame of [K, H, W] uint8 frame-stack observations once and rebuild the stacks
    at sample time (Atari; see frames.py)."""
    final_frames: int = 0
    """frame_store: final-observation frames kept for done steps; 0 = capacity // 32 (at least
    one segment's steps). When they wrap, items bootstrapping from a dropped one leave early."""
    store_steps: bool = False
    """Batches carry each step of the n-step window (Transition.steps: WindowSteps [n, n_step]);
    nothing more is stored, the steps are gathered from the ring at sample time."""


def transition_batch_spec(step_spec, n: int, window: int = 0) -> Any:
    """Spec of a Transition batch of ``n`` items for steps laid out as ``step_spec`` (Samples),
    with ``steps`` WindowSteps [n, window] if ``window`` (the n-step length), else None."""
    obs = with_leading_dims(_field(step_spec, "observation"), [n])
    scalar = {"dtype": _F32, "shape": [n]}
    steps = None
    if window:
        per_step = {"observation": _field(step_spec, "observation"), "action": _field(step_spec, "action"),
                    "reward": {"dtype": _F32, "shape": []}, "discount": {"dtype": _F32, "shape": []}}
        steps = with_leading_dims({"type": "WindowSteps", "fields": [[f, per_step[f]] for f in WindowSteps._fields]},
                                  [n, window])
    by_field = {
        "observation": obs,
        "action": with_leading_dims(_field(step_spec, "action"), [n]),
        "return_": scalar,
        "bootstrap_observation": obs,
        "bootstrap_discount": scalar,
        "is_weight": scalar,
        "policy_version": with_leading_dims(_field(step_spec, "policy_version"), [n]),
        "steps": steps,
    }
    return {"type": "Transition", "fields": [[f, by_field[f]] for f in Transition._fields]}


class TransitionStorage:
    """Items are n-step transitions, one per (step, env column), keyed as in ``ColumnRing``.

    n-step targets are computed once, when the steps they need arrive (nstep.py): an item
    becomes live when observation[t + n] is written or a done inside [t, t + n) closes its
    window, so the newest n steps of each writer wait for the next segment. The return,
    discount and the key of the bootstrap observation are kept per key; a sample gathers
    observation, action and bootstrap observation from the ring. A live item's bootstrap
    step is never older than its own, so it is overwritten no earlier than the item.

    Writer restarts (``reset_writer``) are seams: items of the last n steps before a seam
    that no done had closed never become live, since their windows would cross it.

    Memory: the whole Samples structure is stored per step, final_observation included
    (it is only valid on done steps), unless ``config.frame_store``: then the ring keeps one
    frame per step and final frames of done steps only, and rebuilds the stacks (frames.py);
    an item becomes live only if its stacks rebuild exactly, and leaves when the final frame
    it bootstraps from is dropped.
    """

    def __init__(
        self,
        segment_spec,
        columns_per_writer: dict[int, int],
        config: TransitionStorageConfig = TransitionStorageConfig(),
        arena: Arena = HEAP,
    ):
        """segment_spec: spec of a Samples segment (leaves lead with [T, B]; B is ignored,
        ``columns_per_writer`` gives each writer's). arena: where the state lives
        (shared/replay/arena.py: shared memory that outlives the process, or the heap)."""
        self.T, step_spec = _segment_dims(segment_spec)
        for name in ("observation", "action", "reward", "terminated", "truncated",
                     "final_observation", "policy_version", "failed"):
            _field(step_spec, name)
        if config.n_step < 1 or not 0 <= config.gamma <= 1:
            raise ValueError(f"TransitionStorageConfig: need n_step >= 1 and 0 <= gamma <= 1, got {config}")
        B_total = sum(columns_per_writer.values())
        rows = config.capacity // max(B_total, 1)
        if rows < self.T + config.n_step:
            raise ValueError(
                f"TransitionStorageConfig.capacity={config.capacity} gives {rows} steps per column for "
                f"{B_total} columns; need >= T + n_step = {self.T + config.n_step}: raise capacity"
            )
        self.config = config
        self.step_spec = step_spec
        # A write never drops the final frames it adds itself.
        final_slots = max(config.final_frames or config.capacity // 32, self.T * max(columns_per_writer.values()))
        self.ring = ColumnRing(step_spec, columns_per_writer, rows, arena, frame_stack=config.frame_store,
                               final_slots=final_slots)
        self.writer_ids = sorted(columns_per_writer)
        self.num_slots = self.ring.rows * self.ring.B_total
        self.return_ = arena.array("return", self.num_slots, np.float32)
        self.discount = arena.array("discount", self.num_slots, np.float32)
        self.bootstrap_key = arena.array("bootstrap_key", self.num_slots, np.int64)
        self.bootstrap_final = arena.array("bootstrap_final", self.num_slots, bool)
        self._batch_specs: dict[int, Any] = {}
        # frame_store: items never made live because a stack did not rebuild exactly (the K - 1
        # steps after a seam that cut an episode; all episode starts if the padding is not
        # FrameStackObservation's "reset"), and items dropped with a final frame.
        self.counts = Cells(arena, "transitions", unrebuilt=0, final_frame_evictions=0)

    def metrics(self) -> dict[str, float]:
        return {"frames_unrebuilt_items": float(self.counts.unrebuilt),
                "final_frame_evictions": float(self.counts.final_frame_evictions)}

    @property
    def nbytes(self) -> int:
        """Bytes of the ring (steps and frames; the per-item targets come on top)."""
        return self.ring.nbytes

    def batch_spec(self, n: int) -> Any:
        spec = self._batch_specs.get(n)
        if spec is None:
            window = self.config.n_step if self.config.store_steps else 0
            spec = self._batch_specs[n] = transition_batch_spec(self.step_spec, n, window)
        return spec

    def items_per_write(self, writer_id: int) -> int:
        return self.T * self.ring.width(writer_id)

    def can_write(self, writer_id: int) -> bool:
        """Always True: a ring makes room by overwriting the writer's oldest steps."""
        return True

    def write(self, writer_id: int, samples, bootstrap_value=None, bootstrap_observation=None) -> tuple[np.ndarray, np.ndarray]:
        """Append one segment [T, B_w] (T <= rows - n_step); the segment's bootstrap is unused
        here (n-step transitions bootstrap from the observations they store)."""
        ring, n = self.ring, self.config.n_step
        T = _check_segment(samples, self.step_spec, ring.width(writer_id), f"segment of writer {writer_id}")
        if T + n > ring.live_rows:
            raise ValueError(f"segment of writer {writer_id}: T={T} > rows - n_step = {ring.live_rows - n}")
        s0 = ring.written[writer_id]
        k_old = min(n, s0 - ring.traj_start[writer_id])  # earlier steps whose items may be pending
        old = {f: ring.read(writer_id, f, s0 - k_old, s0) for f in ("reward", "terminated", "truncated", "failed")}
        overwritten, lost_final = ring.write(writer_id, samples)
        if lost_final.size:
            lost = self._bootstrapping_from_final(lost_final)
            self.counts.final_frame_evictions += lost.size
            overwritten = np.union1d(overwritten, lost)

        window = {f: np.concatenate([old[f], getattr(samples, f)]) for f in old}
        tg = nstep_targets(window["reward"], window["terminated"], window["truncated"], n, self.config.gamma,
                           window["failed"])
        new = tg.complete & tg.valid  # a failed env step is no transition: never an item
        old_done = window["terminated"][:k_old] | window["truncated"][:k_old]
        new[:k_old] &= ~np.logical_or.accumulate(old_done[::-1], axis=0)[::-1]  # live already

        j, b = np.nonzero(new)  # time-major, so a Fifo sees items in step order
        steps = s0 - k_old + j
        cols = ring.offsets[writer_id] + b
        keys = (steps % ring.rows) * ring.B_total + cols
        boot_keys = ((steps + tg.bootstrap_offset[j, b]) % ring.rows) * ring.B_total + cols
        from_final = tg.from_final[j, b]
        # Only items whose observations the ring returns exactly (always true without frame_store).
        ok = ring.observation_ok(keys) & np.where(from_final, ring.final_observation_ok(boot_keys),
                                                   ring.observation_ok(boot_keys))
        self.counts.unrebuilt += int(ok.size - ok.sum())
        keys, j, b, boot_keys, from_final = keys[ok], j[ok], b[ok], boot_keys[ok], from_final[ok]
        self.return_[keys] = tg.return_[j, b]
        self.discount[keys] = tg.discount[j, b]
        self.bootstrap_key[keys] = boot_keys
        self.bootstrap_final[keys] = from_final
        return overwritten, keys.astype(np.int64)

    def _bootstrapping_from_final(self, done_keys: np.ndarray) -> np.ndarray:
        """Keys of the items (live or not) that bootstrap from the final observation of
        ``done_keys``: they can only be the n steps up to each done step, in its column."""
        rows, B = self.ring.rows, self.ring.B_total
        back = np.arange(self.config.n_step, dtype=np.int64)[None, :] * B
        cand = ((done_keys[:, None] - back) % (rows * B)).reshape(-1)
        owner = np.repeat(done_keys, self.config.n_step)
        return cand[self.bootstrap_final[cand] & (self.bootstrap_key[cand] == owner)]

    def reset_writer(self, writer_id: int) -> None:
        self.ring.reset_writer(writer_id)

    def cursor(self, writer_id: int) -> int:
        return self.ring.cursor(writer_id)

    def torn_write(self, writer_id: int, cursor: int) -> np.ndarray:
        return self.ring.torn_write(writer_id, cursor, self.T, self.config.n_step)

    def restore(self, live: np.ndarray) -> np.ndarray:
        """frame_store: live items whose final frame a torn write took."""
        if self.ring.frames is None:
            return _NO_KEYS
        keys = np.flatnonzero(live & self.bootstrap_final)
        return keys[~self.ring.frames.owns_final(self.bootstrap_key[keys])]

    def check_dest(self, dest, n: int) -> None:
        _check_like(spec_of(dest), self.batch_spec(n), "destination Transition batch")

    def gather(self, keys: np.ndarray, is_weights: np.ndarray, dest) -> None:
        ring, flat = self.ring, self.ring.flat
        ring.gather_observation(keys, dest.observation)
        _take_into(dest.action, flat.action, keys)
        np.take(self.return_, keys, out=dest.return_)
        np.take(self.discount, keys, out=dest.bootstrap_discount)
        dest.is_weight[:] = is_weights
        np.take(flat.policy_version, keys, axis=0, out=dest.policy_version)
        boot = self.bootstrap_key[keys]
        ring.gather_observation(boot, dest.bootstrap_observation)
        final = np.flatnonzero(self.bootstrap_final[keys])  # done steps: rare, patch them
        if final.size:
            patch = map_leaves(lambda d: np.empty((final.size, *d.shape[1:]), d.dtype), dest.bootstrap_observation)
            ring.gather_final_observation(boot[final], patch)
            dest.bootstrap_observation[final] = patch
        if dest.steps is not None:
            self._gather_steps(keys, dest.steps)

    def _gather_steps(self, keys: np.ndarray, dest) -> None:
        """dest (WindowSteps [len(keys), n_step]) = the steps of each item's window: its m steps
        (the rewards its return sums; m follows from where it bootstraps), zeros after them."""
        ring, rows, B, n = self.ring, self.ring.rows, self.ring.B_total, self.config.n_step
        offset = (self.bootstrap_key[keys] - keys) // B % rows  # same column: a whole number of rows
        m = offset + self.bootstrap_final[keys]  # a done at step m - 1 bootstraps from its final observation
        inside = np.arange(n)[None, :] < m[:, None]  # [N, n]
        i, k = np.nonzero(inside)
        step_keys = (keys[i] + k * B) % self.num_slots
        for _, leaf in leaves(dest):
            leaf[~inside] = 0
        dest.discount[i, k] = self.config.gamma ** k  # float64, as nstep_targets sums
        dest.reward[i, k] = ring.flat.reward[step_keys]

        def empty(d):
            return np.empty((step_keys.size, *d.shape[2:]), d.dtype)

        observation, action = map_leaves(empty, dest.observation), map_leaves(empty, dest.action)
        ring.gather_observation(step_keys, observation)
        _take_into(action, ring.flat.action, step_keys)
        dest.observation[i, k] = observation
        dest.action[i, k] = action

    def release(self, keys: np.ndarray) -> None:
        """No-op: the steps stay, since other items may bootstrap from them; the ring
        overwrites them in order."""

    def policy_version(self, keys: np.ndarray) -> np.ndarray:
        return self.ring.flat.policy_version[keys].astype(np.int64)


# ---------------------------------------------------------------- on-policy segments


@dataclass(frozen=True)
class SegmentStorageConfig:
    capacity: int = 4
    """Segments the queue holds; when full, inserts wait (the sampler blocks on its segment)."""


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
        config: SegmentStorageConfig = SegmentStorageConfig(),
        arena: Arena = HEAP,
    ):
        """segment_spec: spec of a Samples segment (leaves lead with [T, B]); arena: where
        the slots live (shared/replay/arena.py)."""
        self.T, self.step_spec = _segment_dims(segment_spec)
        _field(self.step_spec, "policy_version")
        widths = set(columns_per_writer.values())
        if len(widths) != 1:
            raise ValueError(f"SegmentStorage needs the same B for every writer, got {columns_per_writer}")
        if config.capacity < 1:
            raise ValueError(f"SegmentStorageConfig.capacity must be >= 1, got {config.capacity}")
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
        return {
            "type": "OnPolicyBatch",
            "fields": [
                ["samples", with_leading_dims(self.step_spec, [self.T, n * self.B])],
                ["bootstrap_value", {"dtype": _F32, "shape": [n * self.B]}],
                ["bootstrap_observation", with_leading_dims(_field(self.step_spec, "observation"), [n * self.B])],
            ],
        }

    def items_per_write(self, writer_id: int) -> int:
        return 1

    def can_write(self, writer_id: int) -> bool:
        return not self.occupied.all()

    def write(self, writer_id: int, samples, bootstrap_value, bootstrap_observation) -> tuple[np.ndarray, np.ndarray]:
        if writer_id not in self.writer_ids:
            raise ValueError(f"unknown writer_id {writer_id}; writers are {self.writer_ids}")
        T = _check_segment(samples, self.step_spec, self.B, f"segment of writer {writer_id}")
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
        return _NO_KEYS, np.array([k], dtype=np.int64)

    def reset_writer(self, writer_id: int) -> None:
        """No-op: a segment is self-contained (it carries its own bootstrap_value)."""

    def cursor(self, writer_id: int) -> int:
        return 0

    def torn_write(self, writer_id: int, cursor: int) -> np.ndarray:
        """Nothing of another item: a write fills one free slot, which ``restore`` frees."""
        return _NO_KEYS

    def restore(self, live: np.ndarray) -> np.ndarray:
        """Free the slots of items that never became live (a torn write) or left by a torn sample."""
        self.occupied &= live
        return _NO_KEYS

    def check_dest(self, dest, n: int) -> None:
        _check_like(spec_of(dest), self.batch_spec(n), "destination OnPolicyBatch")
        for path, leaf in leaves(dest):
            if not leaf.flags.c_contiguous:
                raise ValueError(f"destination OnPolicyBatch.{path} must be C-contiguous (use from_spec)")

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


def _check_segment(samples, step_spec, width: int, what: str) -> int:
    """Validate a segment against the table's step spec and width; return its T."""
    got = spec_of(samples)
    _check_like(_strip_leading(got, 2), step_spec, what)
    T = None
    for path, leaf in _leaf_specs(got):
        lead = leaf["shape"][:2]
        if T is None:
            T = lead[0] if lead else None
        if lead != [T, width]:
            raise ValueError(f"{what}.{path}: leading dims {lead}, expected [T, B] = [{T}, {width}]")
    return int(T)


# ---------------------------------------------------------------- table


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
        drop = self.storage.torn_write(writer, cursor) if op == OP_INSERT else _NO_KEYS
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
