"""Where a replay table keeps its state: the heap, or named shared memory that outlives the process.

Every array a table's parts hold (the ring of steps, n-step targets, live flags and
generations, priorities and the sum-tree, rate-limiter counters, writer cursors and serials)
is asked for from an *arena* by name. ``HEAP`` hands out fresh arrays. ``ShmArena`` puts
each one in its own segment ``rlpipe-<run>-replay<i>-t.<name>`` next to a header segment
``...-table`` that says what they hold:

- a magic number, the layout version and a fingerprint of the table's layout (config,
  segment spec, writers): a replay restarted with another layout does not re-attach;
- ``complete``: set once the table is built, so a kill during construction is not mistaken
  for a table; a restore from a snapshot writes the header last and its ``complete`` cell
  last of all, so a kill during a restore leaves no header (the next start restores again)
  or one not complete (discarded, and the snapshot restored again);
- the operation in progress (insert, sample, priorities, drop) and its writer and cursor,
  set before a mutation starts and cleared when it ends: a torn write at the moment of a
  ``kill -9`` shows up here at the next start (``Table.recover`` repairs what it touched).

A process that dies by ``kill -9`` leaves the segments; the restarted replay re-attaches
(``restored``), each segment checked against the size the layout gives it as the table's
parts ask for it (``ShmArena._segment``: the one check, for a table found in shared memory
and one restored from a snapshot alike). A table that does not check out (a header of
another layout, a construction that did not finish, a segment truncated, missing or of
another size, a half-written snapshot file) is discarded, logged, and built empty
(``Arena.build``): never a table that refuses every sampler. A normal exit unlinks them (they are registered as owned, like every segment
of a service), and ``rlpipe clean`` removes them with the rest of the run's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np

from shared.runtime import faults, heartbeat
from shared.runtime.files import fsync_dir
from shared.transport import shm
from shared.data.namedarraytuple import from_leaves, from_spec, leaf_specs, spec_nbytes

log = logging.getLogger(__name__)

MAGIC = 0x726C7069_70657462  # "rlpipetb"
LAYOUT_VERSION = 1
# Header cells (int64).
_MAGIC, _VERSION, _FINGERPRINT, _COMPLETE, _OP, _OP_WRITER, _OP_CURSOR, _RESTARTS = range(8)
HEADER_OP = _OP
"""The header cell holding the operation in progress (an outside reader, e.g. a test, checks it is OP_NONE)."""
_HEADER_CELLS = 16
COPY_CHUNK = 16 << 20
"""Bytes a snapshot or a restore copies between two heartbeats (tens of milliseconds)."""

OP_NONE, OP_INSERT, OP_SAMPLE, OP_PRIORITIES, OP_DROP = range(5)
OP_NAMES = {OP_NONE: "none", OP_INSERT: "insert", OP_SAMPLE: "sample", OP_PRIORITIES: "priorities", OP_DROP: "drop"}
T = TypeVar("T")


class StaleTable(Exception):
    """A persisted table's segment does not fit the layout asked for it (``Arena.build`` discards the table)."""


class Arena:
    """State on the heap: nothing survives the process (the default, and serial mode's)."""

    restored = False
    """True when the arrays handed out hold a previous process's table."""

    def build(self, make: Callable[["Arena"], T]) -> T:
        """``make(self)``: a table whose parts take their state from this arena. A persisted
        table that turns out not to fit (``StaleTable``) is discarded, logged, and made again empty."""
        return make(self)

    def array(self, name: str, shape, dtype, fill=0) -> np.ndarray:
        return np.full(shape, fill, dtype=dtype)

    def tree(self, name: str, spec, fill: bool = True) -> Any:
        """A namedarraytuple laid out as ``spec``; fresh ones hold from_spec's sentinels if ``fill``."""
        return from_spec(spec, fill=fill)

    def begin(self, op: int, writer: int = -1, cursor: int = 0) -> None:
        """A mutation starts (see the module doc); ``end`` when it is complete."""

    def end(self) -> None:
        pass

    def torn(self) -> tuple[int, int, int]:
        """(op, writer, cursor) that a killed process left in progress; op OP_NONE if none."""
        return OP_NONE, -1, 0

    def ready(self) -> None:
        """The table is built (and recovered): a restart may re-attach from now on."""

    @property
    def restarts(self) -> int:
        """Times the table was re-attached after its process died."""
        return 0


