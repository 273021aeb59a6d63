"""namedarraytuple: nested named tuples of arrays with one indexing syntax.

After rlpyt (``rlpyt/utils/collections.py``). A namedarraytuple is a namedtuple whose
fields are arrays (numpy or torch), other namedarraytuples, or None. Indexing it with
anything but a field name indexes every leaf the same way::

    dest[t, slice(0, 4)] = src      # src: same structure, or a scalar broadcast to all
    sub = buf[t]                     # a namedarraytuple of views

A *spec* describes a structure without its data (type names, field names, dtype and shape
of each leaf). Specs are plain lists/dicts, so they travel in msgpack messages and a peer
can rebuild the structure on a shared-memory buffer without knowing the env or the agent.
"""

from __future__ import annotations

import keyword
import math
from collections import namedtuple
from typing import Any, Callable, Iterator

import numpy as np

_ALIGN = 64
_TYPES: dict[tuple[str, tuple[str, ...]], type] = {}
_METHODS = ("get", "items")  # a field of one of these names would be hidden by the method


def _nat_getitem(self, loc):
    if isinstance(loc, str):
        return getattr(self, loc)
    return type(self)(*(None if s is None else s[loc] for s in self))


def _nat_setitem(self, loc, value):
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        if value._fields != self._fields:
            raise ValueError(
                f"{type(self).__name__}: cannot set from {type(value).__name__} "
                f"with fields {value._fields}; expected {self._fields}"
            )
        for field, dst, src in zip(self._fields, self, value):
            if dst is None:
                continue
            if src is None:
                raise ValueError(f"{type(self).__name__}.{field}: source is None")
            dst[loc] = src
    else:
        for dst in self:
            if dst is not None:
                dst[loc] = value


def _nat_contains(self, key):
    return key in self._fields


def _nat_get(self, key, default=None):
    return getattr(self, key, default)


def _nat_items(self):
    return zip(self._fields, self)


def namedarraytuple(typename: str, field_names) -> type:
    """Return (and cache) the namedarraytuple class ``typename`` with ``field_names``.

    The same (typename, fields) always gives the same class, so structures rebuilt from a
    spec in another process compare equal in type to the originals.
    """
    if isinstance(field_names, str):
        field_names = field_names.replace(",", " ").split()
    fields = tuple(field_names)
    hidden = sorted(set(fields) & set(_METHODS))
    if hidden:
        raise ValueError(f"{typename}: field names {hidden} would be hidden by the methods of the same name")
    key = (typename, fields)
    cls = _TYPES.get(key)
    if cls is None:
        base = namedtuple(typename, fields)
        cls = type(
            typename,
            (base,),
            {
                "__slots__": (),
                "__getitem__": _nat_getitem,
                "__setitem__": _nat_setitem,
                "__contains__": _nat_contains,
                "get": _nat_get,
                "items": _nat_items,
                "_is_namedarraytuple": True,
            },
        )
        _TYPES[key] = cls
    return cls


def is_nat(x: Any) -> bool:
    return getattr(type(x), "_is_namedarraytuple", False)


def leaves(tree) -> Iterator[tuple[str, Any]]:
    """Yield (dotted path, leaf) for every non-None leaf, depth first in field order."""

    def walk(prefix: str, node):
        if node is None:
            return
        if is_nat(node):
            for f, child in zip(node._fields, node):
                yield from walk(f"{prefix}.{f}" if prefix else f, child)
        else:
            yield prefix, node

    yield from walk("", tree)


def leading_len(tree) -> int:
    """The length of the first dimension of the tree's first leaf (its batch, T or B)."""
    return len(next(leaves(tree))[1])


def map_leaves(fn: Callable[[Any], Any], tree):
    """Apply ``fn`` to every leaf, keeping the structure (None stays None)."""
    if tree is None:
        return None
    if is_nat(tree):
        return type(tree)(*(map_leaves(fn, child) for child in tree))
    return fn(tree)


def zip_map(fn: Callable[..., Any], *trees):
    """Apply ``fn`` leafwise across several trees of the same structure."""
    first = trees[0]
    if first is None:
        return None
    if is_nat(first):
        return type(first)(*(zip_map(fn, *children) for children in zip(*trees)))
    return fn(*trees)


# ---------------------------------------------------------------- specs


