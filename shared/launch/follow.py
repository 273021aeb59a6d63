"""Following a started run: its build, its crash loops, its progress rows, its result.
"""

from __future__ import annotations

import math
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Callable

from shared.runtime.runfiles import ACTING_FILE, LOGS_DIR, SUPERVISORD_LOG
from shared.runtime.process import CONFIG_ERROR
from shared.launch.rundirs import read_progress, read_result
from shared.launch import backend


BUILD_TIMEOUT_S = 120.0  # a learner this slow to build its agent is left to `follow` and `status`


def wait_until_built(run_dir: Path, timeout_s: float = BUILD_TIMEOUT_S) -> str | None:
    """Wait for the learner to have built the agent (its ``acting.json``): None; or the one
    line of a service's config error (a model that cannot exist for the env: the learner,
    and action-servers, exit 2 with it). Raises ServiceCrashLoop when services keep dying at
    start-up for another reason (the caller stops the run).

    The launcher does not build the agent itself: its torch import would take the CPU the
    learner's needs at the same moment, and the first env step would wait for both.
    """
    deadline, watch = time.monotonic() + timeout_s, CrashWatch(run_dir)
    while time.monotonic() < deadline and not (run_dir / ACTING_FILE).exists():
        error = _config_error(run_dir)
        if error is not None:
            return error
        try:
            watch.check()
        except ServiceCrashLoop:
            error = _config_error(run_dir)  # its line may have reached the log after the exit
            if error is None:
                raise
            return error
        time.sleep(0.05)
    return None


def _config_error(run_dir: Path) -> str | None:
    """The config error a service of the run logged before it exited (``runtime.serve``), if any."""
    for log in sorted((run_dir / LOGS_DIR).glob("*.log")):
        try:
            lines = log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            if line.startswith(CONFIG_ERROR):
                return line[len(CONFIG_ERROR):]
    return None


class ServiceCrashLoop(RuntimeError):
    """Services of the run die again and again right after they start."""

    def __init__(self, process: str, log_path: str, crashes: int):
        super().__init__(f"{process} exited with an error within {CRASH_WINDOW_S:.0f} s of starting "
                         f"({crashes} such exits in this run)")
        self.process, self.log_path = process, log_path

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(cannot read {self.log_path}: {e.strerror})"


CRASH_WINDOW_S = 20.0  # a process that dies this soon after it started has crashed at start-up


CRASHES_TO_FAIL = 2  # quick crashes, of any processes of the run: a one-off may be a transient


class CrashWatch:
    """Counts quick deaths of the run's processes from supervisord's own log, which records
    every spawn and every exit with its status (a process restarted at once leaves no trace of
    its exit status in the process table). ``check()`` raises ServiceCrashLoop at the
    CRASHES_TO_FAIL-th exit with an error status within CRASH_WINDOW_S of that process's
    spawn, or when supervisord gave up on a process (FATAL). A death by a signal counts as an
    error exit (SIGBUS from a full /dev/shm, SIGSEGV, SIGABRT...), except SIGKILL, SIGTERM and
    SIGINT: someone's ``kill -9`` or stop, which supervisord restarts from and which do not count."""

    _LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ (?:spawned: '(?P<spawned>[^']+)' with pid"
                       r"|exited: (?P<exited>\S+) \((?:exit status (?P<status>\d+)|terminated by (?P<signal>SIG[A-Z0-9]+))"
                       r"|gave up: (?P<fatal>\S+) entered FATAL)")
    _NOT_CRASHES = ("SIGKILL", "SIGTERM", "SIGINT")

    def __init__(self, run_dir: Path):
        self.log, self.logs = run_dir / LOGS_DIR / SUPERVISORD_LOG, run_dir / LOGS_DIR
        self.offset = 0
        self.spawned: dict[str, datetime] = {}
        self.crashes = 0

    def check(self) -> None:
        try:
            with self.log.open("rb") as f:
                f.seek(self.offset)
                text = f.read()
        except FileNotFoundError:
            return
        text = text[:text.rfind(b"\n") + 1]  # whole lines only; the rest is read next time
        self.offset += len(text)
        for line in text.decode(errors="replace").splitlines():
            m = self._LINE.match(line)
            if m is None:
                continue
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
            if m.group("spawned"):
                self.spawned[m.group("spawned")] = at
            elif m.group("fatal"):
                raise ServiceCrashLoop(m.group("fatal"), str(self.logs / f"{m.group('fatal')}.log"), self.crashes)
            elif (m.group("signal") not in self._NOT_CRASHES) if m.group("signal") else int(m.group("status")) != 0:
                name = m.group("exited")
                self.crashes += (at - self.spawned.get(name, at)).total_seconds() < CRASH_WINDOW_S
                if self.crashes >= CRASHES_TO_FAIL:
                    raise ServiceCrashLoop(name, str(self.logs / f"{name}.log"), self.crashes)


