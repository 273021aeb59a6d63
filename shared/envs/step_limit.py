"""A time limit on env calls (``env.step_timeout_s``): one that runs past it is interrupted.

A group arms one ``ITIMER_REAL`` timer for a whole batch step (``with limit:``: one
``setitimer`` to arm, one to disarm, whatever the number of envs) and marks each env call it
makes (``limit.since = time.monotonic()`` before, ``None`` after). When the timer fires, the
SIGALRM handler measures the env call in progress: past the limit it raises ``StepTimeout``
in it (and re-arms for the rest of the batch); short of it (the batch's earlier envs used the
time) it re-arms for what is left. So each env call has the whole limit, and a batch that
ends in time costs two system calls and two stores an env.

What it cannot interrupt: Python runs a signal handler between bytecodes of the main thread,
so a C extension that holds the GIL and never returns (a deadlocked emulator) is not
interrupted, nor is an env stepped outside the main thread (the limit is then off, with one
warning). There the run's watchdog (``run.watchdog_s``, ``shared.launch.watchdog``) is the
backstop: it kills the sampler whose heartbeat stops, and supervisord restarts it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

log = logging.getLogger(__name__)

MIN_REARM_S = 1e-3  # setitimer(0) would disarm: a re-arm is never shorter than this


class StepTimeout(BaseException):
    """Raised inside an env call that ran past its limit. A BaseException, so that an env's own
    ``except Exception`` does not swallow it."""


_active: "StepLimit | None" = None  # the limit whose batch is in progress (one at a time: one main thread)
_installed: bool | None = None  # None: not tried yet; False: cannot (not the main thread)


def _on_alarm(signum, frame) -> None:
    limit = _active
    if limit is not None:
        limit._expire()


def _install() -> bool:
    global _installed
    if _installed is None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGALRM, _on_alarm)
            _installed = True
        else:
            log.warning("env.step_timeout_s is off here: envs are stepped outside the main thread, where no "
                        "signal can interrupt them (the watchdog, run.watchdog_s, is the backstop)")
            _installed = False
    return _installed


class StepLimit:
    """``limit_s`` seconds for each env call made inside ``with limit:`` (a batch step, a reset)."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.since: float | None = None
        """``time.monotonic()`` when the env call in progress began; None between calls."""

    def __enter__(self) -> "StepLimit":
        global _active
        self.since = None
        if _install():
            _active = self
            signal.setitimer(signal.ITIMER_REAL, self.limit_s)
        return self

    def __exit__(self, *exc) -> None:
        global _active
        if _active is self:
            signal.setitimer(signal.ITIMER_REAL, 0)
            _active = None
        self.since = None

    def _expire(self) -> None:
        since = self.since
        left = self.limit_s if since is None else self.limit_s - (time.monotonic() - since)
        if left > 0:
            signal.setitimer(signal.ITIMER_REAL, max(left, MIN_REARM_S))
            return
        self.since = None
        signal.setitimer(signal.ITIMER_REAL, self.limit_s)  # the batch's other envs keep theirs
        raise StepTimeout

    def problem(self, call: str) -> str:
        """What an env failure report says of a ``call`` ("step", "reset") that was interrupted."""
        return f"{call} took longer than env.step_timeout_s = {self.limit_s:g} s: interrupted"
