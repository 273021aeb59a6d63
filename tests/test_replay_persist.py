"""A replay table in shared memory outlives its process: kill -9, a torn insert, another layout,
a snapshot for a machine restart, a stopped run resumed.

A child process builds a prioritized n-step table in named shared memory and is killed by
SIGKILL, either after its last operation or in the middle of an insert (``RLPIPE_FAULT``).
This process then re-attaches, as a restarted replay does, and compares with a replica of
the same operations on the heap.
"""

from __future__ import annotations

import json
import errno
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from services.replay.tables import table_fingerprint
from shared.config import loading
from shared.data.namedarraytuple import from_spec, spec_of
from shared.replay.arena import HEAP, ShmArena, fingerprint
from shared.replay.rate_limiter import RateLimiter, RateLimiterConfig
from shared.replay.selectors import Prioritized
from shared.replay.storage import StorageConfig
from shared.replay.tables import Table
from shared.replay.transitions import TransitionStorage, TransitionStorageConfig
from shared.transport import shm
from tests.pipeline import CONFIGS, rlpipe_here
from tests.test_tables import Reference, _check_batch, _segment

ROOT = Path(__file__).resolve().parents[1]
WIDTHS, T, N, GAMMA, ROWS = {0: 2, 1: 3}, 5, 3, 0.9, 200
INCARNATION = 1_700_000_000_000_000_000
SPEC = spec_of(_segment(0, np.arange(T), 2, np.random.default_rng(0)))
LAYOUT = fingerprint("persist-test", WIDTHS, T, N)


def _table(arena):
    storage = StorageConfig(capacity=ROWS * sum(WIDTHS.values()))
    return Table(TransitionStorage(SPEC, WIDTHS, storage, TransitionStorageConfig(n_step=N, gamma=GAMMA), arena), Prioritized(),
                 RateLimiter(RateLimiterConfig(min_size_to_sample=2), arena), seed=3, arena=arena)


def _segments(rounds):
    rng = np.random.default_rng(7)
    return [(w, _segment(w, np.arange(i * T, (i + 1) * T), WIDTHS[w], rng)) for i in range(rounds) for w in WIDTHS]


