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

``samples_per_insert=0`` is unthrottled: inserts are always allowed, samples once the
table holds ``min_size_to_sample`` items. ``error_buffer=0`` is the narrowest band in which
one insert and one sample of the table's sizes can never block each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.replay.arena import HEAP, Arena, Cells


@dataclass(frozen=True)
class RateLimiterConfig:
    samples_per_insert: float = 0.0
    """Off-policy replay ratio: items sampled per item inserted, kept in a band (0 = unthrottled)."""
    min_size_to_sample: int = 1
    """Items the table must hold before the learner may sample."""
    error_buffer: float = 0.0
    """Half-width of the samples-per-insert band (error = inserts * samples_per_insert - samples)
    in items (0 = the narrowest band that cannot deadlock)."""


class RateLimiter:
    """Gate inserts and samples of one table; the table reports what actually happened."""

    def __init__(self, config: RateLimiterConfig = RateLimiterConfig(), arena: Arena = HEAP,
                 insert_size: int = 1, sample_size: int = 1):
        """``arena``: where the counters live (they persist with the table's state);
        ``insert_size``, ``sample_size``: items one insert and one sample of the table move
        (what the band must hold: ``check_no_deadlock``)."""
        spi = config.samples_per_insert
        if spi < 0:
            raise ValueError(f"RateLimiterConfig.samples_per_insert must be >= 0 (0: unthrottled), got {spi}")
        if config.min_size_to_sample < 1:
            raise ValueError(
                f"RateLimiterConfig.min_size_to_sample must be >= 1, got {config.min_size_to_sample}"
            )
        if config.error_buffer < 0:
            raise ValueError(f"RateLimiterConfig.error_buffer must be >= 0, got {config.error_buffer}")
        self.config = config
        self.error_buffer = config.error_buffer or (insert_size * spi + sample_size) / 2
        offset = spi * config.min_size_to_sample
        self.min_diff = offset - self.error_buffer
        self.max_diff = offset + self.error_buffer
        self.check_no_deadlock(insert_size, sample_size)
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
        return self.inserts * self.config.samples_per_insert - self.samples if self.config.samples_per_insert else 0.0

    def can_insert(self, n: int) -> bool:
        spi = self.config.samples_per_insert
        if not spi or self.size < self.config.min_size_to_sample:
            return True
        return self.error + n * spi <= self.max_diff

    def can_sample(self, n: int) -> bool:
        if self.size < self.config.min_size_to_sample:
            return False
        if not self.config.samples_per_insert:
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
        if not spi:
            return
        need = (insert_size * spi + sample_size) / 2
        if self.error_buffer < need:
            raise ValueError(
                f"RateLimiterConfig.error_buffer={self.error_buffer} is too small for inserts "
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
