"""The run's watchdog: kills a service that is alive but hung, so that supervisord restarts it.

supervisord restarts a service that dies, not one that hangs (an env that never returns from
``step()``, a deadlocked C extension, a stopped process). Every service's loops beat its
heartbeat (``shared.runtime.heartbeat``). The watchdog is a supervisord event listener
(``[eventlistener:watchdog]`` in the run's supervisord.conf, written when ``run.watchdog_s`` > 0),
so it watches detached runs too: at each TICK_5 event (every 5 s) it asks supervisord for its
running processes, reads each one's heartbeat and sends SIGKILL to every one that ``overdue``
finds silent past its limit. supervisord restarts it; CrashWatch does not count a SIGKILL as a
crash. Each kill is logged (logs/watchdog.log: the process, its pid, how long it was silent)
and counted (``rlpipe_watchdog_kills_total{process=...}``).

    python -m shared.launch.watchdog --run-dir RUN    (started by supervisord)
"""

from __future__ import annotations

import argparse
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
from shared.runtime import heartbeat, metrics
from shared.runtime.process import RUN_CONFIG, install_signal_handlers, setup_logging

log = logging.getLogger("shared.launch.watchdog")


def overdue(now: float, pid: int, beat: tuple[int, float] | None, seen_at: float, deadline_s: float,
            startup_s: float) -> tuple[float, float] | None:
    """(seconds process ``pid`` has been silent, its limit) if that is past the limit, else None.

    ``beat``: its heartbeat file's (pid, time of the latest beat: NaN before the first), None
    without a file; ``seen_at``: when the watchdog first saw ``pid`` running. A process with a
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

    def check(self, processes: list[dict], now: float) -> list[tuple[str, int, float]]:
        """Kill each running process of ``processes`` (supervisord's ``getAllProcessInfo``) that is
        overdue, but this one; (name, pid, seconds silent) of each killed."""
        running = {p["pid"]: p["name"] for p in processes
                   if p["statename"] == "RUNNING" and p["pid"] > 0 and p["pid"] != os.getpid()}
        self.seen = {pid: self.seen.get(pid, now) for pid in running}
        killed = []
        for pid, name in running.items():
            kills = self.kills.labels(process=name)  # a series at 0 from the first check: "no kills", not "no data"
            late = overdue(now, pid, heartbeat.read(self.heartbeats / name), self.seen[pid], self.deadline_s,
                           self.startup_s)
            if late is None:
                continue
            silent, limit = late
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # it ended meanwhile
            log.error("%s (pid %d): no heartbeat for %.1f s (limit %g s): killed (SIGKILL); supervisord restarts it",
                      name, pid, silent, limit)
            kills.inc()
            killed.append((name, pid, silent))
        return killed


def main(argv=None) -> None:
    """supervisord's event listener protocol on stdin/stdout: a check at each event (TICK_5)."""
    p = argparse.ArgumentParser(prog="python -m shared.launch.watchdog", description="rlpipe's hung-service watchdog")
    p.add_argument("--run-dir", required=True, help="the run directory made by `rlpipe launch`")
    run_dir = Path(p.parse_args(argv).run_dir)
    setup_logging("watchdog")  # stderr: stdout is the protocol
    install_signal_handlers()
    exp = loading.load(run_dir / RUN_CONFIG)
    dog = Watchdog(socket_dir(run_dir) / heartbeat.DIR, exp.run.watchdog_s, exp.run.watchdog_startup_s,
                   metrics.for_service("watchdog", 0).kills)
    server = supervisor.rpc(run_dir).supervisor
    log.info("watchdog: services silent for %g s (%g s at start-up) are killed", exp.run.watchdog_s,
             exp.run.watchdog_startup_s)
    while True:
        childutils.listener.ready(sys.stdout)
        line = sys.stdin.readline()
        if not line:
            return  # supervisord is gone
        sys.stdin.read(int(childutils.get_headers(line)["len"]))
        try:
            dog.check(server.getAllProcessInfo(), time.monotonic())
        except (OSError, xmlrpc.client.Error) as e:
            log.warning("supervisord did not answer (%s); checking at the next tick", e)
        childutils.listener.ok(sys.stdout)


if __name__ == "__main__":
    main()
