"""Named shared-memory segments: shared between unrelated processes by name, stale ones
replaced, a run's segments cleaned exactly, the owner's unlinked at exit (also on SIGTERM)."""

import os
import selectors
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import numpy as np
import pytest

from shared.transport import shm
from shared.data.namedarraytuple import namedarraytuple, spec_of, with_leading_dims

REPO = Path(__file__).resolve().parents[1]
Obs = namedarraytuple("Obs", ["image", "vector"])
SPEC = with_leading_dims(spec_of(Obs(np.zeros((2, 3), np.uint8), np.zeros(4, np.float64))), [4, 2])


def spawn(code: str, *args: str) -> subprocess.Popen:
    """A fresh interpreter (nothing inherited but the environment) running ``code``."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_line(proc: subprocess.Popen, timeout_s: float = 30.0) -> str:
    """The child's next stdout line, failing (with its stderr) if none comes in time."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if sel.select(timeout_s):
            line = proc.stdout.readline()
            if line:
                return line.strip()
    proc.kill()
    pytest.fail(f"child printed nothing; stderr:\n{proc.communicate(timeout=10)[1]}")


def finish(proc: subprocess.Popen, timeout_s: float = 30.0) -> tuple[int, str]:
    """Wait for the child (killing it if it overstays); return (exit code, stderr)."""
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


def test_peer_process_attaches_by_name_and_sees_writes_both_ways(run_id):
    seg, obs, desc = shm.allocate(shm.segment_name(run_id, "test", 0, "obs"), SPEC)
    obs.image[...] = np.arange(obs.image.size).reshape(obs.image.shape) % 256
    obs.vector[1, 0] = [0.5, 1.5, 2.5, 3.5]
    expected = f"{int(obs.image.sum())} 8.0"  # before the child writes
    child = spawn("""
        import sys, msgpack
        from shared.transport import shm
        seg, obs = shm.attach(msgpack.unpackb(bytes.fromhex(sys.argv[1])), shm.Owner(sys.argv[2], "test", 0))
        print(int(obs.image.sum()), float(obs.vector[1, 0].sum()), flush=True)
        obs.vector[3, 1] = 7.25   # the owner must see this without re-attaching
        obs.image[0, 0, 1] = 99
    """, msgpack.packb(desc).hex(), run_id)
    try:
        assert read_line(child) == expected
        code, err = finish(child)
        assert code == 0, err
    finally:
        child.kill()
    assert (obs.vector[3, 1] == 7.25).all() and (obs.image[0, 0, 1] == 99).all()
    assert (shm.SHM_DIR / seg.name).exists()  # a peer's exit does not unlink the owner's segment
    seg.unlink()
    assert not (shm.SHM_DIR / seg.name).exists()
    seg.close()


def test_owner_process_segment_is_attached_here_and_unlinked_at_its_exit(run_id):
    name = shm.segment_name(run_id, "test", 0, "obs")
    child = spawn("""
        import sys, msgpack
        from shared.transport import shm
        from shared.data.namedarraytuple import spec_of
        seg, obs, desc = shm.allocate(sys.argv[1], msgpack.unpackb(bytes.fromhex(sys.argv[2])))
        obs.vector[...] = 3.0
        print(msgpack.packb(desc).hex(), flush=True)
        sys.stdin.readline()      # the test wrote into the segment meanwhile
        sys.exit(0 if (obs.image[2] == 5).all() and (obs.vector[2] == 3.0).all() else 3)
    """, name, msgpack.packb(SPEC).hex())
    try:
        desc = msgpack.unpackb(bytes.fromhex(read_line(child)))
        seg, obs = shm.attach(desc, shm.Owner(run_id, "test", 0))
        assert (obs.vector == 3.0).all() and (obs.image == 0).all()  # uint8 sentinel is 0
        obs.image[2] = 5
        child.stdin.write("go\n")
        child.stdin.flush()
        code, err = finish(child)
    finally:
        child.kill()
    assert code == 0, err
    assert not (shm.SHM_DIR / name).exists()  # the owner's atexit unlinked it
    assert (obs.image[2] == 5).all()  # our mapping outlives the name
    del obs
    seg.close()


