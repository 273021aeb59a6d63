"""The wire envelope: the only module that packs and unpacks socket messages.

A message is a list of ZeroMQ frames: frame 0 is a msgpack map (the header), frames 1..k
carry raw array bytes when arrays travel between hosts (on one host they stay in shared
memory and only descriptors travel). Nothing from a socket is ever unpickled.

Header::

    {"v": PROTOCOL_VERSION, "type": str, "from": str, "seq": int, "body": {...},
     "arrays": [{"dtype": str, "shape": [int, ...]}, ...]}     # one per extra frame

Each message type declares its required body fields and their types in ``SCHEMAS``; the
values of those fields are then checked by name against ``INT_RANGES`` and ``LISTS``
(a field name means the same thing in every message type), so a handler gets ints that fit
an int64 index, finite floats and lists of the promised shape. ``unpack`` rejects anything
else with a ``WireError`` whose text names what was wrong, so a service can log it and
carry on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 1 << 20
MAX_FRAME_BYTES = 1 << 30
MAX_INSTANCE = 4095  # processes of one service
MAX_DESCRIPTORS = 16  # shm descriptors in one hello (env groups, batch slots)
MAX_ITEMS = 1 << 24  # items in one batch, steps in one segment
MAX_EPISODES = 1 << 16  # episodes reported in one message
MAX_RETURN = 1e15  # |episode return|: a mean over any window stays finite
_I63 = 2**63 - 1

_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_LIST = (list,)
_DICT = (dict,)
_BOOL = (bool,)

# type -> {field: allowed python types}. Optional fields are not listed; receivers use
# body.get() for those. Hellos carry the run's secret (shared/transport/auth.py) and the sender's
# incarnation (time.time_ns() at its start: a restarted peer's is newer).
SCHEMAS: dict[str, dict[str, tuple]] = {
    # sampler <-> action-server
    "hello_actor": {"instance": _INT, "slots": _LIST, "incarnation": _INT, "secret": _STR},  # then steps go by doorbell
    # sampler <-> replay
    "hello_writer": {"instance": _INT, "ring": _DICT, "incarnation": _INT, "secret": _STR},
    "segment": {"index": _INT, "serial": _INT, "steps": _INT, "episodes": _LIST, "version_min": _INT, "version_max": _INT},
    "release": {"index": _INT},
    # learner <-> replay
    "hello_reader": {"slots": _LIST, "incarnation": _INT, "secret": _STR},
    "sample": {"slot": _INT, "n": _INT, "min_version": _INT},
    "sampled": {"slot": _INT, "n": _INT, "env_steps": _INT, "episodes": _LIST, "dropped": _INT, "replay_size": _INT,
                "obs_count": _INT, "obs_sum": _LIST, "obs_sumsq": _LIST},  # obs_*: shared/data/obs_stats.py
    "priorities": {"keys": _LIST, "generations": _LIST, "priorities": _LIST},
    # learner -> action-servers (PUB)
    "params": {"version": _INT, "segment": _DICT, "env_steps": _INT},
    "params_data": {"version": _INT, "env_steps": _INT},  # the state's arrays as frames, for other nodes
    # any -> any
    "welcome": {"peer": _STR},
    # and, where the refuser parsed the message: "why" (Rejected's reason) and "seq" (the refused message's)
    "error": {"reason": _STR},
}

# int field -> inclusive range, whatever the message type. Policy versions may be -1: a
# sampler's slot stamped before any parameters arrived carries the sentinel.
INT_RANGES: dict[str, tuple[int, int]] = {
    "instance": (0, MAX_INSTANCE), "slot": (0, MAX_DESCRIPTORS - 1), "index": (0, MAX_ITEMS),
    "serial": (1, _I63), "steps": (0, MAX_ITEMS), "n": (1, MAX_ITEMS),
    "incarnation": (0, _I63), "version": (0, _I63), "min_version": (0, _I63), "version_min": (-1, _I63),
    "version_max": (-1, _I63), "env_steps": (0, _I63), "dropped": (0, _I63), "obs_count": (0, _I63),
    "replay_size": (0, _I63),
}


def _episode(x) -> bool:
    """[finite return, positive length], and in self-play against a pool the opponent's version
    (``shared.transport.pool``): [return, length, version >= 0]."""
    return (isinstance(x, list) and len(x) in (2, 3) and isinstance(x[0], _NUM) and not isinstance(x[0], bool)
            and abs(x[0]) <= MAX_RETURN and type(x[1]) is int and 1 <= x[1] <= _I63
            and (len(x) == 2 or type(x[2]) is int and 0 <= x[2] <= _I63))


def _key(x) -> bool:
    return type(x) is int and 0 <= x <= _I63


def _finite(x) -> bool:
    return isinstance(x, _NUM) and not isinstance(x, bool) and math.isfinite(x)


def _priority(x) -> bool:
    return isinstance(x, _NUM) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


# list field -> (what each element must be, test, fewest and most elements)
LISTS: dict[str, tuple[str, object, int, int]] = {
    "slots": ("a descriptor map", lambda x: isinstance(x, dict), 1, MAX_DESCRIPTORS),
    "episodes": (f"[return, length(, opponent version)] with |return| <= {MAX_RETURN:g}, length >= 1, version >= 0",
                 _episode, 0, MAX_EPISODES),
    "keys": ("an int in 0..2**63-1", _key, 0, MAX_ITEMS),
    "generations": ("an int in 0..2**63-1", _key, 0, MAX_ITEMS),
    "priorities": ("a finite number >= 0", _priority, 0, MAX_ITEMS),
    "obs_sum": ("a finite number", _finite, 0, MAX_ITEMS),
    "obs_sumsq": ("a finite number >= 0", _priority, 0, MAX_ITEMS),
}
# message type -> list fields that must have one length
SAME_LENGTH = {"priorities": ("keys", "generations", "priorities"), "sampled": ("obs_sum", "obs_sumsq")}


class WireError(ValueError):
    """A message that does not follow the protocol; the text says what was wrong."""


@dataclass
class Message:
    type: str
    body: dict
    sender: str = ""
    seq: int = 0
    arrays: list = field(default_factory=list)


def pack(type: str, body: dict, sender: str, seq: int, arrays: list | None = None) -> list:
    """Frames for one message; ``arrays`` (numpy) travel as zero-copy extra frames."""
    _check_body(type, body)
    arrays = arrays or []
    header = {
        "v": PROTOCOL_VERSION,
        "type": type,
        "from": sender,
        "seq": seq,
        "body": body,
        "arrays": [{"dtype": a.dtype.str, "shape": list(a.shape)} for a in arrays],
    }
    return [msgpack.packb(header, use_bin_type=True)] + [np.ascontiguousarray(a) for a in arrays]


def topic(mtype: str) -> bytes:
    """The first bytes of every message of type ``mtype`` (``pack`` writes "v" and "type" first):
    a SUB socket subscribed to them gets only that type, and a PUB socket sends nothing of a
    type no subscriber asked for."""
    header = msgpack.packb({"v": PROTOCOL_VERSION, "type": mtype, "from": "", "seq": 0, "body": {}, "arrays": []},
                           use_bin_type=True)
    name = msgpack.packb(mtype, use_bin_type=True)
    return header[:header.index(name) + len(name)]


def unpack(frames: list) -> Message:
    """Parse and validate frames (bytes, zmq.Frame or any buffer). Raises WireError naming the fault."""
    if not frames:
        raise WireError("empty message (no frames)")
    raw = _bytes(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(raw)} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise WireError(f"header is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise WireError(f"header must be a map, got {type(header).__name__}")
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # True == 1.0 == 1 in python
        raise WireError(f"protocol version {version!r}, this service speaks {PROTOCOL_VERSION}")
    mtype, body, seq, sender = header.get("type"), header.get("body"), header.get("seq"), header.get("from")
    if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(sender, str):
        raise WireError("header needs 'seq' (int) and 'from' (str)")
    if not isinstance(mtype, str):
        raise WireError(f"header 'type' must be a str, got {type(mtype).__name__}")
    if not isinstance(body, dict):
        raise WireError(f"{mtype!r} message: body must be a map")
    _check_body(mtype, body)
    _check_values(mtype, body)
    specs = header.get("arrays", [])
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        raise WireError(f"{mtype!r} message: header lists {len(specs) if isinstance(specs, list) else '?'} "
                        f"arrays but {len(frames) - 1} extra frames came")
    arrays = [_array(spec, frame, mtype) for spec, frame in zip(specs, frames[1:])]
    return Message(type=mtype, body=body, sender=sender, seq=seq, arrays=arrays)


def check(mtype: str, body: dict) -> None:
    """What ``unpack`` checks of a body, for a sender that would rather not send what its peer
    refuses (a sampler checks its segment announcements: once a segment, a header only).
    Raises WireError naming the field."""
    _check_body(mtype, body)
    _check_values(mtype, body)


def _check_body(mtype, body: dict) -> None:
    """Fields present with their types: what ``pack`` checks (a sender's bug shows at once).
    The values, element by element, are ``_check_values``'s, on the receiving end only: a
    sender that checked them too would pay for every priority and key twice per batch."""
    schema = SCHEMAS.get(mtype)
    if schema is None:
        raise WireError(f"unknown message type {mtype!r} (known: {', '.join(sorted(SCHEMAS))})")
    for name, types in schema.items():
        if name not in body:
            raise WireError(f"{mtype!r} message: missing field {name!r}")
        value = body[name]
        if not isinstance(value, types) or (types is not _BOOL and isinstance(value, bool)):
            want = "/".join(t.__name__ for t in types)
            raise WireError(f"{mtype!r} message: field {name!r} must be {want}, got {type(value).__name__}")


def _check_values(mtype, body: dict) -> None:
    """The fields' values against INT_RANGES, LISTS and SAME_LENGTH (after ``_check_body``)."""
    for name in SCHEMAS[mtype]:
        value = body[name]
        if name in INT_RANGES:
            lo, hi = INT_RANGES[name]
            if not lo <= value <= hi:
                raise WireError(f"{mtype!r} message: field {name!r} = {value} is outside {lo}..{hi}")
        elif name in LISTS:
            what, ok, least, most = LISTS[name]
            if not least <= len(value) <= most:
                raise WireError(f"{mtype!r} message: field {name!r} has {len(value)} entries, want {least}..{most}")
            bad = next((i for i, x in enumerate(value) if not ok(x)), None)
            if bad is not None:
                raise WireError(f"{mtype!r} message: {name}[{bad}] = {value[bad]!r:.60} must be {what}")
    lengths = {name: len(body[name]) for name in SAME_LENGTH.get(mtype, ())}
    if len(set(lengths.values())) > 1:
        raise WireError(f"{mtype!r} message: {', '.join(lengths)} must have one length, got {lengths}")


def _bytes(frame) -> bytes | memoryview:
    """The frame's bytes, zero-copy: bytes, zmq.Frame, or any buffer (e.g. a frame ``pack`` made)."""
    if isinstance(frame, bytes):
        return frame
    view = memoryview(getattr(frame, "buffer", frame))
    # cast("B"): len() must count bytes, also for a multi-dimensional numpy frame (an empty one cannot be cast).
    return view.cast("B") if view.nbytes else b""


def _array(spec, frame, mtype) -> np.ndarray:
    try:
        dtype = np.dtype(spec["dtype"])
        shape = tuple(spec["shape"])
        if dtype.hasobject or dtype.itemsize == 0 or dtype.kind == "V":
            raise TypeError("object, zero-size, sub-array, record or void dtype")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise TypeError("shape must be non-negative ints")
    except Exception as e:
        raise WireError(f"{mtype!r} message: bad array spec {spec!r} ({e})") from None
    buf = _bytes(frame)
    need = dtype.itemsize * math.prod(shape)  # python ints: a huge shape cannot wrap around
    if len(buf) != need or need > MAX_FRAME_BYTES:
        raise WireError(f"{mtype!r} message: array frame has {len(buf)} bytes, spec {spec} needs {need}")
    return np.frombuffer(buf, dtype=dtype).reshape(shape)
