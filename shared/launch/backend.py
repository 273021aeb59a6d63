"""What runs a run's services: the Backend interface, and the one place that picks a run's.

Two backends implement it, each a module whose functions are the interface (a module
satisfies a Protocol by its attributes, PEP 544): ``supervisor`` (supervisord on this host)
and ``ray_backend`` (detached Ray actors on a cluster). A caller asks ``for_run(run_dir)``
and calls the answer; neither backend knows the other. What is the same for both lives
beside them instead: ``rlpipe logs`` reads ``<run>/logs/<process>.log``, which supervisord
and the Ray actors write alike (a cluster run's directory is reachable from every node), and
``clean`` below is one backend's ``stop`` followed by the same clean-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from shared.config.schema import Experiment
from shared.launch import ray_backend, supervisor
from shared.launch.supervisor import ScaleError  # what either backend's scale raises

__all__ = ["Backend", "ScaleError", "clean", "for_run"]


class Backend(Protocol):
    """The life of a run's service processes, whatever starts and supervises them."""

    def start(self, exp: Experiment, run_dir: Path) -> None:
        """Start every service instance of the run (``rundirs.programs``); return once all are up."""

    def running(self, run_dir: Path) -> bool:
        """Whether any process of the run is still there (a cluster run asks its cluster)."""

    def supervised(self, run_dir: Path) -> bool:
        """Whether what keeps the run's services going is there (supervisord; a cluster run: its
        actors, whose services end with them). False with ``running`` True: services left
        without their supervisor (it was killed), which ``stop`` ends."""

    def running_here(self, run_dir: Path) -> bool:
        """``running`` as far as this host can tell without asking a cluster (``rlpipe ls``)."""

    def status(self, run_dir: Path) -> int:
        """Print one line a service process of a running run; the exit status of ``rlpipe status``."""

    def stop(self, run_dir: Path, timeout_s: float = 60.0) -> bool:
        """SIGTERM every service and wait up to ``timeout_s`` s for their clean exits; True
        once no process of the run is left."""

    def scale(self, run_dir: Path, counts: dict[str, int]) -> tuple[list[str], list[str], list[str]]:
        """Change service counts of a live run, e.g. ``{"sampler": 4}``: (processes added,
        removed, restarted); ScaleError, one line naming why, where it cannot."""


def for_run(run_dir: Path) -> Backend:
    """The backend that runs (or ran) the run in ``run_dir``: Ray when the run directory
    records a cluster (``cluster.json``), supervisord otherwise."""
    return ray_backend if ray_backend.is_cluster_run(run_dir) else supervisor


def clean(run_dir: Path) -> tuple[list[int], list[str]]:
    """Stop what still runs of the run (its backend's ``stop``), SIGKILL what will not stop,
    remove its socket directory and shared-memory segments: (pids killed, segments removed)."""
    for_run(run_dir).stop(run_dir, timeout_s=20)
    return supervisor.remove_leftovers(run_dir)