def test_sigterm_with_service_handlers_unlinks_at_exit(run_id):
    name = shm.segment_name(run_id, "test", 0, "obs")
    child = spawn("""
        import sys, time, msgpack
        from shared.transport import shm
        from shared.runtime.process import install_signal_handlers
        install_signal_handlers()
        shm.allocate(sys.argv[1], msgpack.unpackb(bytes.fromhex(sys.argv[2])))
        print("ready", flush=True)
        time.sleep(60)
    """, name, msgpack.packb(SPEC).hex())
    try:
        assert read_line(child, timeout_s=60) == "ready"
        assert (shm.SHM_DIR / name).exists()
        child.send_signal(signal.SIGTERM)
        code, err = finish(child)
    finally:
        child.kill()
    assert code == 128 + signal.SIGTERM, err
    assert not (shm.SHM_DIR / name).exists()


def test_create_replaces_a_stale_segment_left_by_a_killed_owner(run_id, caplog):
    name = shm.segment_name(run_id, "test", 0, "obs")
    child = spawn("""
        import sys, msgpack
        from shared.transport import shm
        seg, obs, desc = shm.allocate(sys.argv[1], msgpack.unpackb(bytes.fromhex(sys.argv[2])))
        obs.vector[...] = 1.0
        print(desc["nonce"], flush=True)
        sys.stdin.readline()
    """, name, msgpack.packb(SPEC).hex())
    try:
        old_nonce = int(read_line(child))
        child.kill()  # SIGKILL: no atexit, the segment stays
        child.wait(timeout=10)
    finally:
        child.kill()
    stale = shm.SHM_DIR / name
    assert stale.exists()
    old_inode = stale.stat().st_ino
    seg, obs, desc = shm.allocate(name, SPEC)
    assert stale.stat().st_ino != old_inode and desc["nonce"] != old_nonce
    assert (obs.vector == -42.42).all()  # fresh sentinels, not the dead owner's data
    assert "removing stale shared-memory segment" in caplog.text
    seg.unlink()
    seg.close()


def test_create_replaces_a_stale_file_of_another_size(run_id):
    name = shm.segment_name(run_id, "test", 0, "obs")
    (shm.SHM_DIR / name).write_bytes(b"\xff" * 10)
    seg, obs, _ = shm.allocate(name, SPEC)
    assert (shm.SHM_DIR / name).stat().st_size == seg.size >= obs.image.nbytes + obs.vector.nbytes
    assert (obs.image == 0).all()
    seg.unlink()
    seg.close()


def test_clean_removes_exactly_that_runs_segments(run_id):
    others = [run_id + "x", run_id + ".2", "x" + run_id]  # ids sharing a prefix or a suffix
    mine = [shm.segment_name(run_id, s, i, p) for s, i, p in [("sampler", 0, "ring"), ("sampler", 1, "slot0"),
                                                              ("learner", 0, "params")]]
    theirs = [shm.segment_name(r, "sampler", 0, "ring") for r in others]
    segs = [shm.Segment.create(n, 64) for n in mine + theirs]
    try:
        assert shm.clean(run_id) == sorted(mine)
        assert sorted(p.name for p in shm.SHM_DIR.glob(f"rlpipe-*{run_id}*")) == sorted(theirs)
        assert shm.clean(run_id) == []
    finally:
        for seg in segs:
            seg.unlink()
            seg.close()
    assert not any(shm.run_segments(r) for r in others)


