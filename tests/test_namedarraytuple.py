"""namedarraytuple: one indexing syntax over nested numpy/torch leaves, on the heap and in
shared memory; specs that round-trip through msgpack and rebuild the same structure."""

import copy
import keyword
import uuid
from collections import namedtuple

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.transport import shm
from shared.data.namedarraytuple import buffer_from_example, from_spec, leaves, map_leaves, namedarraytuple, numpify, spec_of, torchify, validate_spec, with_leading_dims

torch.set_num_threads(1)

T, B = 5, 3
Obs = namedarraytuple("Obs", ["image", "vector"])
Step = namedarraytuple("Step", ["obs", "action", "reward", "done", "info"])
EXAMPLE = Step(
    obs=Obs(image=np.zeros((2, 3), np.uint8), vector=np.zeros(4, np.float32)),
    action=np.zeros(2, np.int64),
    reward=np.float32(0),
    done=np.bool_(False),
    info=None,  # an optional part this agent does not produce
)
RUN = "t" + uuid.uuid4().hex[:8]  # module-scoped buffers live in this run's segments
BACKENDS = ["from_spec", "buffer_from_example", "shm", "torch", "torch_shm"]


def as_numpy(x) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def snapshot(tree):
    """A heap copy of ``tree`` with numpy leaves (the reference the tests update by hand)."""
    return map_leaves(lambda a: np.array(as_numpy(a)), tree)


def random_like(rng: np.random.Generator, a) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == np.bool_:
        return rng.random(a.shape) < 0.5
    if a.dtype.kind in "iu":
        return rng.integers(0 if a.dtype.kind == "u" else -100, 100, size=a.shape).astype(a.dtype)
    return rng.standard_normal(a.shape).astype(a.dtype)


def assert_same_values(tree, ref) -> None:
    got, want = list(leaves(tree)), list(leaves(ref))
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, g), (_, w) in zip(got, want):
        g = as_numpy(g)
        assert g.dtype == w.dtype and g.shape == w.shape, path
        np.testing.assert_array_equal(g, w, err_msg=path)


def is_torch(tree) -> bool:
    return isinstance(next(iter(leaves(tree)))[1], torch.Tensor)


def indices(torch_leaves: bool):
    """Basic indices over the leading [T, B] dims: ints, slices and (t, b) tuples of both."""
    # torch slicing has no negative steps; numpy leaves get them too.
    positive = (lambda s: s.step is None or s.step > 0) if torch_leaves else (lambda s: True)
    t_int, b_int = st.integers(-T, T - 1), st.integers(-B, B - 1)
    t_sl, b_sl = st.slices(T).filter(positive), st.slices(B).filter(positive)
    return st.one_of(t_int, t_sl, st.tuples(t_int, b_sl), st.tuples(t_sl, b_sl),
                     st.tuples(t_int, b_int), st.tuples(t_sl, b_int))


@pytest.fixture(scope="module", params=BACKENDS)
def buf(request):
    """A [T, B] buffer of EXAMPLE steps, holding distinct values, in each backing."""
    spec = with_leading_dims(spec_of(EXAMPLE), [T, B])
    seg = None
    if request.param.endswith("shm"):
        seg, tree, _ = shm.allocate(shm.segment_name(RUN, "test", 0, "buf"), spec)
    elif request.param == "buffer_from_example":
        tree = buffer_from_example(EXAMPLE, [T, B])
    else:
        tree = from_spec(spec)
    for k, (_, a) in enumerate(leaves(tree)):
        a[...] = (np.arange(a.size).reshape(a.shape) + 7 * k) % 100
    yield torchify(tree) if request.param.startswith("torch") else tree
    if seg is not None:
        seg.unlink()
        seg.close()
    assert not shm.run_segments(RUN)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_get_indexes_every_leaf_alike(buf, data):
    idx = data.draw(indices(is_torch(buf)), label="idx")
    ref = snapshot(buf)
    sub = buf[idx]
    assert type(sub) is Step and type(sub.obs) is Obs and sub.info is None
    want = map_leaves(lambda a: np.asarray(a[idx]), ref)
    assert_same_values(sub, want)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_set_from_structure_writes_exactly_the_indexed_elements(buf, data):
    idx = data.draw(indices(is_torch(buf)), label="idx")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    ref = snapshot(buf)
    src = map_leaves(lambda a: random_like(rng, a), ref[idx])
    buf[idx] = torchify(src) if is_torch(buf) else src
    for (_, r), (_, s) in zip(leaves(ref), leaves(src)):
        r[idx] = s
    assert_same_values(buf, ref)


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_set_scalar_broadcasts_to_every_leaf(buf, data):
    idx = data.draw(indices(is_torch(buf)), label="idx")
    value = data.draw(st.integers(0, 99), label="value")
    ref = snapshot(buf)
    buf[idx] = value
    for _, r in leaves(ref):
        r[idx] = value
    assert_same_values(buf, ref)