def format_row(row: dict) -> str:
    """One progress row as ``rlpipe launch`` and serial mode show it."""
    line = (f"[{float(row['wall_s']):7.1f}s] steps {int(row['env_steps']):>8} "
            f"({float(row['env_steps_per_s']):>7.0f}/s)  updates {int(row['updates']):>5}  "
            f"return {float(row['mean_return']):8.1f}  episodes {int(row['episodes']):>5}  "
            f"lag {float(row['policy_lag']):.2f}")
    if row.get("eval_return"):  # the evaluator's latest return, once there is one
        line += f"  eval {float(row['eval_return']):.1f} (v{row['eval_policy_version']})"
    if int(row.get("skipped_updates") or 0):  # updates that learned nothing (a non-finite loss)
        line += f"  skipped {row['skipped_updates']}"
    if row.get("pool_elo"):  # against a self-play pool: the learner's Elo, and the best version's once it has one
        line += f"  elo {float(row['pool_elo']):.0f}"
        if math.isfinite(float(row.get("pool_best_elo") or "nan")):
            line += f" (best v{row['pool_best_version']} {float(row['pool_best_elo']):.0f})"
    eta = float(row.get("eta_s") or "nan")  # rows of runs made before the ETA have none
    if math.isfinite(eta):
        line += f"  eta {duration(eta)}"
    return line


def duration(seconds: float) -> str:
    """``seconds`` for a person: 42s, 3m05s, 2h07m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class StopFollowing(Exception):
    """Raised by a ``follow`` caller's ``on_row`` to end the run early (``rlpipe tune`` prunes a
    trial); ``str()`` is the reason. ``follow`` lets it through: the caller stops the run."""


def follow(run_dir: Path, max_wall_s: float, out=sys.stdout,
           on_row: Callable[[dict], None] | None = None) -> dict | None:
    """Print progress rows as the learner writes them, handing each to ``on_row`` too (a dict
    of strings, as ``read_progress``); return the result when the run ends, None when its
    supervisor is gone (stopped, or killed: the caller's ``stop`` then ends the services it
    left, which would otherwise run on, and a ``launch --resume`` beside them).

    Raises ServiceCrashLoop when a service keeps dying at start-up, and lets ``on_row``'s
    StopFollowing through (either way the caller stops the run).
    """
    shown = 0
    deadline = time.monotonic() + max_wall_s + 60
    watch = CrashWatch(run_dir)
    while time.monotonic() < deadline:
        result = read_result(run_dir)  # before the rows: every row the learner wrote before its result is seen
        rows = read_progress(run_dir)
        for row in rows[shown:]:
            print(format_row(row), file=out, flush=True)
            if on_row is not None:
                on_row(row)
        shown = len(rows)
        if result is not None:
            return result
        runner = backend.for_run(run_dir)
        if not runner.supervised(run_dir):
            print("the run's supervisor is gone (killed?) with its services still running: stopping them"
                  if runner.running(run_dir) else "the run's processes are gone (stopped, or they saw their supervisor die)",
                  file=out, flush=True)
            return None
        watch.check()
        time.sleep(0.5)
    print(f"the run did not end within {max_wall_s + 60:.0f} s", file=out, flush=True)
    return None
