"""What run directories say about their runs: status, result and a summary row each, as a table."""

from __future__ import annotations

import math
from pathlib import Path

from shared.launch import backend
from shared.launch.rundirs import read_progress, read_result
from shared.runtime.runfiles import RUN_CONFIG

COLUMNS = ("run", "status", "reason", "env_steps", "wall_s", "final_return", "steps_to_target", "wall_s_to_target")


def find_runs(root: Path) -> list[Path]:
    """Run directories (holding a resolved config) at or below ``root``, sorted by path."""
    root = Path(root)
    return sorted(p.parent for p in root.rglob(RUN_CONFIG)) if root.is_dir() else []


def status(run_dir: Path) -> str:
    """running (its supervisord is up; a Ray run: a service of it runs on this host), ended
    (the learner wrote its result) or crashed (nothing runs and there is no result: a service
    died, or the run was stopped early). A listing does not ask a cluster about each run."""
    if backend.for_run(run_dir).running_here(run_dir):
        return "running"
    return "ended" if read_result(run_dir) is not None else "crashed"


def summary(run_dir: Path) -> dict:
    """One row of COLUMNS for the run: its result where it has one, else its last progress row.
    The ``*_to_target`` fields are filled only for runs that ended at their target."""
    run_dir = Path(run_dir)
    result = read_result(run_dir)
    rows = read_progress(run_dir)
    last = rows[-1] if rows else {}
    row = {"run": run_dir.name, "status": status(run_dir), "reason": "", "steps_to_target": "",
           "wall_s_to_target": "", "env_steps": last.get("env_steps", ""), "wall_s": last.get("wall_s", ""),
           "final_return": last.get("mean_return", "")}
    if result is not None:
        row.update(reason=result["reason"], env_steps=result["env_steps"], wall_s=result["wall_s"],
                   final_return=round(result["mean_return"], 1) if math.isfinite(result["mean_return"]) else "nan")
        if result["reason"] == "target":
            row.update(steps_to_target=result["env_steps"], wall_s_to_target=result["wall_s"])
    return row


def markdown_table(rows: list[dict], columns) -> str:
    """``rows`` as a markdown table of ``columns`` (missing values blank)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
