"""A grid's record of itself (``grid.json`` in its directory): what it runs (config, overrides,
variants, seeds, runs at a time, the command that made it) and which run directory each
``(variant, seed)`` job got, so that ``rlpipe grid --resume DIR`` needs nothing else and
``rlpipe results`` can name the command that reproduces a row.

The file is private (0600, as a run directory's files) and replaced whole on every change
(written beside it, fsynced, renamed): a launcher killed at any moment leaves the previous
record or the new one. A job's run directory is recorded before its services start, so no
run of the grid runs unrecorded.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import threading
from pathlib import Path

from shared.config.schema import ConfigError
from shared.runtime.files import publish

GRID_FILE = "grid.json"


class NotAGrid(ConfigError):
    """``grid --resume DIR`` of a directory without a readable grid record (one line)."""


def grid_command() -> str:
    """How this process was started, as a user would type it (``rlpipe grid ...``)."""
    if Path(sys.argv[0]).name in ("rlpipe", "cli.py"):
        return shlex.join(["rlpipe", *sys.argv[1:]])
    return shlex.join(sys.argv)


class GridFile:
    """The record of the grid in ``directory``; ``runs`` maps ``(variant label, seed)`` to a
    run directory's name. Threads of one launcher share it (``record_run`` holds a lock)."""

    def __init__(self, directory: Path, plan: dict):
        self.dir, self.plan = Path(directory), plan
        self.lock = threading.Lock()

    @classmethod
    def create(cls, directory: Path, config: str, overrides: list[str], variants: list[dict], seeds: list[int],
               parallel: int) -> "GridFile":
        """Write a new grid's record. ``variants``: ``{"label", "overrides"}`` each; ``config`` is
        kept as an absolute path (a resume may run from another working directory)."""
        plan = {"config": str(Path(config).resolve()), "overrides": list(overrides), "variants": variants,
                "seeds": list(seeds), "parallel": parallel, "command": grid_command(), "runs": []}
        record = cls(directory, plan)
        record._write()
        return record

    @classmethod
    def load(cls, directory: Path) -> "GridFile":
        """The record of the grid in ``directory``; NotAGrid (one line) if it has none."""
        path = Path(directory) / GRID_FILE
        try:
            plan = json.loads(path.read_text())
        except FileNotFoundError:
            raise NotAGrid(f"{directory}: not a grid directory (no {GRID_FILE}; `rlpipe grid CONFIG ...` makes one, "
                           "and --resume takes its directory)") from None
        except (OSError, json.JSONDecodeError) as e:
            raise NotAGrid(f"{path}: unreadable grid record ({type(e).__name__}: {e})") from None
        missing = [k for k in ("config", "overrides", "variants", "seeds", "parallel", "runs") if k not in plan]
        if missing:
            raise NotAGrid(f"{path}: grid record without {', '.join(missing)}")
        return cls(directory, plan)

    @property
    def runs(self) -> dict[tuple[str, int], str]:
        with self.lock:
            return {(r["variant"], r["seed"]): r["run"] for r in self.plan["runs"]}

    def record_run(self, variant: str, seed: int, run_name: str) -> None:
        """Record that job ``(variant, seed)`` runs in ``run_name`` (replacing an earlier entry)."""
        with self.lock:
            self.plan["runs"] = [r for r in self.plan["runs"] if (r["variant"], r["seed"]) != (variant, seed)]
            self.plan["runs"].append({"variant": variant, "seed": seed, "run": run_name})
            self._write()

    def _write(self) -> None:
        tmp = self.dir / (GRID_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.plan, indent=1) + "\n")
        publish(tmp, self.dir / GRID_FILE)