def test_get_gives_views_that_write_through(buf):
    buf[1] = 0
    sub = buf[1, 0:2]
    sub.obs.image[...] = 9
    sub.reward[...] = 0.5
    assert (as_numpy(buf.obs.image[1, 0:2]) == 9).all()
    assert (as_numpy(buf.reward[1, 0:2]) == 0.5).all()
    assert (as_numpy(buf.obs.image[1, 2]) == 0).all() and as_numpy(buf.reward[1, 2]) == 0  # the rest untouched


def test_field_access_by_name(buf):
    assert buf["obs"] is buf.obs and buf["obs"]["vector"] is buf.obs.vector
    assert "obs" in buf and "nope" not in buf
    assert buf.get("nope") is None
    assert dict(buf.items())["action"] is buf.action


def test_none_fields_are_skipped():
    dest = buffer_from_example(EXAMPLE, [T, B])
    src = snapshot(dest[0])._replace(info=np.ones(3), reward=np.full(B, 2.0, np.float32))
    dest[0] = src  # dest.info is None: the source's info has nowhere to go and is ignored
    assert dest.info is None and dest[0].info is None
    np.testing.assert_array_equal(dest.reward[0], [2.0] * B)
    with pytest.raises(ValueError, match=r"Step\.reward: source is None"):
        dest[1] = src._replace(reward=None)


@pytest.mark.parametrize("other", [
    namedarraytuple("Obs", ["image", "vec"]),  # same type name, other fields
    namedtuple("Plain", ["image", "vector", "extra"]),
])
def test_set_from_structure_with_other_fields_raises(other):
    dest = buffer_from_example(EXAMPLE, [T, B])
    before = snapshot(dest)
    values = [np.ones(1)] * len(other._fields)
    with pytest.raises(ValueError, match=r"Obs: cannot set from \w+ with fields .*expected \('image', 'vector'\)"):
        dest.obs[0] = other(*values)
    with pytest.raises(ValueError, match=r"Step: cannot set from .*expected \('obs', 'action', 'reward', 'done', 'info'\)"):
        dest[0] = Obs(np.ones(1), np.ones(1))
    assert_same_values(dest, before)


def test_field_names_that_hide_methods_are_rejected():
    with pytest.raises(ValueError, match=r"\['get', 'items'\] would be hidden"):
        namedarraytuple("Bad", ["items", "get", "ok"])


def test_buffer_from_example_shapes_dtypes_and_sentinels():
    example = Step(Obs(np.zeros((2, 3), np.uint8), np.zeros(4, np.float32)), np.zeros(2, np.int64), 0.0, False, None)
    buf = buffer_from_example(example, [T, B])
    layout = {p: (a.dtype, a.shape) for p, a in leaves(buf)}
    assert layout == {
        "obs.image": (np.uint8, (T, B, 2, 3)),
        "obs.vector": (np.float32, (T, B, 4)),
        "action": (np.int64, (T, B, 2)),
        "reward": (np.float64, (T, B)),  # a python float is float64
        "done": (np.bool_, (T, B)),
    }
    assert buf.info is None
    assert (buf.obs.image == 0).all() and not buf.done.any()
    assert (buf.obs.vector == np.float32(-42.42)).all() and (buf.reward == -42.42).all()
    assert (buf.action == -1).all()


@pytest.mark.parametrize("dtype,sentinel", [
    ("<f2", -42.42), ("<f4", -42.42), ("<f8", -42.42),
    ("|i1", -1), ("<i4", -1), ("<i8", -1), ("|u1", 0), ("<u8", 0), ("|b1", False),
])
@pytest.mark.parametrize("backing", ["heap", "shm"])
def test_sentinel_fill(dtype, sentinel, backing, run_id):
    spec = {"type": "One", "fields": [["x", {"dtype": dtype, "shape": [3, 2]}]]}
    if backing == "shm":
        name = shm.segment_name(run_id, "test", 0, "fill")
        shm.Segment.create(name, 1024).mmap.write(b"\x5a" * 1024)  # a stale segment full of junk
        seg, tree, _ = shm.allocate(name, spec)
    else:
        tree = from_spec(spec)
    assert tree.x.dtype == np.dtype(dtype)
    assert (tree.x == np.dtype(dtype).type(sentinel)).all()
    if backing == "shm":
        seg.unlink()


def test_torchify_shares_memory_and_numpify_copies_back(run_id):
    spec = with_leading_dims(spec_of(EXAMPLE), [T, B])
    seg, arrays, desc = shm.allocate(shm.segment_name(run_id, "test", 0, "torch"), spec)
    tensors = torchify(arrays)
    tensors.obs.vector[2, 1] = torch.arange(4.0)
    tensors[3] = 1
    peer_seg, peer = shm.attach(desc, shm.Owner(run_id, "test", 0))  # a second mapping, as another process would have
    np.testing.assert_array_equal(peer.obs.vector[2, 1], [0, 1, 2, 3])
    assert (peer.obs.image[3] == 1).all() and peer.done[3].all()
    assert_same_values(numpify(tensors), snapshot(arrays))
    del tensors, arrays, peer
    peer_seg.close()
    seg.unlink()
    seg.close()


