"""The table a run's replay section asks for, composed from storage, selector and rate limiter."""

from __future__ import annotations

from pathlib import Path

from shared.config.schema import ReplayConfig
from shared.data.namedarraytuple import spec_field
from shared.replay.arena import HEAP, Arena, ShmArena, fingerprint
from shared.replay.kinds import table_kind
from shared.replay.rate_limiter import RateLimiter, RateLimiterConfig
from shared.replay.tables import Table


def make_table(cfg: ReplayConfig, columns_per_writer: dict[int, int], segment_spec, sample_size: int,
               seed: int = 0, arena: Arena = HEAP) -> Table:
    """``segment_spec``: one sampler segment (OnPolicyBatch, samples [T, B]); ``sample_size``:
    items per learner request (segments on-policy, transitions or sequences off-policy);
    ``arena``: where the table's state lives (``table_arena``; the heap by default). A table
    persisted there that does not fit this layout is discarded and the table made empty
    (``Arena.build``)."""
    return arena.build(lambda a: _compose(cfg, columns_per_writer, segment_spec, sample_size, seed, a))


def _compose(cfg: ReplayConfig, columns_per_writer: dict[int, int], segment_spec, sample_size: int, seed: int,
             arena: Arena) -> Table:
    kind, selector = table_kind(cfg.table)
    storage = kind.storage(spec_field(segment_spec, "samples"), columns_per_writer, cfg, arena)
    if kind.on_policy:
        # Each segment once, in order; back-pressure comes from the queue's capacity.
        return Table(storage, selector(cfg), RateLimiter(RateLimiterConfig(), arena), seed=seed, arena=arena)
    insert_size = max(storage.items_per_write(w) for w in columns_per_writer)
    limiter = RateLimiter(cfg.rate_limiter, arena, insert_size, sample_size)
    return Table(storage, selector(cfg), limiter, seed=seed, arena=arena)


def table_arena(cfg: ReplayConfig, columns_per_writer: dict[int, int], segment_spec, run_id: str,
                instance: int = 0, snapshot: Path | None = None) -> Arena:
    """Shared memory that outlives the replay process (``replay.persist``), re-attached when a
    table of the same layout is there, or restored from ``snapshot`` (a directory) when none
    is; the heap otherwise."""
    if not cfg.persist:
        return HEAP
    return ShmArena(run_id, instance, table_fingerprint(cfg, columns_per_writer, segment_spec), snapshot)


def table_fingerprint(cfg: ReplayConfig, columns_per_writer: dict[int, int], segment_spec) -> int:
    """What a persisted table must match to be re-attached: taken over the section's TOML keys
    (``ReplayConfig.flat``), so that where a key's field lives never discards a table."""
    return fingerprint(cfg.flat(), sorted(columns_per_writer.items()), segment_spec)