HEAP = Arena()


def fingerprint(*parts) -> int:
    """A stable 63-bit hash of JSON-able ``parts`` (what decides a table's layout)."""
    digest = hashlib.blake2b(json.dumps(parts, sort_keys=True, default=repr).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ShmArena(Arena):
    """Table state in named shared memory of replay ``instance`` of run ``run_id``.

    ``fingerprint``: of everything that decides the layout; a header with another one (or an
    incomplete table) is discarded, with its segments, and the table starts empty.
    """

    def __init__(self, run_id: str, instance: int, fingerprint: int, snapshot: Path | None = None):
        """``snapshot``: a directory ``snapshot()`` wrote; restored into shared memory when
        no table is there (after a machine restart, or a stopped run launched with --resume)."""
        self.run_id, self.instance, self.fingerprint = run_id, instance, fingerprint
        self._segments: dict[str, shm.Segment] = {}
        self.restored = False
        name = self._name("table")
        if snapshot is not None and (in_memory := _problem_in_memory(name, fingerprint)) is not None:
            for copy in (snapshot, _previous(snapshot)):  # replay.old: a crash came between snapshot()'s renames
                problem = _header_problem((copy / "table").read_bytes(), fingerprint) if (copy / "table").exists() \
                    else "none there"
                if problem is None:
                    if in_memory != "none there":
                        log.warning("replay table in shared memory not used (%s): restoring the snapshot", in_memory)
                    self._restore_snapshot(copy)
                    break
                if problem != "none there":
                    log.warning("replay snapshot in %s not restored: %s", copy, problem)
        try:
            seg = shm.Segment.attach(name)
        except FileNotFoundError:
            self._start_empty()
            return
        problem = _header_problem(seg.mmap, fingerprint)
        if problem is not None:
            seg.close()
            self._discard(problem)
            return
        self.restored = True
        seg.adopt()
        self.header = np.ndarray(_HEADER_CELLS, np.int64, seg.mmap)
        self.header[_RESTARTS] += 1
        self._segments[name] = seg
        log.info("replay table found in shared memory (restart %d): re-attaching", self.header[_RESTARTS])

    def build(self, make: Callable[[Arena], T]) -> T:
        try:
            return make(self)
        except StaleTable as e:
            self._discard(str(e))
            return make(self)

    def _discard(self, why: str) -> None:
        log.warning("replay table in shared memory not used (%s): starting empty", why)
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
        self.restored = False
        self._start_empty()

    def _remove_segments(self) -> None:
        """Remove every segment of an earlier table of this replay, its header first."""
        name = self._name("table")
        for path in sorted(shm.run_segments(self.run_id), key=lambda path: path.name != name):
            if path.name.startswith(self._name("t.")) or path.name == name:
                path.unlink()

    def _start_empty(self) -> None:
        """A fresh header, once every segment of an earlier table of this replay is removed."""
        name = self._name("table")
        self._remove_segments()
        seg = shm.Segment.create(name, _HEADER_CELLS * 8)
        self.header = np.ndarray(_HEADER_CELLS, np.int64, seg.mmap)
        self.header[:] = 0
        self.header[[_MAGIC, _VERSION, _FINGERPRINT]] = MAGIC, LAYOUT_VERSION, self.fingerprint
        self._segments[name] = seg

    def _name(self, purpose: str) -> str:
        return shm.segment_name(self.run_id, "replay", self.instance, purpose)

    def _restore_snapshot(self, snapshot: Path) -> None:
        """Each file of the snapshot into the segment of its name and size (a truncated file
        makes a segment of the wrong size, which the re-attach then finds), once what an
        earlier table (or an interrupted restore) left is removed. The header comes last, and
        its ``complete`` cell last of all: a kill at any point leaves no table taken for good."""
        heartbeat.phase("restoring the replay snapshot")
        self._remove_segments()
        for path in sorted(snapshot.glob("t.*")):
            seg = shm.Segment.create(self._name(path.name), max(path.stat().st_size, 1))  # mmap takes no 0 bytes
            with path.open("rb") as f:
                _copy(f.readinto, seg.mmap)
            seg.close()
            faults.point("replay.restore")
        cells = np.frombuffer((snapshot / "table").read_bytes(), np.int64)
        seg = shm.Segment.create(self._name("table"), cells.nbytes)
        header = np.ndarray(_HEADER_CELLS, np.int64, seg.mmap)
        header[:] = cells
        header[_COMPLETE] = 0
        faults.point("replay.restore")
        header[_COMPLETE] = cells[_COMPLETE]  # last: the restore is whole from here
        del header
        seg.close()
        log.info("replay table restored from the snapshot in %s", snapshot)

    def snapshot(self, directory: Path) -> None:
        """Copy the table to ``directory`` (call between operations). Written beside it first,
        fsynced, then renamed into place (the last one renamed to ``<directory>.old`` first and
        removed last): a crash meanwhile leaves the previous snapshot, which a restore then
        takes. OSError (a full disk) with the previous snapshot as it was and no partial copy left."""
        tmp, old = directory.with_name(directory.name + ".tmp"), _previous(directory)
        shutil.rmtree(tmp, ignore_errors=True)
        prefix = self._name("")
        try:
            tmp.mkdir(parents=True)
            for full, seg in self._segments.items():
                with (tmp / full.removeprefix(prefix)).open("wb") as f:
                    _copy(f.write, seg.mmap)
                    f.flush()
                    os.fsync(f.fileno())
            fsync_dir(tmp)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if directory.exists():
            shutil.rmtree(old, ignore_errors=True)
            directory.rename(old)
        tmp.rename(directory)
        fsync_dir(directory.parent)
        shutil.rmtree(old, ignore_errors=True)

    def _segment(self, name: str, nbytes: int) -> tuple[shm.Segment, bool]:
        """(segment ``t.<name>`` of ``nbytes`` bytes, whether it is fresh)."""
        full = self._name(f"t.{name}")
        if full in self._segments:
            raise ValueError(f"replay table state {name!r} asked for twice: two parts use one name")
        if self.restored:
            try:
                seg = shm.Segment.attach(full).adopt()
            except (FileNotFoundError, ValueError) as e:  # gone, or not a file we may map
                raise StaleTable(str(e)) from None
            if seg.size != max(nbytes, 1):
                seg.close()
                raise StaleTable(f"segment {full} holds {seg.size} bytes, the layout needs {max(nbytes, 1)}")
            fresh = False
        else:
            seg, fresh = shm.Segment.create(full, max(nbytes, 1)), True
        self._segments[full] = seg
        return seg, fresh

    def array(self, name: str, shape, dtype, fill=0) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in np.atleast_1d(shape))
        seg, fresh = self._segment(name, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        arr = np.ndarray(shape, dtype, seg.mmap)
        if fresh and np.any(fill != 0):
            arr[...] = fill
        return arr

    def tree(self, name: str, spec, fill: bool = True) -> Any:
        seg, fresh = self._segment(name, spec_nbytes(spec))
        return from_spec(spec, seg.mmap, fill=fill and fresh)

    def begin(self, op: int, writer: int = -1, cursor: int = 0) -> None:
        h = self.header
        h[_OP_WRITER], h[_OP_CURSOR] = writer, cursor
        h[_OP] = op  # last: a kill before this line leaves no trace, and nothing was changed yet

    def end(self) -> None:
        self.header[_OP] = OP_NONE

    def torn(self) -> tuple[int, int, int]:
        h = self.header
        return int(h[_OP]), int(h[_OP_WRITER]), int(h[_OP_CURSOR])

    def ready(self) -> None:
        self.header[_OP] = OP_NONE
        self.header[_COMPLETE] = 1

    @property
    def restarts(self) -> int:
        return int(self.header[_RESTARTS])

    def unlink(self) -> None:
        for seg in self._segments.values():
            seg.unlink()


class Footprint(Arena):
    """Sizes only: what each piece of a table's state would take as a ``ShmArena`` segment,
    for the launcher's space check (``services.footprint``), without the memory. The arrays
    handed out are zero-stride views of one element: a table composes over them as over
    real ones (fills, reshapes), and nothing the size of the table is ever allocated."""

    def __init__(self):
        self.sizes: dict[str, int] = {"table": _HEADER_CELLS * 8}
        """Bytes of each segment, by purpose (``table``: the header)."""

    def array(self, name: str, shape, dtype, fill=0) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in np.atleast_1d(shape))
        self.sizes[f"t.{name}"] = max(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, 1)
        return _zero_stride(shape, dtype)

    def tree(self, name: str, spec, fill: bool = True) -> Any:
        self.sizes[f"t.{name}"] = max(spec_nbytes(spec), 1)
        return from_leaves(spec, [_zero_stride(tuple(leaf["shape"]), np.dtype(leaf["dtype"]))
                                  for leaf in leaf_specs(spec)])


