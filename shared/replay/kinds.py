"""Batch kinds: what an algorithm learns from (``AlgoSpec.batch``), one ``BatchKind`` each.

A kind owns everything that follows from it: the replay tables (``replay.table`` values)
that serve it and the selector each composes, its storage, the layout of a learner's batch
slot, and the items one batch holds. Everything else reads these attributes, so a new kind
is one entry of ``BATCH_KINDS`` (and its storage module). The config objects passed in are
the run's sections (``ReplayConfig``, ``LearnerConfig``, the ``[algo]`` dataclass), read by
field: this layer sits below the config package. A replay section holds each part's own config
(``storage``, ``transitions``, ``sequences``, ``prioritized``), handed to the part as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from shared.data.layout import segments_spec
from shared.data.namedarraytuple import leaf_specs
from shared.replay.arena import Arena
from shared.replay.segments import SegmentStorage
from shared.replay.selectors import Fifo, Prioritized, Selector, Uniform
from shared.replay.sequences import SequenceStorage, sequence_batch_spec
from shared.replay.storage import Storage, segment_dims
from shared.replay.transitions import TransitionStorage, transition_batch_spec


@dataclass(frozen=True)
class BatchKind:
    name: str
    """The ``AlgoSpec.batch`` value."""
    tables: dict[str, Callable[[Any], Selector]]
    """``replay.table`` values that serve it -> the selector that table composes, from the replay config."""
    storage: Callable[[Any, dict[int, int], Any, Arena], Storage]
    """``storage(segment_spec, columns_per_writer, replay config, arena)``: where its items live
    (segment_spec: one sampler segment's Samples, leaves [T, B])."""
    batch_spec: Callable[[Any, Any, int, int], Any]
    """``batch_spec(segment_spec, replay config, n, ranks)``: one learner rank's batch slot of
    ``n`` items (what ``storage.batch_spec(n)`` writes, or a rank's share of it)."""
    items: Callable[[Any, Any], int]
    """``items(learner config, algo config)``: the items one batch holds."""
    on_policy: bool = False
    """Items are whole segments, each trained on once, in order, within ``replay.max_policy_lag``:
    the ranks split one batch's env columns, and replay may hold a sampler's ring slot until its
    segment is sampled (``replay.release_on_sample``). Off-policy, each rank samples a batch of its own."""
    recurrent: bool = False
    """Items are sequences of a recurrent agent's steps (``model.lstm_size > 0``)."""
    window_steps: bool = False
    """Items can carry each step of their n-step window (``replay.store_steps``)."""


def _prioritized(cfg) -> Prioritized:
    return Prioritized(cfg.prioritized)


def _window(cfg) -> int:
    """The steps a Transition batch carries per item: the n-step window with ``store_steps``."""
    return cfg.transitions.n_step if cfg.transitions.store_steps else 0


def _segments_batch(segment_spec, cfg, n: int, ranks: int) -> Any:
    """OnPolicyBatch [T, n * B / ranks]: a rank's share of the env columns of n segments [T, B]."""
    T, step_spec = segment_dims(segment_spec)
    B = next(leaf_specs(segment_spec))["shape"][1]
    return segments_spec(step_spec, T, n * B // ranks)


BATCH_KINDS: dict[str, BatchKind] = {kind.name: kind for kind in (
    BatchKind(
        "segments", {"queue": lambda cfg: Fifo()},
        lambda spec, columns, cfg, arena: SegmentStorage(spec, columns, cfg.storage, arena),
        _segments_batch,
        lambda learner, algo: learner.batch_segments,
        on_policy=True),
    BatchKind(
        "transitions", {"uniform": lambda cfg: Uniform(), "prioritized": _prioritized},
        lambda spec, columns, cfg, arena: TransitionStorage(spec, columns, cfg.storage, cfg.transitions, arena),
        lambda spec, cfg, n, ranks: transition_batch_spec(segment_dims(spec)[1], n, _window(cfg)),
        lambda learner, algo: algo.batch_size,
        window_steps=True),
    BatchKind(
        "sequences", {"sequence": _prioritized},
        lambda spec, columns, cfg, arena: SequenceStorage(spec, columns, cfg.storage, cfg.sequences, arena),
        lambda spec, cfg, n, ranks: sequence_batch_spec(segment_dims(spec)[1], cfg.sequences.length, n),
        lambda learner, algo: algo.batch_size,
        recurrent=True),
)}
"""segments: ``OnPolicyBatch`` [T, B] of whole segments (on-policy); transitions: ``Transition``
[batch_size] of n-step transitions; sequences: ``SequenceBatch`` [sequence_length, batch_size]
(recurrent off-policy). An off-policy algorithm's config has a ``batch_size`` field: the items
of one batch."""


def table_kind(table: str) -> tuple[BatchKind, Callable[[Any], Selector]]:
    """The kind ``replay.table`` serves and the selector factory of that table; ValueError naming the tables."""
    for kind in BATCH_KINDS.values():
        if table in kind.tables:
            return kind, kind.tables[table]
    raise ValueError(f"replay.table = {table!r}: allowed: "
                     f"{', '.join(t for kind in BATCH_KINDS.values() for t in kind.tables)}")