def _run(table, inserts):
    """What a replay does: ``inserts`` segments with serials, samples and priority updates between."""
    rng = np.random.default_rng(11)
    dest = from_spec(table.storage.batch_spec(16))
    for w in WIDTHS:
        table.attach_writer(w, INCARNATION)
    for k, (w, seg) in enumerate(_segments(8)[:inserts]):
        table.insert(w, seg, serial=k // len(WIDTHS) + 1)
        if table.can_sample(16):
            info = table.sample_into(dest, 16)
            table.update_priorities(info["keys"], info["generations"], rng.random(16) * 3)


def child(run_id: str) -> None:
    """Build the table in shared memory, run all operations, then die as kill -9 does (the
    ``run_id`` fixture fails the test if the segments are not removed after)."""
    _run(_table(ShmArena(run_id, 0, LAYOUT)), 16)
    os.kill(os.getpid(), 9)


def _kill_child(run_id: str, fault: str | None) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if fault:
        env["RLPIPE_FAULT"] = fault
    proc = subprocess.run([sys.executable, "-c", f"import tests.test_replay_persist as t; t.child({run_id!r})"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr


def _priorities(table):
    return table.selector._tree.values(np.arange(table.storage.num_slots))


def test_a_table_killed_between_operations_comes_back_exactly(run_id):
    _kill_child(run_id, None)
    replica = _table(HEAP)
    _run(replica, 16)
    table = _table(ShmArena(run_id, 0, LAYOUT))
    assert table.arena.restored and table.arena.restarts == 1
    assert table.recovered["op"] == "none" and table.recovered["dropped"] == 0
    assert table.size == replica.size > 100
    np.testing.assert_array_equal(table.live, replica.live)
    np.testing.assert_array_equal(table.generation, replica.generation)
    np.testing.assert_array_equal(_priorities(table), _priorities(replica))
    assert table.selector._tree.total == pytest.approx(replica.selector._tree.total, rel=1e-12)
    for name in ("inserts", "samples", "deletes"):
        assert getattr(table.rate_limiter, name) == getattr(replica.rate_limiter, name)
    assert table.selector.metrics() == replica.selector.metrics()  # max priority, beta (sample calls)
    for name in ("return_", "discount", "bootstrap_key", "bootstrap_final"):
        np.testing.assert_array_equal(getattr(table.storage, name), getattr(replica.storage, name))
    np.testing.assert_array_equal(table.storage.ring.written, replica.storage.ring.written)
    # The samplers, unrestarted, resume after their last serial; a restarted one starts anew.
    assert table.attach_writer(0, INCARNATION) == 8
    assert table.attach_writer(1, INCARNATION + 1) == 0
    table.arena.unlink()


def test_a_kill_in_the_middle_of_an_insert_drops_only_what_it_touched_and_serves_consistent_data(run_id):
    _kill_child(run_id, "replay.insert:11")  # the 11th insert: writer 0's segment of steps 25..29
    replica = _table(HEAP)
    _run(replica, 10)
    table = _table(ShmArena(run_id, 0, LAYOUT))
    r = table.recovered
    lost = replica.live & ~table.live
    assert r["op"] == "insert" and r["dropped"] == lost.sum() > 0
    assert not (table.live & ~replica.live).any()
    # Only writer 0's items of the steps the insert wrote or reached into (n - 1 before it) left.
    keys = np.flatnonzero(lost)
    cols, rows = keys % sum(WIDTHS.values()), keys // sum(WIDTHS.values())
    assert set(cols) <= {0, 1} and rows.min() >= 25 - N
    kept = table.live
    for name in ("return_", "discount", "bootstrap_key"):
        np.testing.assert_array_equal(getattr(table.storage, name)[kept], getattr(replica.storage, name)[kept])
    np.testing.assert_array_equal(_priorities(table)[kept], _priorities(replica)[kept])
    assert table.size == table.rate_limiter.size == kept.sum()
    assert table.rate_limiter.samples == replica.rate_limiter.samples
    # The serial was not recorded: the sampler resends the segment, and it goes in after a seam.
    assert table.attach_writer(0, INCARNATION) == 5
    w, seg = _segments(8)[10]
    before = table.size
    table.insert(w, seg, serial=6)
    assert table.size >= before + WIDTHS[0] * (T - N)
    ref = Reference(WIDTHS, ROWS, N, GAMMA)
    for k, (w, seg) in enumerate(_segments(8)[:11]):
        if k == 10:
            ref.reset(w)
        ref.add(w, seg)
    live = ref.live()
    dest = from_spec(table.storage.batch_spec(table.size))
    table.sample_into(dest, table.size)
    ids = _check_batch(dest, live)  # every item sampled is what the samplers sent
    assert any(w == 0 and t >= 25 for w, c, t in ids)  # the resent segment's items among them
    table.arena.unlink()


def test_a_table_of_another_layout_is_not_attached(run_id, caplog):
    table = _table(ShmArena(run_id, 0, LAYOUT))
    _run(table, 6)
    other = ShmArena(run_id, 0, LAYOUT + 1)
    assert not other.restored and "another layout" in caplog.text
    assert _table(other).size == 0
    other.unlink()


def test_a_truncated_table_segment_is_discarded_and_the_table_starts_empty(run_id, caplog):
    """A segment cut short (a full /dev/shm, another process's ftruncate): the restarted replay
    does not refuse every sampler on it, it starts over."""
    _run(_table(ShmArena(run_id, 0, LAYOUT)), 6)
    ring = shm.SHM_DIR / f"rlpipe-{run_id}-replay0-t.ring"
    size = ring.stat().st_size
    os.truncate(ring, size // 2)
    table = ShmArena(run_id, 0, LAYOUT).build(_table)
    assert not table.arena.restored and table.size == 0
    assert re.search(r"not used \(segment \S+t\.ring holds \d+ bytes, the layout needs \d+\): starting empty", caplog.text)
    assert ring.stat().st_size == size  # made again whole
    _run(table, 6)  # and serves as a fresh table
    assert table.size > 0
    table.arena.unlink()


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_half_written_snapshot_is_discarded_and_the_table_starts_empty(run_id, tmp_path, caplog, damage):
    table = _table(ShmArena(run_id, 0, LAYOUT))
    _run(table, 12)
    table.arena.snapshot(tmp_path / "replay")
    table.arena.unlink()
    part = tmp_path / "replay" / "t.sumtree.sum"
    if damage == "truncated":
        os.truncate(part, part.stat().st_size - 100)
    else:
        part.unlink()
    again = ShmArena(run_id, 0, LAYOUT, snapshot=tmp_path / "replay").build(_table)
    assert not again.arena.restored and again.size == 0
    assert re.search(r"not used \(.*t\.sumtree\.sum.*\): starting empty", caplog.text), caplog.text
    _run(again, 6)
    assert again.size > 0
    again.arena.unlink()


def test_a_snapshot_brings_the_table_back_after_shared_memory_is_gone(run_id, tmp_path):
    """A machine restart empties /dev/shm: the snapshot in the run directory restores the table."""
    table = _table(ShmArena(run_id, 0, LAYOUT))
    _run(table, 12)
    table.arena.snapshot(tmp_path / "replay")
    table.arena.snapshot(tmp_path / "replay")  # again over the first: replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replay"]
    live, priorities, counts = table.live.copy(), _priorities(table), table.rate_limiter.counts._values.copy()
    table.arena.unlink()
    again = _table(ShmArena(run_id, 0, LAYOUT, snapshot=tmp_path / "replay"))
    assert again.arena.restored and again.recovered["op"] == "none" and again.recovered["dropped"] == 0
    np.testing.assert_array_equal(again.live, live)
    np.testing.assert_array_equal(_priorities(again), priorities)
    np.testing.assert_array_equal(again.rate_limiter.counts._values, counts)
    assert again.attach_writer(1, INCARNATION) == 6
    again.arena.unlink()


def test_a_crash_between_the_snapshot_renames_restores_the_previous_copy(run_id, tmp_path):
    """snapshot() moves replay/ to replay.old/ before it puts the new copy in place: a crash
    between the two renames leaves only replay.old/, which the restore takes."""
    table = _table(ShmArena(run_id, 0, LAYOUT))
    _run(table, 12)
    table.arena.snapshot(tmp_path / "replay")
    live = table.live.copy()
    table.arena.unlink()
    (tmp_path / "replay").rename(tmp_path / "replay.old")
    again = _table(ShmArena(run_id, 0, LAYOUT, snapshot=tmp_path / "replay"))
    assert again.arena.restored
    np.testing.assert_array_equal(again.live, live)
    again.arena.unlink()


def test_a_snapshot_that_fails_leaves_the_previous_one_and_no_partial_copy(run_id, tmp_path, monkeypatch):
    table = _table(ShmArena(run_id, 0, LAYOUT))
    _run(table, 12)
    table.arena.snapshot(tmp_path / "replay")
    before = {p.name: p.read_bytes() for p in (tmp_path / "replay").iterdir()}
    _run(table, 6)
    real, calls = os.fsync, []

    def fsync(fd):  # the disk fills up at the third file (tmpfs takes the pages at write; a disk may at fsync)
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError):
        table.arena.snapshot(tmp_path / "replay")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replay"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "replay").iterdir()} == before
    table.arena.snapshot(tmp_path / "replay")  # tried again once there is room
    assert {p.name: p.read_bytes() for p in (tmp_path / "replay").iterdir()} != before
    table.arena.unlink()


def stopped_after_a_snapshot(runs):
    """A DQN run stopped (`rlpipe stop`) once it has 6k env steps and a table snapshot (one a
    second) taken after them: waited for, where a fixed 1.5 s sleep waited a second too long."""
    run = runs("cartpole_dqn.toml", "replay.snapshot_interval_s=1", "run.target_return=1e9")
    run.wait_steps(6_000, timeout=60)
    since = time.time()

    def snapshot_since() -> bool:
        """Every file of the snapshot copied after the steps (a snapshot is written beside and
        renamed into place whole, so then it holds them)."""
        try:
            files = list((run.dir / "replay").iterdir())
            return bool(files) and min(f.stat().st_mtime for f in files) > since
        except OSError:  # mid-rename
            return False

    run.wait_for(snapshot_since, 30, "a table snapshot with those steps")
    assert rlpipe_here("stop", str(run.dir)).returncode == 0
    return run


def test_a_stopped_run_resumes_with_its_replay_table_and_checkpoint(runs):
    """`rlpipe stop` unlinks the table (a normal exit); `rlpipe launch --resume RUN` brings back the
    snapshot with the learner's checkpoint, and the run goes on from there."""
    run = stopped_after_a_snapshot(runs)
    assert not run.segments()  # a normal stop leaves nothing in /dev/shm
    steps = int(run.progress()[-1]["env_steps"])
    out = rlpipe_here("launch", "--resume", str(run.dir), "--detach")
    assert out.returncode == 0, out.stderr
    line = run.wait_for(lambda: re.search(r"re-attached after a restart: (\{.*\})", run.logs("replay")), 30,
                        "the resumed replay to restore its table")
    restored = json.loads(line.group(1))
    assert "restored from the snapshot" in run.logs("replay") and restored["size"] > 4_000, restored
    run.wait_for(lambda: "resumed from" in run.logs("learner"), 30, "the learner to resume from its checkpoint")
    run.wait_for(lambda: int(run.progress()[-1]["env_steps"]) > steps + 2_000, 60, "the resumed run to go on")
    again = rlpipe_here("launch", "--resume", str(run.dir), "--detach")
    assert again.returncode == 2 and "is running: nothing to resume" in again.stderr


def test_a_resumed_run_whose_replay_was_killed_in_the_middle_of_a_restore_comes_back_with_the_snapshot(runs):
    """A stopped run's snapshot is restored into /dev/shm by a process killed before the header's
    ``complete`` cell (what a replay killed mid-restore leaves); `rlpipe launch --resume`: the
    live replay discards the incomplete table, says so, and restores the snapshot whole."""
    run = stopped_after_a_snapshot(runs)
    snapshot = run.dir / "replay"
    layout = int(np.fromfile(snapshot / "table", np.int64)[2])  # the header's fingerprint cell
    cut = len(list(snapshot.glob("t.*"))) + 1  # every segment copied, the header not complete
    env = dict(os.environ, PYTHONPATH=str(ROOT), RLPIPE_FAULT=f"replay.restore:{cut}")
    script = ("from pathlib import Path; from shared.replay.arena import ShmArena; "
              f"ShmArena({run.id!r}, 0, {layout}, snapshot=Path({str(snapshot)!r}))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -9 and f"rlpipe-{run.id}-replay0-table" in run.segments(), proc.stderr
    out = rlpipe_here("launch", "--resume", str(run.dir), "--detach")
    assert out.returncode == 0, out.stderr
    line = run.wait_for(lambda: re.search(r"re-attached after a restart: (\{.*\})", run.logs("replay")), 30,
                        "the resumed replay to restore its table")
    log = run.logs("replay")
    assert "not used (its construction did not finish): restoring the snapshot" in log, log
    restored = json.loads(line.group(1))
    assert "restored from the snapshot" in log and restored["size"] > 4_000, restored


def test_a_truncated_table_segment_under_a_live_run_is_discarded_and_the_run_goes_on(runs):
    """Replay's table segment cut short while it is down: the restarted replay starts an empty
    table (it refused every sampler's hello before, and the run made no progress again)."""
    run = runs("cartpole_dqn.toml", "run.target_return=1e9")
    run.wait_steps(3_000, timeout=60)
    stopped = run.stop_replay_between_operations()
    ring = shm.SHM_DIR / f"rlpipe-{run.id}-replay0-t.ring"
    os.truncate(ring, ring.stat().st_size // 2)
    os.kill(stopped["pid"], 9)
    run.wait_for(lambda: re.search(r"not used \(segment \S+t\.ring holds \d+ bytes, the layout needs \d+\): "
                                   r"starting empty", run.logs("replay")), 30, "the restarted replay to discard the table")
    last = run.progress()[-1]
    run.wait_for(lambda: int(run.progress()[-1]["env_steps"]) > int(last["env_steps"]) + 3_000
                 and int(run.progress()[-1]["updates"]) > int(last["updates"]), 60,
                 "the run to go on: env steps, and updates once the new table holds enough to sample")


def restoring_child(run_id: str, snapshot: str) -> None:
    """Restore the snapshot into shared memory (``RLPIPE_FAULT=replay.restore:<n>`` kills it midway)."""
    ShmArena(run_id, 0, LAYOUT, snapshot=Path(snapshot))
    os.kill(os.getpid(), 9)


@pytest.mark.parametrize("cut", ["first segment", "last segment", "header not complete"])
def test_a_replay_killed_in_the_middle_of_a_restore_comes_back_with_the_snapshot(run_id, tmp_path, caplog, cut):
    """A kill after any file of the restore (the header last, its ``complete`` cell last of all):
    the next start restores the snapshot again, never a table of zero tails taken for good."""
    table = _table(ShmArena(run_id, 0, LAYOUT))
    _run(table, 12)
    table.arena.snapshot(tmp_path / "replay")
    live, priorities, size = table.live.copy(), _priorities(table), table.size
    table.arena.unlink()
    files = len(list((tmp_path / "replay").glob("t.*")))
    at = {"first segment": 1, "last segment": files, "header not complete": files + 1}[cut]
    env = dict(os.environ, PYTHONPATH=str(ROOT), RLPIPE_FAULT=f"replay.restore:{at}")
    proc = subprocess.run([sys.executable, "-c", "import tests.test_replay_persist as t; "
                           f"t.restoring_child({run_id!r}, {str(tmp_path / 'replay')!r})"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9 and shm.run_segments(run_id), proc.stderr  # killed with part of the table made
    again = _table(ShmArena(run_id, 0, LAYOUT, snapshot=tmp_path / "replay"))
    assert again.arena.restored and again.recovered["dropped"] == 0
    assert again.size == size > 0
    np.testing.assert_array_equal(again.live, live)
    np.testing.assert_array_equal(_priorities(again), priorities)
    if cut == "header not complete":
        assert "not used (its construction did not finish): restoring the snapshot" in caplog.text, caplog.text
    again.arena.unlink()


@pytest.mark.parametrize("name, layout", [
    ("cartpole_ppo", 7136360145029826335),
    ("cartpole_dqn", 2510746420567625973),
    ("atari_pong_r2d1", 7853954154802421992),
])
def test_a_shipped_configs_table_fingerprint_holds(name, layout):
    # A table persisted (or snapshotted) by a run re-attaches only to the same fingerprint: these
    # were taken with rlpipe's earlier versions, whose runs must still resume.
    exp = loading.load(CONFIGS / f"{name}.toml")
    assert table_fingerprint(exp.replay, {0: 4}, None) == layout
