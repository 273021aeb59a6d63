"""A service's heartbeat: when its loops last turned, where the watchdog can read it.

Each service process publishes one small file (``start``): its pid, what it is doing (its
``phase``: "sampling", "restoring the replay snapshot"...; the watchdog names it when it kills),
then the ``time.monotonic()`` of its latest ``beat()`` (the system-wide monotonic clock: another
process on the host compares it with its own). The file is mapped, so a beat is one clock
read (vDSO, no system call) and one 8-byte store: cheap enough for every turn of a loop,
even a per-step one. Every wait in a service is bounded (docs/architecture.md, "Every wait
is bounded"), so a service whose loops stop turning for longer than its longest wait is
hung (an env stuck in ``step()``, a deadlocked extension, a stopped process), not waiting.
Until ``start``, ``beat()`` does nothing (serial mode, tests in one process). Every
``CHECK_S`` a beat also looks that the file is still there: one removed under a running
service (a temporary-file cleaner took the folder) is published again, not taken for a hang.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import struct
import threading
import time
from pathlib import Path
from typing import NamedTuple

DIR = "heartbeats"
"""The folder of a run's heartbeat files, in its socket directory (a tmpfs where there is one)."""

_RECORD = struct.Struct("<q64sd")  # pid, phase (UTF-8, NUL-padded), monotonic time of the latest beat (NaN: none yet)
_PHASE = struct.Struct("<64s")
_TIME = struct.Struct("<d")
CHECK_S = 5.0
"""How often a beat looks that its file is still there: the watchdog reads it every 5 s."""

log = logging.getLogger(__name__)
_map: mmap.mmap | None = None
_path: Path | None = None
_check_at = math.inf  # time.monotonic() of the next look at _path
_lost = False  # the file is gone and could not be published again (said once)


class Beat(NamedTuple):
    """A heartbeat file's content."""

    pid: int
    time: float
    """``time.monotonic()`` of the latest beat; NaN before the first."""
    phase: str
    """What the process said it was doing last ("starting" until it says)."""


def start(path: Path) -> None:
    """Publish this process's heartbeat at ``path`` (its folder is made, not its parent),
    replacing a previous incarnation's (no beat yet)."""
    global _map, _path, _check_at
    _map = _publish(path, _RECORD.pack(os.getpid(), b"starting", math.nan))
    _path, _check_at = path, time.monotonic() + CHECK_S


def _publish(path: Path, record: bytes) -> mmap.mmap:
    """``record`` as the file at ``path`` (its folder made, not its parent), mapped."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(record)
    with tmp.open("r+b") as f:
        mapped = mmap.mmap(f.fileno(), _RECORD.size)
    tmp.replace(path)  # whole, never half-written: a reader sees the old incarnation's or ours
    return mapped


def beat() -> None:
    """Say this process's loops are turning (a no-op before ``start``)."""
    if _map is not None:
        now = time.monotonic()
        _TIME.pack_into(_map, _RECORD.size - _TIME.size, now)
        if now >= _check_at:
            _look(now)


def _look(now: float) -> None:
    """Publish the heartbeat again (its latest content) if its file is gone."""
    global _map, _check_at, _lost
    _check_at = now + CHECK_S
    if _path.exists():
        return
    try:
        # The old map is dropped, not closed: a ``following`` thread may be writing into it.
        _map = _publish(_path, bytes(_map))
    except OSError as e:
        if not _lost:
            log.warning("heartbeat %s is gone and cannot be made again (%s); the watchdog will take this process "
                        "for hung", _path, e)
        _lost = True
        return
    log.warning("heartbeat %s was gone (its folder removed under the run?): published again", _path)
    _lost = False


def phase(name: str) -> None:
    """Say what this process does from now on (a long restore, a checkpoint, a wait), and beat.
    A no-op before ``start``."""
    if _map is not None:
        _PHASE.pack_into(_map, 8, name.encode()[:_PHASE.size])
        beat()


def read(path: Path) -> Beat | None:
    """The heartbeat at ``path``; None if there is none (or a file of another layout)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) != _RECORD.size:
        return None
    pid, name, t = _RECORD.unpack(data)
    return Beat(pid, t, name.rstrip(b"\0").decode(errors="replace"))


@contextlib.contextmanager
def following(leader: Path, every_s: float = 1.0):
    """In the block, this process's heartbeat is kept at least as recent as the one at ``leader``
    (read every ``every_s`` by a thread): for a data-parallel learner rank, which waits in the
    group's collectives while rank 0 writes a checkpoint. The ranks move in lock-step, so a rank
    that hangs stops rank 0 at the next collective, and both fall silent."""
    stop = threading.Event()

    def follow() -> None:
        while not stop.wait(every_s):
            theirs = read(leader)
            if _map is None or theirs is None or math.isnan(theirs.time):
                continue
            (mine,) = _TIME.unpack_from(_map, _RECORD.size - _TIME.size)
            if math.isnan(mine) or theirs.time > mine:
                _TIME.pack_into(_map, _RECORD.size - _TIME.size, theirs.time)

    thread = threading.Thread(target=follow, name="heartbeat-follow", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class BeatingWriter:
    """A binary file that beats at each write: a long ``torch.save`` into it (a checkpoint of a
    large model) is progress, not a hang."""

    def __init__(self, f):
        self.f = f

    def write(self, data) -> int:
        beat()
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def sleep(seconds: float) -> None:
    """``time.sleep(seconds)`` in turns of at most a second, beating at each: a long pause is not a hang."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        beat()
        time.sleep(min(left, 1.0))
    beat()