@pytest.mark.parametrize("bad", ["a-b", "a*", "*", "", "a/b", "a b", "[ab]"])
def test_run_ids_that_could_match_other_runs_are_rejected(bad):
    # A '-' would let clean("a") take run "a-b"'s segments; glob characters, anyone's.
    with pytest.raises(ValueError, match="bad run id"):
        shm.clean(bad)
    with pytest.raises(ValueError, match="bad run id"):
        shm.segment_name(bad, "sampler", 0, "ring")


@pytest.mark.parametrize("name", [
    "seg", "rlpipe-", "rlpipe-run", "rlpipe-run-", "other-run-sampler0-ring", "rlpipe-run-a/b",
    "rlpipe-run-a b", "rlpipe-rün-x", "rlpipe-run-" + "x" * 250,
])
def test_bad_segment_names_are_rejected(name, run_id):
    before = set(os.listdir(shm.SHM_DIR))
    with pytest.raises(ValueError, match="bad shared-memory segment name"):
        shm.Segment.create(name, 64)
    with pytest.raises(ValueError, match="bad shared-memory segment name"):
        shm.Segment.attach(name)
    with pytest.raises(ValueError, match="bad shared-memory segment name"):
        shm.allocate(name, SPEC)
    assert set(os.listdir(shm.SHM_DIR)) <= before


def test_attach_errors_name_the_problem(run_id):
    name = shm.segment_name(run_id, "test", 0, "obs")
    with pytest.raises(FileNotFoundError, match=f"{name} does not exist"):
        shm.attach({"name": name, "nonce": 1, "spec": SPEC}, shm.Owner(run_id, "test", 0))
    with pytest.raises(ValueError, match="needs a 'name'"):
        shm.attach({"spec": SPEC}, shm.Owner(run_id, "test", 0))
    seg = shm.Segment.create(name, 64)
    with pytest.raises(ValueError, match=f"segment {name} has 64 bytes, its spec needs"):
        shm.attach({"name": name, "nonce": 1, "spec": SPEC}, shm.Owner(run_id, "test", 0))
    with pytest.raises(ValueError, match=r"descriptor\.spec\.image: bad or missing dtype"):
        shm.attach({"name": name, "nonce": 1, "spec": {"type": "Obs", "fields": [["image", {"dtype": "|O", "shape": [1]}]]}},
                   shm.Owner(run_id, "test", 0))
    seg.unlink()
    seg.close()


# ---------------------------------------------------------------- descriptors from peers


def test_a_symlink_named_like_a_runs_segment_is_refused_and_its_target_untouched(run_id, tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"keep me" * 100)
    name = shm.segment_name(run_id, "sampler", 0, "ring")
    (shm.SHM_DIR / name).symlink_to(target)
    try:
        with pytest.raises(ValueError, match=f"{name}: cannot open safely"):
            shm.attach({"name": name, "nonce": 1, "spec": SPEC}, shm.Owner(run_id, "sampler", 0))
    finally:
        (shm.SHM_DIR / name).unlink()
    assert target.read_bytes() == b"keep me" * 100


@pytest.mark.parametrize("name,owner", [
    ("rlpipe-{run}x-sampler0-ring", ("sampler", 0)),  # another run whose id starts like ours
    ("rlpipe-other-sampler0-ring", ("sampler", 0)),
    ("rlpipe-{run}-sampler1-ring", ("sampler", 0)),  # another sampler's
    ("rlpipe-{run}-learner0-params", ("sampler", 0)),  # another service's
    ("rlpipe-{run}-sampler0-ring", ("learner", None)),
    ("rlpipe-{run}-sampler01-ring", ("sampler", 0)),
])
def test_a_descriptor_must_name_a_segment_of_this_run_and_the_expected_owner(run_id, name, owner):
    name = name.format(run=run_id)
    with pytest.raises(ValueError, match="not this run's, or not the sender's own"):
        shm.attach({"name": name, "nonce": 1, "spec": SPEC}, shm.Owner(run_id, *owner))


