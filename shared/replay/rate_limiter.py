"""Rate limiter: keeps samples per insert inside a band (Reverb's SampleToInsertRatio).

Counters are in items: one transition, one segment, whatever the table's item is.

Invariant (with s = samples_per_insert, offset = s * min_size_to_sample,
min_diff = offset - error_buffer, max_diff = offset + error_buffer)::

    error = inserts * s - samples
    a sample of n is allowed   iff  size >= min_size_to_sample  and  error - n >= min_diff
    an insert of k is allowed  iff  size < min_size_to_sample  or  error + k * s <= max_diff

so error >= min_diff after every sample, and error <= max_diff after every insert made
while the table holds min_size_to_sample items or more. Inserts are free below that size
(Reverb frees them only while size + k <= min_size_to_sample, which deadlocks when one
insert carries many items, as our segments do); the insert that reaches the size can
overshoot max_diff by at most (k - 1) * s, which samples then work off. In a table that
never shrinks below min_size_to_sample, error stays in [min_diff, max_diff] from the
first time it is back under max_diff, i.e. samples / inserts stays within
s +- error_buffer / inserts. The band must be wide enough for one insert and one sample to
fit (``check_no_deadlock``), or both sides can block each other forever.

``samples_per_insert=None`` is unthrottled: inserts are always allowed, samples once the
table holds ``min_size_to_sample`` items.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from shared.replay.arena import HEAP, Arena, Cells


@dataclass(frozen=True)
class RateLimiterConfig:
    samples_per_insert: Optional[float] = None
    """Target items sampled per item inserted (replay ratio); None = unthrottled."""
    min_size_to_sample: int = 1
    """Items the table must hold before the first sample is allowed."""
    error_buffer: float = 1000.0
    """Half-width of the allowed band of error = inserts * samples_per_insert - samples, in items."""


class RateLimiter:
    """Gate inserts and samples of one table; the table reports what actually happened."""

    def __init__(self, config: RateLimiterConfig = RateLimiterConfig(), arena: Arena = HEAP):
        """``arena``: where the counters live (they persist with the table's state)."""
        spi = config.samples_per_insert
        if spi is not None and spi <= 0:
            raise ValueError(f"RateLimiterConfig.samples_per_insert must be > 0 or None, got {spi}")
        if config.min_size_to_sample < 1:
            raise ValueError(
                f"RateLimiterConfig.min_size_to_sample must be >= 1, got {config.min_size_to_sample}"
            )
        if config.error_buffer < 0:
            raise ValueError(f"RateLimiterConfig.error_buffer must be >= 0, got {config.error_buffer}")
        self.config = config
        offset = (spi or 0.0) * config.min_size_to_sample
        self.min_diff = offset - config.error_buffer
        self.max_diff = offset + config.error_buffer
        self.counts = Cells(arena, "limiter", inserts=0, samples=0, deletes=0)

    @property
    def inserts(self) -> int:
        return self.counts.inserts

    @property
    def samples(self) -> int:
        return self.counts.samples

    @property
    def deletes(self) -> int:
        return self.counts.deletes

    @property
    def size(self) -> int:
        """Items in the table: inserts - deletes."""
        return self.inserts - self.deletes

    @property
    def error(self) -> float:
        """inserts * samples_per_insert - samples (0 when unthrottled)."""
        spi = self.config.samples_per_insert
        return 0.0 if spi is None else self.inserts * spi - self.samples

    def can_insert(self, n: int) -> bool:
        spi = self.config.samples_per_insert
        if spi is None or self.size < self.config.min_size_to_sample:
            return True
        return self.error + n * spi <= self.max_diff

    def can_sample(self, n: int) -> bool:
        if self.size < self.config.min_size_to_sample:
            return False
        if self.config.samples_per_insert is None:
            return True
        return self.error - n >= self.min_diff

    def on_insert(self, n: int) -> None:
        self.counts.inserts += n

    def on_sample(self, n: int) -> None:
        self.counts.samples += n

    def on_delete(self, n: int) -> None:
        self.counts.deletes += n

    def restore(self, size: int) -> None:
        """After a restart: the table holds ``size`` items (a torn operation may have counted
        items it then did not keep); the deletes absorb the difference."""
        self.counts.deletes = self.inserts - size

    def check_no_deadlock(self, insert_size: int, sample_size: int) -> None:
        """Raise ValueError unless inserts of ``insert_size`` and samples of ``sample_size``
        items can never block each other: needs 2 * error_buffer >= insert_size * s + sample_size."""
        spi = self.config.samples_per_insert
        if spi is None:
            return
        need = (insert_size * spi + sample_size) / 2
        if self.config.error_buffer < need:
            raise ValueError(
                f"RateLimiterConfig.error_buffer={self.config.error_buffer} is too small for inserts "
                f"of {insert_size} items and samples of {sample_size} at samples_per_insert={spi}: "
                f"set it to at least {need}"
            )

    def metrics(self) -> dict[str, float]:
        return {
            "inserts": float(self.inserts),
            "samples": float(self.samples),
            "deletes": float(self.deletes),
            "error": self.error,
        }