# ---------------------------------------------------------------- specs

DTYPES = ["<f2", "<f4", "<f8", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "|b1"]
NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,5}", fullmatch=True).filter(
    lambda n: not keyword.iskeyword(n) and n not in ("get", "items"))
LEAF = st.builds(lambda d, s: {"dtype": d, "shape": s}, st.sampled_from(DTYPES), st.lists(st.integers(0, 4), max_size=3))


def structures(children):
    fields = st.lists(st.tuples(NAMES, children), min_size=1, max_size=4, unique_by=lambda f: f[0])
    return st.builds(lambda t, fs: {"type": t, "fields": [[n, c] for n, c in fs]},
                     st.sampled_from(["A", "Obs", "Step"]), fields)


SPECS = structures(st.recursive(LEAF | st.none(), structures, max_leaves=8))


@settings(max_examples=60, deadline=None)
@given(spec=SPECS)
def test_spec_round_trips_through_msgpack_and_from_spec(spec):
    validate_spec(spec)
    assert msgpack.unpackb(msgpack.packb(spec)) == spec
    tree = from_spec(spec)
    assert spec_of(tree) == spec
    for path, a in leaves(tree):
        sentinel = {"f": -42.42, "i": -1}.get(a.dtype.kind, 0)  # unsigned, bool, complex: 0
        assert (a == a.dtype.type(sentinel)).all(), path
    lead = with_leading_dims(spec, [T, B])
    validate_spec(lead)
    assert [a.shape for _, a in leaves(from_spec(lead))] == [(T, B) + a.shape for _, a in leaves(tree)]


@settings(max_examples=25, deadline=None)
@given(spec=SPECS)
def test_spec_in_shared_memory_has_aligned_disjoint_leaves(spec):
    name = shm.segment_name(RUN, "test", 0, "spec")
    seg, tree, desc = shm.allocate(name, spec)
    try:
        assert spec_of(tree) == spec
        spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for _, a in leaves(tree) if a.nbytes)
        assert all(start % 64 == 0 for start, _ in spans)
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
        peer_seg, peer = shm.attach(msgpack.unpackb(msgpack.packb(desc)), shm.Owner(RUN, "test", 0))
        assert spec_of(peer) == spec
        del peer
        peer_seg.close()
    finally:
        seg.unlink()
        del tree
        seg.close()
    assert not (shm.SHM_DIR / name).exists()


def _set(path, value):
    """A change to a deep copy of spec_of(EXAMPLE) at ``path`` (field names; None deletes)."""
    def change(spec):
        node = spec
        for name in path[:-1]:
            node = dict(node["fields"])[name] if "fields" in node else node[name]
        if value is None:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        return spec
    return change


def _replace_field(parent, index, item):
    def change(spec):
        node = spec if parent is None else dict(spec["fields"])[parent]
        node["fields"][index] = item
        return spec
    return change


@pytest.mark.parametrize("change,message", [
    (_set(["obs", "image", "dtype"], None), r"spec\.obs\.image: bad or missing dtype"),
    (_set(["obs", "image", "dtype"], "float99"), r"spec\.obs\.image: bad or missing dtype"),
    (_set(["obs", "image", "dtype"], "|O"), r"spec\.obs\.image: bad or missing dtype"),
    (_set(["obs", "image", "dtype"], 4), r"spec\.obs\.image: bad or missing dtype"),
    (_set(["obs", "vector", "shape"], [-1]), r"spec\.obs\.vector: shape must be a list of non-negative ints"),
    (_set(["obs", "vector", "shape"], [True]), r"spec\.obs\.vector: shape must be"),
    (_set(["obs", "vector", "shape"], [4.0]), r"spec\.obs\.vector: shape must be"),
    (_set(["obs", "vector", "shape"], "4"), r"spec\.obs\.vector: shape must be"),
    (_set(["obs", "vector", "shape"], None), r"spec\.obs\.vector: shape must be"),
    (_replace_field(None, 1, ["action", [1, 2]]), r"spec\.action: expected a mapping, got list"),
    (_set(["obs", "type"], None), r"spec\.obs: a structure needs 'type'"),
    (_set(["obs", "type"], "1Obs"), r"spec\.obs: a structure needs 'type'"),
    (_set(["obs", "fields"], {"image": None}), r"spec\.obs: a structure needs .*'fields' \(list\)"),
    (_replace_field("obs", 0, ["image"]), r"spec\.obs: each field must be \[name, spec\]"),
    (_replace_field("obs", 0, ["1image", None]), r"spec\.obs: each field must be"),
    (_replace_field("obs", 0, ["_image", None]), r"spec\.obs: each field must be"),
    (_replace_field("obs", 0, ["class", None]), r"spec\.obs: each field must be"),
    (_replace_field("obs", 0, ["items", None]), r"spec\.obs: each field must be"),
])
def test_validate_spec_rejects_malformed_specs_naming_the_path(change, message):
    spec = change(copy.deepcopy(spec_of(EXAMPLE)))
    with pytest.raises(ValueError, match=message):
        validate_spec(spec)
