"""The wire envelope: every message type round-trips, arrays travel byte-exact as extra
frames, and every kind of bad input (also hostile values in a valid envelope) is a
WireError that names the fault; a ROUTER endpoint survives garbage and handler failures,
and a DEALER reconnects under an unguessable routing id."""

import time

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.transport import wire
from shared.data.obs_stats import NO_MOMENTS
from shared.transport.sockets import Endpoint, Rejected

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=10,
)
VALUES = {  # one strategy per python type a schema allows
    int: st.integers(-2**63, 2**64 - 1),
    str: st.text(max_size=20),
    list: st.lists(JSONISH, max_size=4),
    dict: st.dictionaries(st.text(max_size=8), JSONISH, max_size=4),
    bool: st.booleans(),
    float: st.floats(allow_nan=False),
}
WRONG = {int: "1", str: 1, list: {"a": 1}, dict: [1], bool: 1, float: "x"}  # a value of another type
FIELDS = [(t, f) for t, schema in sorted(wire.SCHEMAS.items()) for f in schema]
INT_FIELDS = [(t, f) for t, f in FIELDS if wire.SCHEMAS[t][f] == (int,)]


def field_values(name: str, types: tuple):
    """Values valid for field ``name``: its type, its range, its list elements."""
    if name in wire.INT_RANGES:
        return st.integers(*wire.INT_RANGES[name])
    if name == "episodes":
        return st.lists(st.tuples(st.floats(-wire.MAX_RETURN, wire.MAX_RETURN) | st.integers(-10**6, 10**6),
                                  st.integers(1, 2**63 - 1)).map(list), max_size=4)
    if name == "slots":
        return st.lists(st.dictionaries(st.text(max_size=8), JSONISH, max_size=3), min_size=1, max_size=4)
    return st.one_of(*(VALUES[t] for t in types))


LIST_ITEMS = {"keys": st.integers(0, 2**63 - 1), "generations": st.integers(0, 2**63 - 1),
              "priorities": st.floats(0, 1e300) | st.integers(0, 10**9),
              "obs_sum": st.floats(-1e300, 1e300) | st.integers(-10**9, 10**9),
              "obs_sumsq": st.floats(0, 1e300) | st.integers(0, 10**9)}


def body_of(mtype: str):
    """Bodies valid for ``mtype``: every required field, plus optional extras."""
    schema = wire.SCHEMAS[mtype]
    required = st.fixed_dictionaries({f: field_values(f, types) for f, types in schema.items() if f not in LIST_ITEMS})
    same = st.integers(0, 4).flatmap(lambda n: st.fixed_dictionaries(
        {f: st.lists(LIST_ITEMS[f], min_size=n, max_size=n) for f in schema if f in LIST_ITEMS}))
    extras = st.dictionaries(st.text(max_size=8).filter(lambda k: k not in schema), JSONISH, max_size=2)
    return st.builds(lambda r, l, e: {**e, **r, **l}, required, same, extras)


def valid_body(mtype: str) -> dict:
    """One fixed valid body for ``mtype``."""
    example = {int: 1, str: "s", list: [], dict: {}, bool: True, float: 1.0}
    return {f: [{}] if f == "slots" else example[types[0]] for f, types in wire.SCHEMAS[mtype].items()}


def header(**changes) -> dict:
    h = {"v": wire.PROTOCOL_VERSION, "type": "sample", "from": "learner0", "seq": 7, "body": {"slot": 0, "n": 3, "min_version": 0},
         "arrays": []}
    h.update(changes)
    return {k: v for k, v in h.items() if v is not DROP}


DROP = object()


def on_the_wire(frames: list) -> list[bytes]:
    """The frames as bytes, as a peer on another host receives them."""
    return [bytes(f) if isinstance(f, bytes) else np.ascontiguousarray(f).tobytes() for f in frames]


@pytest.mark.parametrize("mtype", sorted(wire.SCHEMAS))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_type_round_trips(mtype, data):
    body = data.draw(body_of(mtype), label="body")
    sender = data.draw(st.text(max_size=10), label="sender")
    seq = data.draw(st.integers(0, 2**63 - 1), label="seq")
    for frames in (wire.pack(mtype, body, sender, seq), on_the_wire(wire.pack(mtype, body, sender, seq))):
        msg = wire.unpack(frames)
        assert (msg.type, msg.body, msg.sender, msg.seq, msg.arrays) == (mtype, body, sender, seq, [])


