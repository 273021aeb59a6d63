"""A time limit on env calls (``env.step_timeout_s``): one that runs past it is interrupted.

A group arms one ``ITIMER_REAL`` timer for a whole batch step (``with limit:``: one
``setitimer`` to arm, one to disarm, whatever the number of envs) and makes each env call
through ``limit.call(fn, *args)``, which marks its start (``limit.since``) and, however it
ends, its end. When the timer fires, the SIGALRM handler measures the env call in progress:
past the limit it raises ``StepTimeout`` in it and re-arms, so that a call that swallows the
interruption (``except BaseException``) and hangs on is interrupted again; short of it (the
batch's earlier envs used the time) it re-arms for what is left. A call that swallowed its
interruption and then returned is a timeout all the same (``call`` raises it). So each env
call has the whole limit, and a batch that ends in time costs two system calls and a
function call an env.

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
    """Raised inside an env call that ran past its limit (and by ``StepLimit.call`` for one that
    swallowed it). A BaseException, so that an env's own ``except Exception`` does not swallow it."""


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
        self._interrupted: float | None = None  # ``since`` of the latest call interrupted

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

    def call(self, fn, *args):
        """``fn(*args)``, an env call made inside ``with limit:``, interrupted past the limit:
        StepTimeout, also where ``fn`` swallowed the interruption and returned late."""
        self.since = start = time.monotonic()
        try:
            out = fn(*args)
        finally:  # also where fn raised: a later alarm must not take a finished call for a late one
            self.since = None
        if self._interrupted == start:
            raise StepTimeout
        return out

    def _expire(self) -> None:
        since = self.since
        left = self.limit_s if since is None else self.limit_s - (time.monotonic() - since)
        if left > 0:
            signal.setitimer(signal.ITIMER_REAL, max(left, MIN_REARM_S))
            return
        self._interrupted = since
        # Armed again: the batch's other envs keep theirs, and a call that swallows this one is interrupted anew.
        signal.setitimer(signal.ITIMER_REAL, self.limit_s)
        raise StepTimeout

    def problem(self, call: str) -> str:
        """What an env failure report says of a ``call`` ("step", "reset") that was interrupted."""
        return f"{call} took longer than env.step_timeout_s = {self.limit_s:g} s: interrupted"