def spec_of(tree) -> Any:
    """Describe a structure of numpy arrays: leaves become {"dtype", "shape"}."""
    if tree is None:
        return None
    if is_nat(tree):
        return {
            "type": type(tree).__name__,
            "fields": [[f, spec_of(child)] for f, child in zip(tree._fields, tree)],
        }
    arr = np.asarray(tree)
    return {"dtype": arr.dtype.str, "shape": list(arr.shape)}


def spec_leaves(spec, prefix: str = "") -> Iterator[tuple[str, dict]]:
    """Yield (dotted path, leaf spec ``{"dtype", "shape"}``) of a spec, as ``leaves`` does of its buffer."""
    if spec is None:
        return
    if "fields" in spec:
        for f, child in spec["fields"]:
            yield from spec_leaves(child, f"{prefix}.{f}" if prefix else f)
    else:
        yield prefix, spec


def leaf_specs(spec) -> Iterator[dict]:
    """The leaves of a spec (``{"dtype", "shape"}``), in ``leaves`` order."""
    for _, leaf in spec_leaves(spec):
        yield leaf


def spec_field(spec, name: str) -> Any:
    """The spec of field ``name`` of a structure spec; ValueError naming the fields it has."""
    for f, child in spec["fields"]:
        if f == name:
            return child
    raise ValueError(f"{spec['type']} spec has no field {name!r} (fields: {[f for f, _ in spec['fields']]})")


def check_spec(got, want, what: str) -> None:
    """Raise ValueError naming the first leaf where spec ``got`` differs from spec ``want``;
    ``what`` names the structure checked (the error's first word)."""
    got_leaves, want_leaves = dict(spec_leaves(got)), dict(spec_leaves(want))
    if list(got_leaves) != list(want_leaves):
        raise ValueError(f"{what}: fields {list(got_leaves)} do not match the expected {list(want_leaves)}")
    for path, w in want_leaves.items():
        g = got_leaves[path]
        if g != w:
            raise ValueError(f"{what}.{path}: dtype {g['dtype']} shape {g['shape']}, "
                             f"expected dtype {w['dtype']} shape {w['shape']}")


def spec_leading_len(spec) -> int:
    """The first dimension of the first leaf a (validated) spec describes (``leading_len`` of its buffer)."""
    return next(leaf_specs(spec))["shape"][0]


def _leaf_nbytes(leaf: dict) -> int:
    return np.dtype(leaf["dtype"]).itemsize * math.prod(leaf["shape"])  # python ints: a huge shape cannot wrap


def spec_nbytes(spec) -> int:
    """Bytes needed to lay out ``spec`` with every leaf aligned to 64 bytes."""
    total = 0
    for leaf in leaf_specs(spec):
        total = _aligned(total) + _leaf_nbytes(leaf)
    return max(_aligned(total), _ALIGN)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


# What a spec that crosses a process boundary may hold: plain numbers of this host's byte
# order (no objects, records, strings or sub-arrays), a few dims, a few levels of nesting.
SPEC_DTYPES = frozenset(np.dtype(t).str for t in ("?", "u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f2", "f4", "f8"))
SPEC_MAX_RANK = 8
SPEC_MAX_DEPTH = 16


def validate_spec(spec, where: str = "spec", _depth: int = 0) -> None:
    """Raise ValueError naming the offending part when ``spec`` is not a valid spec."""
    if spec is None:
        return
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(spec).__name__}")
    if _depth > SPEC_MAX_DEPTH:
        raise ValueError(f"{where}: nested deeper than {SPEC_MAX_DEPTH} levels")
    if "fields" in spec:
        if not _is_name(spec.get("type")) or not isinstance(spec["fields"], list):
            raise ValueError(f"{where}: a structure needs 'type' (an identifier) and 'fields' (list)")
        for item in spec["fields"]:
            if not (isinstance(item, list) and len(item) == 2 and _is_name(item[0])):
                raise ValueError(f"{where}: each field must be [name, spec] with an identifier name")
            validate_spec(item[1], f"{where}.{item[0]}", _depth + 1)
        return
    try:
        # np.dtype(None) is float64 and object dtypes would map pointers: accept only dtype strings.
        if not isinstance(spec["dtype"], str) or np.dtype(spec["dtype"]).str not in SPEC_DTYPES:
            raise TypeError(f"want one of {sorted(SPEC_DTYPES)}, got {spec['dtype']!r}")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: bad or missing dtype ({e})") from None
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
    if len(shape) > SPEC_MAX_RANK:
        raise ValueError(f"{where}: rank {len(shape)} exceeds {SPEC_MAX_RANK}")