DTYPES = ["<f2", "<f4", "<f8", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u8", "|b1", "<c16", ">i4", ">f8"]
SHAPES = [(), (0,), (3, 0, 2), (5,), (2, 3, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_arrays_round_trip_byte_exact(dtype):
    rng = np.random.default_rng(0)
    arrays = [(rng.standard_normal(s) * 100).astype(dtype) for s in SHAPES]
    arrays.append(np.asfortranarray(arrays[-1]))  # non-contiguous input: packed contiguous
    arrays.append(arrays[-2][:, ::2])
    frames = wire.pack("sample", {"slot": 1, "n": 2, "min_version": 0}, "s", 1, arrays)
    assert len(frames) == 1 + len(arrays)
    for received in (frames, on_the_wire(frames)):
        out = wire.unpack(received).arrays
        assert len(out) == len(arrays)
        for a, b in zip(arrays, out):
            assert b.dtype == a.dtype and b.shape == a.shape
            assert b.tobytes() == a.tobytes()


@pytest.mark.parametrize("frames,message", [
    ([], "empty message"),
    ([b"\xc1garbage"], "header is not valid msgpack"),
    ([msgpack.packb(header())[:-3]], "header is not valid msgpack"),
    ([msgpack.packb(header()) + b"\x00"], "header is not valid msgpack"),  # trailing bytes
    ([msgpack.packb({1: 2})], "header is not valid msgpack"),  # non-string map keys
    ([msgpack.packb(header(body={"slot": 0, "n": 3, "min_version": 0, "pad": "x" * wire.MAX_HEADER_BYTES}))],
     f"exceeds the {wire.MAX_HEADER_BYTES}-byte limit"),
    ([msgpack.packb([1, 2])], "header must be a map, got list"),
    ([msgpack.packb(header(v=2))], "protocol version 2, this service speaks 1"),
    ([msgpack.packb(header(v=DROP))], "protocol version None"),
    ([msgpack.packb(header(v=True))], "protocol version True"),
    ([msgpack.packb(header(type="bogus"))], "unknown message type 'bogus' .known: error, hello_actor"),
    ([msgpack.packb(header(type=["sample"]))], "header 'type' must be a str, got list"),
    ([msgpack.packb(header(type=DROP))], "header 'type' must be a str, got NoneType"),
    ([msgpack.packb(header(seq="7"))], "header needs 'seq' \\(int\\) and 'from' \\(str\\)"),
    ([msgpack.packb(header(seq=True))], "header needs 'seq' \\(int\\)"),
    ([msgpack.packb(header(**{"from": 3}))], "'from' \\(str\\)"),
    ([msgpack.packb(header(body=[1]))], "'sample' message: body must be a map"),
    ([msgpack.packb(header(arrays="x"))], "'sample' message: header lists \\? arrays but 0 extra frames came"),
    ([msgpack.packb(header()), b"12345678"], "'sample' message: header lists 0 arrays but 1 extra frames came"),
    ([msgpack.packb(header(arrays=[{"dtype": "<f8", "shape": [1]}]))], "header lists 1 arrays but 0 extra frames"),
    ([msgpack.packb(header(arrays=[{"dtype": "<f8", "shape": [3]}])), b"\x00" * 23],
     "array frame has 23 bytes, spec .* needs 24"),
    ([msgpack.packb(header(arrays=[{"dtype": "<f8", "shape": []}])), b""], "array frame has 0 bytes, .* needs 8"),
])
def test_bad_frames_are_rejected_naming_the_fault(frames, message):
    with pytest.raises(wire.WireError, match=message):
        wire.unpack(frames)


@pytest.mark.parametrize("spec", [
    {"dtype": "|O", "shape": [1]},
    {"dtype": "<f8,|O", "shape": [1]},  # object hidden in a record
    {"dtype": "|S0", "shape": [3]},
    {"dtype": "zz", "shape": [1]},
    {"dtype": "<f8", "shape": [-1, -1]},
    {"dtype": "<f8", "shape": [True]},
    {"dtype": "<f8", "shape": [1.0]},
    {"dtype": "<f8", "shape": "1"},
    {"dtype": "<f8"},
    [1, 2],
])
def test_bad_array_specs_are_rejected(spec):
    frames = [msgpack.packb(header(arrays=[spec])), b"\x00" * 8]
    with pytest.raises(wire.WireError, match="'sample' message: bad array spec"):
        wire.unpack(frames)


def test_a_huge_shape_cannot_wrap_around_to_fit_the_frame():
    frames = [msgpack.packb(header(arrays=[{"dtype": "<f8", "shape": [2**32, 2**32, 2**32]}])), b""]
    with pytest.raises(wire.WireError, match="array frame has 0 bytes"):
        wire.unpack(frames)


@pytest.mark.parametrize("mtype,field", FIELDS)
def test_missing_field_is_rejected_on_both_ends(mtype, field):
    body = valid_body(mtype)
    del body[field]
    with pytest.raises(wire.WireError, match=f"'{mtype}' message: missing field '{field}'"):
        wire.pack(mtype, body, "s", 1)
    with pytest.raises(wire.WireError, match=f"'{mtype}' message: missing field '{field}'"):
        wire.unpack([msgpack.packb(header(type=mtype, body=body))])


@pytest.mark.parametrize("mtype,field", FIELDS)
def test_wrong_field_type_is_rejected_on_both_ends(mtype, field):
    types = wire.SCHEMAS[mtype][field]
    body = {**valid_body(mtype), field: WRONG[types[0]]}
    message = f"'{mtype}' message: field '{field}' must be {'/'.join(t.__name__ for t in types)}, got"
    with pytest.raises(wire.WireError, match=message):
        wire.pack(mtype, body, "s", 1)
    with pytest.raises(wire.WireError, match=message):
        wire.unpack([msgpack.packb(header(type=mtype, body=body))])


@pytest.mark.parametrize("mtype,field", INT_FIELDS)
def test_bool_is_not_an_int(mtype, field):
    body = {**valid_body(mtype), field: True}
    with pytest.raises(wire.WireError, match=f"field '{field}' must be int, got bool"):
        wire.unpack([msgpack.packb(header(type=mtype, body=body))])


INT_RANGE_CASES = [(t, f, v) for t, f in INT_FIELDS for v in (wire.INT_RANGES[f][0] - 1, wire.INT_RANGES[f][1] + 1,
                                                             2**64 - 1, -2**63)
                   if not wire.INT_RANGES[f][0] <= v <= wire.INT_RANGES[f][1]]


@pytest.mark.parametrize("mtype,field,value", INT_RANGE_CASES)
def test_ints_outside_their_range_are_rejected_naming_field_and_range(mtype, field, value):
    body = {**valid_body(mtype), field: value}
    with pytest.raises(wire.WireError, match=f"'{mtype}' message: field '{field}' = {value} is outside"):
        wire.unpack([msgpack.packb(header(type=mtype, body=body))])


def test_every_int_field_has_a_range():
    assert {f for _, f in INT_FIELDS} <= set(wire.INT_RANGES)


@pytest.mark.parametrize("mtype,field,value,message", [
    ("segment", "episodes", [[1.0]], r"episodes\[0\] = \[1.0\] must be \[return, length"),
    ("segment", "episodes", [[1.0, 2, 3, 4]], r"episodes\[0\]"),
    ("segment", "episodes", [[1.0, 2, -1]], r"episodes\[0\]"),  # a self-play opponent's version is >= 0
    ("segment", "episodes", [[1.0, 2, 3.0]], r"episodes\[0\]"),
    ("segment", "episodes", [5.0], r"episodes\[0\] = 5.0"),
    ("segment", "episodes", [[1.0, 0]], r"episodes\[0\] = \[1.0, 0\]"),  # length must be positive
    ("segment", "episodes", [[1.0, 3], [float("nan"), 3]], r"episodes\[1\] = \[nan, 3\]"),
    ("sampled", "episodes", [[float("inf"), 3]], r"episodes\[0\]"),
    ("sampled", "episodes", [[1e308, 3]] * 100, r"episodes\[0\]"),  # a mean of these is inf
    ("sampled", "episodes", [[True, 3]], r"episodes\[0\]"),
    ("sampled", "episodes", [[1.0, 2.5]], r"episodes\[0\]"),
    ("sampled", "episodes", [[1.0, 1]] * (wire.MAX_EPISODES + 1), "field .episodes. has 65537 entries, want 0..65536"),
    ("priorities", "keys", [2**64 - 1], r"keys\[0\] = 18446744073709551615 must be an int"),
    ("priorities", "keys", [-1], r"keys\[0\] = -1"),
    ("priorities", "priorities", [float("nan")], r"priorities\[0\] = nan must be a finite number"),
    ("priorities", "priorities", [-1.0], r"priorities\[0\] = -1.0"),
    ("sampled", "obs_sum", [float("nan")], r"obs_sum\[0\] = nan must be a finite number"),
    ("sampled", "obs_sumsq", [-2.0], r"obs_sumsq\[0\] = -2.0 must be a finite number >= 0"),
    ("hello_actor", "slots", [None], r"slots\[0\] = None must be a descriptor map"),
    ("hello_reader", "slots", [{}] * (wire.MAX_DESCRIPTORS + 1), "field .slots. has 17 entries, want 1..16"),
    ("hello_reader", "slots", [], "field .slots. has 0 entries, want 1..16"),  # took the reader role before
])
def test_hostile_list_values_are_rejected(mtype, field, value, message):
    body = {**valid_body(mtype), field: value}
    if mtype == "priorities":
        body.update({f: [0] * len(value) for f in ("keys", "generations", "priorities") if f != field})
    with pytest.raises(wire.WireError, match=f"'{mtype}' message: {message}"):
        wire.unpack([msgpack.packb(header(type=mtype, body=body))])


def test_priority_lists_of_different_lengths_are_rejected():
    body = {"keys": [1, 2], "generations": [1], "priorities": [1.0, 2.0]}
    with pytest.raises(wire.WireError, match="keys, generations, priorities must have one length"):
        wire.unpack([msgpack.packb(header(type="priorities", body=body))])


def test_observation_sums_of_different_lengths_are_rejected():
    body = {**valid_body("sampled"), "obs_count": 4, "obs_sum": [1.0, 2.0], "obs_sumsq": [3.0]}
    with pytest.raises(wire.WireError, match="obs_sum, obs_sumsq must have one length"):
        wire.unpack([msgpack.packb(header(type="sampled", body=body))])


@pytest.mark.parametrize("dtype", ["(2,)<f8", "<f8,<i4", "|V8"])
def test_sub_array_and_record_dtypes_are_rejected(dtype):
    frames = [msgpack.packb(header(arrays=[{"dtype": dtype, "shape": [1]}])), b"\x00" * 16]
    with pytest.raises(wire.WireError, match="bad array spec"):
        wire.unpack(frames)


def test_pack_rejects_unknown_type():
    with pytest.raises(wire.WireError, match="unknown message type 'bogus'"):
        wire.pack("bogus", {}, "s", 1)


@settings(max_examples=150, deadline=None)
@given(frames=st.lists(st.binary(max_size=64), max_size=3))
def test_random_bytes_never_raise_anything_but_wire_error(frames):
    try:
        wire.unpack(frames)
    except wire.WireError:
        pass


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(["v", "type", "from", "seq", "body", "arrays"]), value=JSONISH,
       extra=st.lists(st.binary(max_size=16), max_size=2))
def test_corrupted_headers_never_raise_anything_but_wire_error(key, value, extra):
    # A receiving service catches WireError only; anything else would kill it.
    h = header(arrays=[{"dtype": "<f8", "shape": [1]}] * len(extra))
    h[key] = value
    try:
        wire.unpack([msgpack.packb(h)] + extra)
    except wire.WireError:
        pass


# ---------------------------------------------------------------- sockets


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # closes whatever a failed test left open, then terms


@pytest.fixture
def address(tmp_path):
    return f"ipc://{tmp_path}/ep"


def test_router_drops_garbage_and_serves_the_next_valid_message(ctx, address, caplog):
    bad = []
    server = Endpoint(ctx, zmq.ROUTER, address, bind=True, name="server", on_bad=bad.append)
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.IDENTITY, b"raw")
    raw.connect(address)
    raw.send_multipart([b"\xc1\xc1garbage"])
    raw.send_multipart([msgpack.packb(header(v=99))])
    raw.send_multipart([msgpack.packb(header(type=["sample"]))])
    raw.send_multipart([b""])
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    raw.send_multipart(wire.pack("sample", {"slot": 2, "n": 5, "min_version": 0}, "raw", 1, [arr]), copy=False)
    got = server.recv(timeout_ms=5000)
    assert got is not None
    peer, msg = got
    assert peer == b"raw" and (msg.type, msg.body, msg.seq) == ("sample", {"slot": 2, "n": 5, "min_version": 0}, 1)
    np.testing.assert_array_equal(msg.arrays[0], arr)
    assert bad == ["wire"] * 4
    logged = [r.getMessage() for r in caplog.records]
    assert "not valid msgpack" in logged[0] and "protocol version 99" in logged[1]
    assert "'type' must be a str" in logged[2] and "not valid msgpack" in logged[3]
    server.send("sampled", {"slot": 2, "n": 5, "env_steps": 3, "episodes": [], "dropped": 0, "replay_size": 5, "obs_count": 0,
                            "obs_sum": [], "obs_sumsq": []}, to=peer)
    replies = []
    while len(replies) < 5 and raw.poll(5000):
        replies.append(wire.unpack(raw.recv_multipart()))
    assert [r.type for r in replies] == ["error"] * 4 + ["sampled"]  # each bad message answered, naming the fault
    assert replies[1].body["reason"] == "bad message: protocol version 99, this service speaks 1"
    assert (replies[4].sender, replies[4].seq, replies[4].body["env_steps"]) == ("server", 5, 3)
    raw.send_multipart([b"junk"])
    assert server.recv(timeout_ms=50) is None and len(bad) == 5  # garbage alone: a bounded wait, no message
    raw.close(linger=0)
    server.close()


def test_drain_takes_at_most_its_bound_and_leaves_the_rest_queued_in_order(ctx, address):
    server = Endpoint(ctx, zmq.ROUTER, address, bind=True, name="server")
    client = Endpoint(ctx, zmq.DEALER, address, bind=False, name="sampler0")
    for n in range(1, 26):
        client.send("sample", {"slot": 0, "n": n, "min_version": 0})
    got = [server.recv(timeout_ms=5000)]
    turns = 0
    deadline = time.monotonic() + 5
    while len(got) < 25 and time.monotonic() < deadline:
        batch = server.drain(most=10)
        assert len(batch) <= 10
        got += batch
        turns += len(batch) > 0
    assert [msg.body["n"] for _, msg in got] == list(range(1, 26)) and turns >= 3
    client.close()
    server.close()


def test_dealer_reconnect_gets_a_fresh_socket_that_still_reaches_the_router(ctx, address):
    server = Endpoint(ctx, zmq.ROUTER, address, bind=True, name="server")
    client = Endpoint(ctx, zmq.DEALER, address, bind=False, name="sampler0")
    client.send("sample", {"slot": 0, "n": 1, "min_version": 0})
    peer, msg = server.recv(timeout_ms=5000)
    assert peer == client.identity and peer.startswith(b"sampler0.") and msg.seq == 1
    server.send("sampled", {"slot": 0, "n": 1, "env_steps": 1, "episodes": [], "dropped": 0, "replay_size": 1, **NO_MOMENTS}, to=peer)
    assert client.sock.poll(5000)  # a reply is queued on the old socket...
    old = client.sock
    client.reconnect()
    assert old.closed and client.sock is not old
    assert client.recv(timeout_ms=50) is None  # ...and went with it
    client.send("sample", {"slot": 0, "n": 2, "min_version": 0})
    peer, msg = server.recv(timeout_ms=5000)
    assert peer == client.identity and (msg.body["n"], msg.seq) == (2, 2)  # same route, sequence numbers go on
    server.send("sampled", {"slot": 0, "n": 2, "env_steps": 2, "episodes": [], "dropped": 0, "replay_size": 2, **NO_MOMENTS}, to=peer)
    got = client.recv(timeout_ms=5000)
    assert got is not None and got[1].body == {"slot": 0, "n": 2, "env_steps": 2, "episodes": [], "dropped": 0, "replay_size": 2, **NO_MOMENTS}
    client.close()
    server.close()


def test_a_peer_that_claims_a_name_cannot_take_its_route(ctx, address):
    server = Endpoint(ctx, zmq.ROUTER, address, bind=True, name="server")
    client = Endpoint(ctx, zmq.DEALER, address, bind=False, name="sampler0")
    assert client.identity != Endpoint(ctx, zmq.DEALER, address, bind=False, name="sampler0").identity
    client.send("segment", {"index": 0, "serial": 1, "steps": 8, "episodes": [], "version_min": 0, "version_max": 0})
    peer, _ = server.recv(timeout_ms=5000)
    thief = ctx.socket(zmq.DEALER)
    thief.setsockopt(zmq.LINGER, 0)
    thief.setsockopt(zmq.IDENTITY, b"sampler0")  # the name the old code used as routing id
    thief.connect(address)
    thief.send_multipart(wire.pack("release", {"index": 9}, "sampler0", 1))
    assert server.recv(timeout_ms=5000)[0] == b"sampler0"  # another route, not the sampler's
    server.send("release", {"index": 0}, to=peer)
    assert client.recv(timeout_ms=5000)[1].body == {"index": 0}
    assert not thief.poll(100)
    thief.close(linger=0)


def test_serve_answers_and_counts_whatever_one_message_raises_and_goes_on(ctx, address):
    bad = []
    server = Endpoint(ctx, zmq.ROUTER, address, bind=True, name="server", on_bad=bad.append)
    client = Endpoint(ctx, zmq.DEALER, address, bind=False, name="c")
    handled = []

    def handler(peer, msg):
        if msg.body["slot"] == 1:
            raise Rejected("value", "slot 1 is not yours")
        if msg.body["slot"] == 2:
            raise OverflowError("Python int too large to convert to C long")
        handled.append(msg.body["n"])

    for slot in (1, 2, 2, 0):
        client.send("sample", {"slot": slot, "n": slot + 10, "min_version": 0})
    for _ in range(4):
        server.serve(handler, *server.recv(timeout_ms=5000))
    assert handled == [10] and bad == ["value", "internal", "internal"]
    replies = [client.recv(timeout_ms=5000)[1] for _ in range(3)]
    assert [r.type for r in replies] == ["error"] * 3
    assert replies[0].body["reason"] == "sample: slot 1 is not yours"
    assert replies[1].body["reason"] == "sample: OverflowError: Python int too large to convert to C long"


def test_frames_over_the_size_limit_are_dropped_by_zeromq(ctx, address, monkeypatch):
    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 4096)
    monkeypatch.setattr(wire, "MAX_HEADER_BYTES", 4096)
    server = Endpoint(ctx, zmq.ROUTER, address, bind=True, name="server")
    assert server.sock.getsockopt(zmq.MAXMSGSIZE) == 4096
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    raw.send_multipart([b"x" * 10_000])
    assert server.recv(timeout_ms=300) is None  # ZeroMQ closed that connection instead of buffering it
    client = Endpoint(ctx, zmq.DEALER, address, bind=False, name="c")
    client.send("release", {"index": 1})
    assert server.recv(timeout_ms=5000)[1].body == {"index": 1}
    raw.close(linger=0)


