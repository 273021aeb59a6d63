"""The evaluator's results in the run directory: every evaluation a row of eval.csv, the latest
one also in eval.json, which the learner copies into its progress rows. In a two-player game an
evaluation's games against each of ``eval.opponents`` are rows of eval.csv too (before its own).

Only the evaluator writes these files while the run is live, so no two processes append to one
CSV; `rlpipe evaluate` of a run that has ended records its result here too. eval.json is
replaced atomically (write a temporary file, rename it), so a reader sees the previous
result or the new one, never half of one.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.runtime import runfiles
from shared.runtime.files import append_csv, publish, read_csv

MATCH_FIELDS = [f"{outcome}_{seat}" for seat in ("first", "second") for outcome in ("win", "draw", "loss")]
"""A two-player game's evaluation against an opponent: the policy's rate of each outcome in each
seat (eval.json also holds each one's standard error, ``<field>_se``)."""
FIELDS = ["wall_time", "policy_version", "env_steps", "episodes", "mean_return", "std_return", "min_return",
          "max_return", "eval_s", "video", "opponent", *MATCH_FIELDS]
"""Columns of eval.csv: Unix time the evaluation ended, the version and run env steps it
measured, its episodes, their return statistics, the seconds it took, its video (a path
relative to the run directory, ``eval.video``; empty without one) and, for games against an
opponent (`rlpipe evaluate --opponent`, the evaluator's ``eval.opponents``), the opponent and
MATCH_FIELDS (empty otherwise)."""


def video_path(run_dir: Path, policy_version: int) -> Path:
    """Where the evaluator's video of ``policy_version`` goes."""
    return Path(run_dir) / runfiles.VIDEOS / f"eval_v{policy_version}.mp4"
PROGRESS_COLUMNS = {"eval_return": "mean_return", "eval_return_std": "std_return",
                    "eval_policy_version": "policy_version", "eval_env_steps": "env_steps"}
"""progress.csv column -> the latest evaluation's field (empty until the first evaluation)."""


def append(run_dir: Path, row: dict) -> None:
    """Append ``row``'s FIELDS to eval.csv (empty where ``row`` has none)."""
    append_csv(Path(run_dir) / runfiles.EVAL_CSV, FIELDS, {field: row.get(field, "") for field in FIELDS})


def record(run_dir: Path, row: dict) -> None:
    """Append ``row`` to eval.csv and make the whole ``row`` the latest result."""
    append(run_dir, row)
    tmp = Path(run_dir) / (runfiles.EVAL_LATEST + ".tmp")
    tmp.write_text(json.dumps(row))
    publish(tmp, Path(run_dir) / runfiles.EVAL_LATEST)


def latest(run_dir: Path) -> dict | None:
    """The latest evaluation's row, or None before the first one."""
    try:
        return json.loads((Path(run_dir) / runfiles.EVAL_LATEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def progress_columns(run_dir: Path) -> dict:
    """The PROGRESS_COLUMNS of the latest evaluation (empty strings before the first one)."""
    row = latest(run_dir) or {}
    return {column: row.get(field, "") for column, field in PROGRESS_COLUMNS.items()}


def read_rows(run_dir: Path) -> list[dict]:
    """eval.csv's rows as strings (empty before the first evaluation)."""
    return read_csv(Path(run_dir) / runfiles.EVAL_CSV)


def matches(run_dir: Path) -> dict[str, dict]:
    """Each opponent's latest games in eval.csv, in the order the opponents were first met:
    opponent -> its episodes, env steps and MATCH_FIELDS as numbers. eval.json holds only the
    last evaluation, so a run evaluated against two opponents in turn keeps the first one's
    games here alone."""
    games = {}
    for row in read_rows(run_dir):
        if row.get("opponent"):  # eval.csv of runs made before games against opponents has no such column
            games[row["opponent"]] = {"episodes": int(row["episodes"]), "env_steps": int(row["env_steps"]),
                                      **{field: float(row[field]) for field in MATCH_FIELDS}}
    return games
