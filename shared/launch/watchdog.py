"""The run's watchdog: kills a service that is alive but hung, so that supervisord restarts it,
and stops the run when one keeps hanging.

supervisord restarts a service that dies, not one that hangs (an env that never returns from
``step()``, a deadlocked C extension, a stopped process). Every service's loops beat its
heartbeat (``shared.runtime.heartbeat``), at the grain of their progress (a sampler's every
step, a snapshot's every chunk). The watchdog is a supervisord event listener
(``[eventlistener:watchdog]`` in the run's supervisord.conf, written when ``run.watchdog_s`` > 0),
so it watches detached runs too: at each TICK_5 event (every 5 s) it asks supervisord for its
running processes, reads each one's heartbeat and sends SIGKILL to the process group of every
one that ``overdue`` finds silent past its limit (with the processes it started: an env's
simulator is not orphaned). supervisord restarts it. Each kill is logged (logs/watchdog.log: the
process, its pid, how long it was silent, its last phase) and counted
(``rlpipe_watchdog_kills_total{process=...}``). A service killed KILLS_TO_FAIL times in a row
(no life between the kills that beat for a whole ``watchdog_s``) is a crash loop, as the crash
watch (``follow.CrashWatch``) finds for exits: the watchdog writes the run's result.json (reason
"watchdog", ``error``: one line naming the service, its last phase and the deadline) and stops
the run; `rlpipe launch` and `rlpipe status` show that line.

Its stdout is supervisord's event-listener protocol: before anything else (the run's config
imports the user's env, algorithm and encoder modules, which may print) the watchdog keeps a
private copy of it and points its file descriptor 1 at stderr (its log).

    python -m shared.launch.watchdog --run-dir RUN    (started by supervisord)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time
import xmlrpc.client
from pathlib import Path

from supervisor import childutils

from shared.config import loading
from shared.config.endpoints import socket_dir
from shared.launch import supervisor
from shared.launch.rundirs import read_progress
from shared.runtime import heartbeat, metrics
from shared.runtime.files import publish
from shared.runtime.process import install_signal_handlers, run_id_of, setup_logging
from shared.runtime.runfiles import RESULT, RUN_CONFIG
from shared.transport import shm

log = logging.getLogger("shared.launch.watchdog")

KILLS_TO_FAIL = 3
"""Kills in a row of one service that stop the run: one may be a stopped process (SIGSTOP), two
a slow machine; a third hang at once after a restart will not go away by restarting."""



class HungService(Exception):
    """A service the watchdog killed KILLS_TO_FAIL times in a row; ``str()`` is the line that says so."""

    def __init__(self, process: str, line: str):
        super().__init__(line)
        self.process = process


def overdue(now: float, pid: int, beat: heartbeat.Beat | None, seen_at: float, deadline_s: float,
            startup_s: float) -> tuple[float, float] | None:
    """(seconds process ``pid`` has been silent, its limit) if that is past the limit, else None.

    ``beat``: its heartbeat file's (pid, time of the latest beat: NaN before the first, ...),
    None without a file; ``seen_at``: when the watchdog first saw ``pid`` running. A process with a
    beat of its own is silent since that beat, limit ``deadline_s``; one still starting (no
    file, a previous incarnation's, or no beat yet) since ``seen_at``, limit ``startup_s``.
    All times are ``time.monotonic()`` seconds.
    """
    if beat is not None and beat[0] == pid and not math.isnan(beat[1]):
        silent, limit = now - beat[1], deadline_s
    else:
        silent, limit = now - seen_at, startup_s
    return (silent, limit) if silent > limit else None


class Watchdog:
    """Watches the processes supervisord runs; ``check`` kills the overdue ones."""

    def __init__(self, heartbeats: Path, deadline_s: float, startup_s: float, kills):
        self.heartbeats, self.deadline_s, self.startup_s, self.kills = heartbeats, deadline_s, startup_s, kills
        self.seen: dict[int, float] = {}  # pid -> when first seen running
        self.in_a_row: dict[str, int] = {}  # process name -> kills since its last life that beat for deadline_s

    def check(self, processes: list[dict], now: float) -> list[tuple[str, int, float]]:
        """Kill (its process group) each running process of ``processes`` (supervisord's
        ``getAllProcessInfo``) that is overdue, but this one; (name, pid, seconds silent) of each
        killed. HungService once a process name is killed KILLS_TO_FAIL times in a row."""
        running = {p["pid"]: p["name"] for p in processes
                   if p["statename"] == "RUNNING" and p["pid"] > 0 and p["pid"] != os.getpid()}
        self.seen = {pid: self.seen.get(pid, now) for pid in running}
        killed = []
        for pid, name in running.items():
            kills = self.kills.labels(process=name)  # a series at 0 from the first check: "no kills", not "no data"
            beat = heartbeat.read(self.heartbeats / name)
            mine = beat is not None and beat.pid == pid
            late = overdue(now, pid, beat, self.seen[pid], self.deadline_s, self.startup_s)
            if late is None:
                if mine and beat.time - self.seen[pid] >= self.deadline_s:
                    self.in_a_row.pop(name, None)  # a life that made progress for a whole deadline
                continue
            silent, limit = late
            if not kill_group(pid):
                continue  # it ended meanwhile
            phase = beat.phase if mine else "starting"
            log.error("%s (pid %d): no heartbeat for %.1f s (limit %g s) while %s: killed (SIGKILL, its process "
                      "group); supervisord restarts it", name, pid, silent, limit, phase)
            kills.inc()
            killed.append((name, pid, silent))
            self.in_a_row[name] = self.in_a_row.get(name, 0) + 1
            if self.in_a_row[name] >= KILLS_TO_FAIL:
                raise HungService(name, f"{name} hung {self.in_a_row[name]} times in a row (killed by the watchdog each "
                                  f"time: no heartbeat for {silent:.1f} s, limit {limit:g} s, while {phase}); run "
                                  f"stopped. Its log: logs/{name}.log")
        return killed


def kill_group(pid: int) -> bool:
    """SIGKILL to ``pid``'s process group (supervisord makes each service a group leader), or to
    ``pid`` alone if it leads none; False if it is gone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def stop_run(run_dir: Path, server, hung: HungService) -> None:
    """End the run for ``hung``: result.json first (reason "watchdog", ``error``: its line; the
    counts of the last progress row), then every process of the run, then every segment the run
    still has (what the hung process's last incarnation left, and any of a process that missed
    its SIGTERM), supervisord last."""
    why = str(hung)
    rows = read_progress(run_dir)
    last = rows[-1] if rows else {}
    result = {"reason": "watchdog", "error": why, "env_steps": int(last.get("env_steps") or 0),
              "updates": int(last.get("updates") or 0), "mean_return": float(last.get("mean_return") or "nan"),
              "episodes": int(last.get("episodes") or 0), "wall_s": float(last.get("wall_s") or 0.0)}
    tmp = run_dir / (RESULT + ".watchdog.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    publish(tmp, run_dir / RESULT)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # supervisord's SIGTERM to this listener comes
        signal.signal(sig, signal.SIG_IGN)  # with stopAllProcesses: it must not cut off the shutdown that follows
    stop_all(server)
    shm.clean(run_id_of(run_dir))
    server.shutdown()


STOPPED = ("STOPPED", "EXITED", "FATAL")


def stop_all(server) -> None:
    """Stop every process but this listener and return once none is left (SIGKILL comes after
    ``supervisor.STOPWAIT_S``), within ``WATCHDOG_STOPWAIT_S``. The hung process's restart may be
    spawned as the stop comes: one that exited just before it is respawned after it (stopped
    again here), and a SIGTERM between supervisord's fork and exec is lost (that one lives until
    its SIGKILL), so a state is final only when it holds over two looks a restart's delay apart."""
    deadline = time.monotonic() + supervisor.WATCHDOG_STOPWAIT_S - 2
    quiet = 0
    while time.monotonic() < deadline and quiet < 2:
        others = [p for p in server.getAllProcessInfo() if p["pid"] != os.getpid()]
        if any(p["statename"] in ("STARTING", "RUNNING", "BACKOFF") for p in others):
            server.stopAllProcesses(False)
        quiet = quiet + 1 if all(p["statename"] in STOPPED for p in others) else 0
        time.sleep(1.2)  # supervisord respawns an exited service within a second (its loop's tick)


def main(argv=None) -> None:
    """supervisord's event listener protocol on stdin/stdout: a check at each event (TICK_5)."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # whatever prints from here (a user's module) goes to the log
    p = argparse.ArgumentParser(prog="python -m shared.launch.watchdog", description="rlpipe's hung-service watchdog")
    p.add_argument("--run-dir", required=True, help="the run directory made by `rlpipe launch`")
    run_dir = Path(p.parse_args(argv).run_dir)
    setup_logging("watchdog")  # stderr: the protocol has its own descriptor
    install_signal_handlers()
    exp = loading.load(run_dir / RUN_CONFIG, check_env=False)  # checked at launch; the watchdog steps no env
    dog = Watchdog(socket_dir(run_dir) / heartbeat.DIR, exp.run.watchdog_s, exp.run.watchdog_startup_s,
                   metrics.for_service("watchdog", 0).kills)
    server = supervisor.rpc(run_dir).supervisor
    log.info("watchdog: services silent for %g s (%g s at start-up) are killed; %d kills in a row stop the run",
             exp.run.watchdog_s, exp.run.watchdog_startup_s, KILLS_TO_FAIL)
    while True:
        childutils.listener.ready(protocol)
        line = sys.stdin.readline()
        if not line:
            return  # supervisord is gone
        sys.stdin.read(int(childutils.get_headers(line)["len"]))
        try:
            dog.check(server.getAllProcessInfo(), time.monotonic())
        except (OSError, xmlrpc.client.Error) as e:
            log.warning("supervisord did not answer (%s); checking at the next tick", e)
        except HungService as e:
            log.error("%s", e)
            childutils.listener.ok(protocol)
            stop_run(run_dir, server, e)
            return
        childutils.listener.ok(protocol)


if __name__ == "__main__":
    main()