def test_a_topic_prefixes_its_type_and_no_other():
    """SUB sockets subscribe by these prefixes: params announcements and params_data frames apart."""
    announce = wire.pack("params", {"version": 1, "segment": {}, "env_steps": 0}, "learner0", 7)[0]
    data = wire.pack("params_data", {"version": 1, "env_steps": 0}, "learner0", 8, [np.zeros(2, np.float32)])[0]
    assert announce.startswith(wire.topic("params")) and not announce.startswith(wire.topic("params_data"))
    assert data.startswith(wire.topic("params_data")) and not data.startswith(wire.topic("params"))


def test_a_handler_failure_is_answered_and_the_service_goes_on_but_no_space_ends_it(ctx, address):
    """Any exception of one message's handler is that message's error reply; a segment /dev/shm
    cannot hold (shm.NoSpace) is not: no message can be served without it, so it ends the service
    (which prints its one line: services/process.py)."""
    from shared.transport import shm

    bad = []
    server = Endpoint(ctx, zmq.ROUTER, address, bind=True, name="server", on_bad=bad.append)
    client = Endpoint(ctx, zmq.DEALER, address, bind=False, name="sampler0")
    msg = wire.Message("sample", {"slot": 0, "n": 1, "min_version": 0}, "sampler0", 1, [])

    def broken(peer, msg):
        raise KeyError("a bug")

    server.serve(broken, b"sampler0", msg)
    assert bad == ["internal"]

    def no_room(peer, msg):
        raise shm.NoSpace("shared-memory segment x needs 9.0 MiB, /dev/shm has 1.0 MiB free of 64.0 MiB")

    with pytest.raises(shm.NoSpace):
        server.serve(no_room, b"sampler0", msg)
    assert bad == ["internal"]
    client.close()
    server.close()