def test_segments_not_plainly_ours_are_refused(run_id):
    owner = shm.Owner(run_id, "test", 0)
    seg, _, desc = shm.allocate(shm.segment_name(run_id, "test", 0, "obs"), SPEC)
    path = shm.SHM_DIR / seg.name
    try:
        link = shm.SHM_DIR / shm.segment_name(run_id, "test", 0, "link")
        os.link(path, link)
        with pytest.raises(ValueError, match="has 2 links"):
            shm.attach({**desc, "name": link.name}, owner)
        link.unlink()
        if os.getuid() == 0:  # only root can give a file away
            os.chown(path, 12345, -1)
            with pytest.raises(ValueError, match=f"belongs to uid 12345, not ours \\({os.getuid()}\\)"):
                shm.attach(desc, owner)
            os.chown(path, 0, -1)
        os.truncate(path, seg.size + 64)
        with pytest.raises(ValueError, match=f"has {seg.size + 64} bytes, its spec needs {seg.size}"):
            shm.attach(desc, owner)
        fifo = shm.SHM_DIR / shm.segment_name(run_id, "test", 0, "fifo")
        os.mkfifo(fifo)
        try:
            with pytest.raises(ValueError, match="is not a regular file"):
                shm.attach({**desc, "name": fifo.name}, owner)
        finally:
            fifo.unlink()
    finally:
        seg.unlink()
        seg.close()


@pytest.mark.parametrize("spec,message", [
    ({"dtype": "<f8", "shape": [2**20, 2**20]}, "needs 8796093022208 bytes, more than"),
    ({"dtype": "<f8", "shape": [2**32, 2**32, 2**32]}, "more than"),  # would wrap in int64
    ({"dtype": "<f8", "shape": [1] * 9}, "rank 9 exceeds 8"),
    ({"dtype": "(2,)<f8", "shape": [1]}, "bad or missing dtype"),
    ({"dtype": "<c16", "shape": [1]}, "bad or missing dtype"),
    ({"dtype": "|S8", "shape": [1]}, "bad or missing dtype"),
    ({"dtype": ">f8", "shape": [1]}, "bad or missing dtype"),
])
def test_spec_limits_are_checked_before_anything_is_opened(run_id, spec, message):
    name = shm.segment_name(run_id, "test", 0, "big")
    with pytest.raises(ValueError, match=message):
        shm.attach({"name": name, "nonce": 1, "spec": spec}, shm.Owner(run_id, "test", 0))


def test_a_spec_nested_too_deep_is_refused(run_id):
    spec = {"dtype": "<f4", "shape": [1]}
    for _ in range(40):
        spec = {"type": "A", "fields": [["a", spec]]}
    with pytest.raises(ValueError, match="nested deeper than 16 levels"):
        shm.attach({"name": shm.segment_name(run_id, "test", 0, "x"), "nonce": 1, "spec": spec},
                   shm.Owner(run_id, "test", 0))


def test_a_segment_is_backed_at_creation_and_one_larger_than_dev_shm_is_one_line_and_no_file(run_id):
    """A sparse tmpfs file would take its pages at first write, and a write past a full /dev/shm
    is a SIGBUS: segments are allocated when made, and one that cannot fit is a clear error."""
    name = shm.segment_name(run_id, "test", 0, "backed")
    seg = shm.Segment.create(name, 1 << 20)
    try:
        assert os.stat(shm.SHM_DIR / name).st_blocks * 512 >= 1 << 20  # every page is there
    finally:
        seg.unlink()
        seg.close()
    st = os.statvfs(shm.SHM_DIR)
    too_big = st.f_blocks * st.f_frsize + (1 << 30)  # more than all of /dev/shm
    name = shm.segment_name(run_id, "test", 0, "huge")
    with pytest.raises(shm.NoSpace) as info:
        shm.Segment.create(name, too_big)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"shared-memory segment {name} needs ")
    assert "MiB free of" in message and "--shm-size" in message
    assert not (shm.SHM_DIR / name).exists()
