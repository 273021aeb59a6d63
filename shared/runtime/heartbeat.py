"""A service's heartbeat: when its loops last turned, where the watchdog can read it.

Each service process publishes one small file (``start``): its pid, then the
``time.monotonic()`` of its latest ``beat()`` (the system-wide monotonic clock: another
process on the host compares it with its own). The file is mapped, so a beat is one clock
read (vDSO, no system call) and one 8-byte store: cheap enough for every turn of a loop,
even a per-step one. Every wait in a service is bounded (docs/architecture.md, "Every wait
is bounded"), so a service whose loops stop turning for longer than its longest wait is
hung (an env stuck in ``step()``, a deadlocked extension, a stopped process), not waiting.
Until ``start``, ``beat()`` does nothing (serial mode, tests in one process).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import time
from pathlib import Path

DIR = "heartbeats"
"""The folder of a run's heartbeat files, in its socket directory (a tmpfs where there is one)."""

_RECORD = struct.Struct("<qd")  # pid, monotonic time of the latest beat (NaN: none yet)
_TIME = struct.Struct("<d")
_map: mmap.mmap | None = None


def start(path: Path) -> None:
    """Publish this process's heartbeat at ``path`` (its folder is made, not its parent),
    replacing a previous incarnation's (no beat yet)."""
    global _map
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(_RECORD.pack(os.getpid(), math.nan))
    with tmp.open("r+b") as f:
        _map = mmap.mmap(f.fileno(), _RECORD.size)
    tmp.replace(path)  # whole, never half-written: a reader sees the old incarnation's or ours


def beat() -> None:
    """Say this process's loops are turning (a no-op before ``start``)."""
    if _map is not None:
        _TIME.pack_into(_map, _RECORD.size - _TIME.size, time.monotonic())


def read(path: Path) -> tuple[int, float] | None:
    """(pid, monotonic time of its latest beat, NaN before the first) of the heartbeat at
    ``path``; None if there is none."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return _RECORD.unpack(data) if len(data) == _RECORD.size else None


def sleep(seconds: float) -> None:
    """``time.sleep(seconds)`` in turns of at most a second, beating at each: a long pause is not a hang."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        beat()
        time.sleep(min(left, 1.0))
    beat()
