"""The storage protocol of replay tables and the spec checks every storage makes of a segment."""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import numpy as np

from shared.data.namedarraytuple import leaves, spec_of

_F32 = np.dtype(np.float32).str
_NO_KEYS = np.zeros(0, dtype=np.int64)


# ---------------------------------------------------------------- specs and checks


def _strip_leading(spec, k: int) -> Any:
    """``spec`` without its first ``k`` leading dims on every leaf."""
    if spec is None:
        return None
    if "fields" in spec:
        return {"type": spec["type"], "fields": [[f, _strip_leading(c, k)] for f, c in spec["fields"]]}
    return {"dtype": spec["dtype"], "shape": list(spec["shape"][k:])}


def _leaf_specs(spec, path: str = "") -> Iterator[tuple[str, dict]]:
    if spec is None:
        return
    if "fields" in spec:
        for f, child in spec["fields"]:
            yield from _leaf_specs(child, f"{path}.{f}" if path else f)
    else:
        yield path, spec


def _field(spec, name: str):
    for f, child in spec["fields"]:
        if f == name:
            return child
    raise ValueError(f"segment spec has no field {name!r}; the replay tables need it (fields: "
                     f"{[f for f, _ in spec['fields']]})")


def _check_like(got_spec, want_spec, what: str) -> None:
    """Raise ValueError naming the first leaf where ``got_spec`` differs from ``want_spec``."""
    got, want = dict(_leaf_specs(got_spec)), dict(_leaf_specs(want_spec))
    if list(got) != list(want):
        raise ValueError(f"{what}: fields {list(got)} do not match the table's {list(want)}")
    for path, w in want.items():
        if got[path] != w:
            raise ValueError(
                f"{what}.{path}: dtype {got[path]['dtype']} shape {got[path]['shape']}, "
                f"expected dtype {w['dtype']} shape {w['shape']}"
            )


def _segment_dims(segment_spec) -> tuple[int, Any]:
    """(T, spec of one step) of a segment spec whose leaves lead with [T, B]."""
    T = next(_leaf_specs(segment_spec))[1]["shape"][0]
    return int(T), _strip_leading(segment_spec, 2)


def _take_into(dest_tree, src_tree, idx: np.ndarray) -> None:
    """dest leaf[i] = src leaf[idx[i]] for every leaf; src leaves are flat [slots, ...]."""
    for (_, d), (_, s) in zip(leaves(dest_tree), leaves(src_tree)):
        np.take(s, idx, axis=0, out=d)


def _check_segment(samples, step_spec, width: int, what: str) -> int:
    """Validate a segment against the table's step spec and width; return its T."""
    got = spec_of(samples)
    _check_like(_strip_leading(got, 2), step_spec, what)
    T = None
    for path, leaf in _leaf_specs(got):
        lead = leaf["shape"][:2]
        if T is None:
            T = lead[0] if lead else None
        if lead != [T, width]:
            raise ValueError(f"{what}.{path}: leading dims {lead}, expected [T, B] = [{T}, {width}]")
    return int(T)


# ---------------------------------------------------------------- storage protocol


class Storage(Protocol):
    num_slots: int
    """Item keys are in [0, num_slots)."""
    writer_ids: list[int]
    """The writers it stores segments of."""

    def batch_spec(self, n: int) -> Any:
        """Spec of a destination for ``n`` items (``from_spec`` it, in shm or on the heap)."""

    def items_per_write(self, writer_id: int) -> int:
        """Items one segment of ``writer_id`` adds (what the rate limiter is asked for)."""

    def can_write(self, writer_id: int) -> bool:
        """False when a segment of ``writer_id`` cannot be stored now (back-pressure)."""

    def write(self, writer_id: int, samples, bootstrap_value) -> tuple[np.ndarray, np.ndarray]:
        """Store one segment; return (keys whose data it overwrote, keys that became items)."""

    def reset_writer(self, writer_id: int) -> None:
        """The writer restarted: its next segment does not continue the previous one."""

    def check_dest(self, dest, n: int) -> None:
        """Raise ValueError unless ``dest`` is a valid destination for ``n`` items."""

    def gather(self, keys: np.ndarray, is_weights: np.ndarray, dest) -> None:
        """Write items ``keys`` [n] (with their weights [n]) into ``dest``."""

    def release(self, keys: np.ndarray) -> None:
        """Items ``keys`` left the table; their space may be reused."""

    def policy_version(self, keys: np.ndarray) -> np.ndarray:
        """Policy version [n] int64 of items ``keys`` (the oldest step's, for multi-step items)."""

    def cursor(self, writer_id: int) -> int:
        """Where the next write of ``writer_id`` goes (recorded before a write: see ``torn_write``)."""

    def torn_write(self, writer_id: int, cursor: int) -> np.ndarray:
        """A write of ``writer_id`` at ``cursor`` was cut by a kill: repair the writer's cursors
        and return the keys of the items it may have touched (the table drops them)."""

    def restore(self, live: np.ndarray) -> np.ndarray:
        """After a restart with ``live`` [num_slots] the items present: free what no item holds
        and return the keys of live items whose data is not intact (the table drops them)."""

