"""Before a launch starts anything: do /dev/shm and the run directory's disk hold what the run needs?

The needs come from the services' own layouts (``services.footprint``); the free space from
statvfs. A run that does not fit fails here, within seconds, with one line naming the
shortfall, instead of a service's NoSpace at start-up (or, before segments were allocated
when made, a SIGBUS hours into the run).
"""

from __future__ import annotations

import os
from pathlib import Path

from shared.config.schema import Experiment
from shared.launch.rundirs import programs
from shared.transport import shm


class NoRoom(RuntimeError):
    """The run does not fit; str() is one line naming the place, the need and the room."""


def check(exp: Experiment, runs_dir: Path, run_id: str | None = None) -> None:
    """NoRoom unless /dev/shm and the file system of ``runs_dir`` hold ``exp``'s run.
    ``run_id``: a run resumed, whose segments still in /dev/shm count as room."""
    from services.footprint import needs, pages

    processes = sum(count for _, count, _, _ in programs(exp)) + (1 if exp.run.watchdog_s else 0)
    need = needs(exp, processes)
    held = sum(pages(p.stat().st_size) for p in shm.run_segments(run_id)) if run_id else 0
    _fits(shm.SHM_DIR, need.shm, held, "give the machine or container a larger /dev/shm (docker run --shm-size), "
          "free it (`rlpipe clean` of old runs), or make the run smaller (replay.capacity, sampler.ring)")
    root = Path(runs_dir)
    while not root.exists():  # made by the launch: its nearest existing parent's file system
        root = root.parent
    _fits(root, need.run_dir, 0, "free disk space, or set run.runs_dir to a larger disk")


def _fits(where: Path, need: dict[str, int], held: int, fix: str) -> None:
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize + held
    total = sum(need.values())
    if total > free:
        parts = ", ".join(f"{what} {n / 2**20:,.1f}" for what, n in need.items())
        raise NoRoom(f"{where} has {free / 2**20:,.1f} MiB free, the run needs {total / 2**20:,.1f} MiB "
                     f"({parts}): {fix}")
