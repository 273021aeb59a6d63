"""The table a run's replay section asks for, composed from storage, selector and rate limiter."""

from __future__ import annotations

from shared.config import ReplayConfig
from shared.replay.rate_limiter import RateLimiter, RateLimiterConfig
from shared.replay.selectors import Fifo
from shared.replay.tables import SegmentStorage, SegmentStorageConfig, Table


def make_table(cfg: ReplayConfig, columns_per_writer: dict[int, int], segment_spec) -> Table:
    """``segment_spec``: one sampler segment (OnPolicyBatch, samples [T, B])."""
    samples_spec = segment_spec["fields"][0][1]
    if cfg.table == "queue":
        # On-policy: each segment once, in order; back-pressure comes from the queue's capacity.
        storage = SegmentStorage(samples_spec, columns_per_writer, SegmentStorageConfig(capacity=cfg.capacity))
        return Table(storage, Fifo(), RateLimiter(RateLimiterConfig()))
    raise ValueError(f"replay.table = {cfg.table!r}: allowed: queue")