def _is_name(name) -> bool:
    """A name that namedarraytuple accepts for a type or field."""
    return (isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)
            and not name.startswith("_") and name not in _METHODS)


def from_spec(spec, buffer=None, fill: bool = True):
    """Build the structure described by ``spec``.

    With ``buffer`` (anything exposing the buffer protocol, e.g. an mmap) the arrays are
    views into it at 64-byte aligned offsets; without, fresh heap arrays. ``fill`` writes
    sentinels (floats -42.42, signed ints -1, unsigned ints and bools 0) so that reading
    data nobody wrote is obvious (Sample Factory's habit).
    """
    offset = 0

    def build(node):
        nonlocal offset
        if node is None:
            return None
        if "fields" in node:
            cls = namedarraytuple(node["type"], [f for f, _ in node["fields"]])
            return cls(*(build(child) for _, child in node["fields"]))
        dtype, shape = np.dtype(node["dtype"]), tuple(node["shape"])
        if buffer is None:
            arr = np.empty(shape, dtype=dtype)
        else:
            offset = _aligned(offset)
            count = int(np.prod(shape, dtype=np.int64))
            arr = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)
            offset += arr.nbytes
        if fill:
            arr[...] = _sentinel(dtype)
        return arr

    return build(spec)


def from_leaves(spec, arrays: list):
    """The structure ``spec`` describes over ``arrays`` (its leaves in ``leaves`` order, e.g.
    the frames of a message), without copying; ValueError unless each array has its leaf's
    dtype and shape and the counts match."""
    it = iter(arrays)

    def build(node, path):
        if node is None:
            return None
        if "fields" in node:
            cls = namedarraytuple(node["type"], [f for f, _ in node["fields"]])
            return cls(*(build(child, f"{path}.{f}" if path else f) for f, child in node["fields"]))
        a = next(it, None)
        if a is None:
            raise ValueError(f"{len(arrays)} arrays for a layout with more leaves (none for {path})")
        if a.dtype != np.dtype(node["dtype"]) or list(a.shape) != list(node["shape"]):
            raise ValueError(f"{path}: {a.dtype.str} {list(a.shape)}, the layout has {node['dtype']} {node['shape']}")
        return a

    tree = build(spec, "")
    if next(it, None) is not None:
        raise ValueError(f"{len(arrays)} arrays for a layout with fewer leaves")
    return tree


def _sentinel(dtype: np.dtype):
    if dtype.kind == "f":
        return -42.42
    if dtype.kind == "i":
        return -1
    return 0


def with_leading_dims(spec, leading_dims) -> Any:
    """The spec of a buffer of ``spec`` items with extra leading dimensions."""
    lead = [int(d) for d in leading_dims]
    if spec is None:
        return None
    if "fields" in spec:
        return {
            "type": spec["type"],
            "fields": [[f, with_leading_dims(child, lead)] for f, child in spec["fields"]],
        }
    return {"dtype": spec["dtype"], "shape": lead + list(spec["shape"])}


def drop_leading_dims(spec, n: int = 1) -> Any:
    """The spec of one item of a buffer described by ``spec`` (its first ``n`` dims removed)."""
    if spec is None:
        return None
    if "fields" in spec:
        return {"type": spec["type"], "fields": [[f, drop_leading_dims(child, n)] for f, child in spec["fields"]]}
    if len(spec["shape"]) < n:
        raise ValueError(f"cannot drop {n} leading dims from shape {spec['shape']}")
    return {"dtype": spec["dtype"], "shape": list(spec["shape"][n:])}


def buffer_from_example(example, leading_dims, fill: bool = True):
    """Heap buffer shaped ``leading_dims + leaf.shape`` for each leaf of ``example``.

    ``example`` is one step (namedarraytuple of arrays or scalars). For a buffer in named
    shared memory use ``shared.transport.shm.allocate`` with ``with_leading_dims(spec_of(example), …)``.
    """
    return from_spec(with_leading_dims(spec_of(example), leading_dims), fill=fill)


# ---------------------------------------------------------------- torch


def torchify(tree, device=None):
    """Torch tensors sharing memory with the numpy leaves (moved to ``device`` if given)."""
    import torch

    def conv(a):
        t = torch.from_numpy(np.asarray(a))
        return t if device is None else t.to(device, non_blocking=True)

    return map_leaves(conv, tree)


def numpify(tree):
    """Numpy arrays from torch leaves (copied to host memory if needed)."""
    return map_leaves(lambda t: t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t), tree)
