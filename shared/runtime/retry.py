"""One retry loop's pauses and its bound, shared by every loop that retries a peer or a step.

A failure that comes at once (a refusal, an env that raises) retried at once is a spin, and
a retry without an end hides the cause for good. ``Backoff`` gives the pause before the
n-th try in a row (``base_s`` doubling, at most ``cap_s``) and says when the loop has tried
long enough (``give_up_s`` since the first failure, or ``max_failures`` in a row); the
caller then raises its own error, naming the peer and the last reason, and its supervisor
(supervisord, a Ray actor) restarts it.
"""

from __future__ import annotations

import math
import time


class Backoff:
    def __init__(self, base_s: float, cap_s: float, give_up_s: float = math.inf, max_failures: int | None = None):
        self.base_s, self.cap_s, self.give_up_s, self.max_failures = base_s, cap_s, give_up_s, max_failures
        self.reset()

    def reset(self) -> None:
        """A success: the next failure is the first again."""
        self.failures, self.t0 = 0, time.monotonic()

    def fail(self) -> float:
        """Count one failure; the seconds to wait before the next try."""
        self.failures += 1
        return min(self.base_s * 2 ** (self.failures - 1), self.cap_s)

    @property
    def elapsed_s(self) -> float:
        """Seconds since the last success (or the start)."""
        return time.monotonic() - self.t0

    def spent(self) -> bool:
        """Whether the loop has tried long enough: give up now, with a clear error."""
        return self.elapsed_s >= self.give_up_s or (self.max_failures is not None and self.failures >= self.max_failures)


def worth_logging(count: int) -> bool:
    """True for the 1st, 2nd, 4th, 8th... occurrence: a log of a repeated failure that cannot flood."""
    return count > 0 and count & (count - 1) == 0