def _copy(move: Callable[[memoryview], Any], buffer) -> None:
    """``move`` (a file's ``readinto`` or ``write``) over ``buffer`` in COPY_CHUNK pieces, beating
    between them: a large table's snapshot or restore is progress, not a hang."""
    with memoryview(buffer) as view:
        for start in range(0, len(view), COPY_CHUNK):
            heartbeat.beat()
            chunk = view[start:start + COPY_CHUNK]
            done = 0
            while done < len(chunk):  # a file's write or readinto may move less than asked
                moved = move(chunk[done:])
                if not moved:
                    raise OSError(f"short copy: {done} of {len(chunk)} bytes")
                done += moved


def _problem_in_memory(name: str, fingerprint: int) -> str | None:
    """Why the table header segment ``name`` in shared memory holds no table of
    ``fingerprint`` ("none there" when there is no such segment); None if it does."""
    try:
        seg = shm.Segment.attach(name)
    except (FileNotFoundError, ValueError):
        return "none there"
    try:
        return _header_problem(seg.mmap, fingerprint)
    finally:
        seg.close()


def _zero_stride(shape: tuple, dtype: np.dtype) -> np.ndarray:
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, (0,) * len(shape))


def _previous(snapshot: Path) -> Path:
    """Where ``snapshot()`` keeps the last snapshot while it puts the next one in place."""
    return snapshot.with_name(snapshot.name + ".old")


def _header_problem(header, fingerprint: int) -> str | None:
    """Why ``header`` (a table header segment's bytes) does not hold a table of ``fingerprint``; None if it does."""
    if len(header) != _HEADER_CELLS * 8:
        return f"header of {len(header)} bytes"
    h = np.frombuffer(header, np.int64)
    if h[_MAGIC] != MAGIC or h[_VERSION] != LAYOUT_VERSION:
        return "not a table header of this version"
    if h[_FINGERPRINT] != fingerprint:
        return "another layout: config, samplers or segment spec changed"
    if not h[_COMPLETE]:
        return "its construction did not finish"
    return None


class Cells:
    """Named scalars in one arena array: the counters and cursors a table part must keep
    across a restart. ``cells.name`` reads a Python number, ``cells.name = v`` writes it."""

    def __init__(self, arena: Arena, name: str, dtype=np.int64, **initial):
        index = {k: i for i, k in enumerate(initial)}
        values = arena.array(name, len(index), dtype, fill=np.array(list(initial.values()), dtype=dtype))
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str):
        try:
            return self._values[self._index[name]].item()
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value) -> None:
        if name not in self._index:
            raise AttributeError(f"no cell {name!r}; cells are {list(self._index)}")
        self._values[self._index[name]] = value
