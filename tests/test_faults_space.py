"""Faults of space (issue 27, item 3): /dev/shm too small for a run, a full run-directory disk.

The full file systems are small tmpfs mounts in a private mount namespace (``unshare -m``, which
needs root or user namespaces): the real /dev/shm and disk are never filled. Where the machine
does not allow one the tests skip, saying why.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from functools import lru_cache
from pathlib import Path

import pytest

from services.footprint import needs, pages
from shared.launch import api
from shared.runtime.files import append_csv, read_csv
from tests.pipeline import CONFIGS, REPO

FIELDS = ["a", "b", "c"]


@lru_cache(maxsize=1)
def _no_namespace() -> str | None:
    """Why a private mount namespace with a tmpfs cannot be made here (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm && test -w /dev/shm"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a private mount namespace (needs root): {probe.stderr.strip()[:200]}"
    return None


def in_namespace(script: str, mounts: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run python ``script`` in a private mount namespace where each path of ``mounts`` is a fresh
    tmpfs of the given size (e.g. ``{"/dev/shm": "4m"}``); the mounts go with the namespace.
    /dev/shm is world-writable as ever; any other mount is private to us, as ``run.runs_dir``
    must be (a tmpfs is mode 1777 unless told)."""
    why = _no_namespace()
    if why is not None:
        pytest.skip(why)
    mount = " && ".join(f"mkdir -p {path} && mount -t tmpfs -o size={size},mode={'1777' if path == '/dev/shm' else '0700'} "
                        f"tmpfs {path}" for path, size in mounts.items())
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           f'{mount} && exec "$0" -c "$1"', sys.executable, textwrap.dedent(script)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- files, without a full disk


def test_a_short_write_leaves_no_part_of_the_row(tmp_path, monkeypatch):
    path = tmp_path / "p.csv"
    append_csv(path, FIELDS, {"a": 1, "b": 2, "c": 3})
    real = __import__("os").write
    monkeypatch.setattr("os.write", lambda fd, data: real(fd, data[:3]))  # the disk fills within the row
    with pytest.raises(OSError):
        append_csv(path, FIELDS, {"a": 4, "b": 5, "c": 6})
    monkeypatch.undo()
    assert path.read_bytes() == b"a,b,c\r\n1,2,3\r\n"
    append_csv(path, FIELDS, {"a": 7, "b": 8, "c": 9})
    assert read_csv(path) == [{"a": "1", "b": "2", "c": "3"}, {"a": "7", "b": "8", "c": "9"}]


def test_a_row_cut_short_by_an_older_writer_is_not_read(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("a,b,c\n1,2,3\n4,5\n7,8,9\n10,1")  # a torn row in the middle, one being written at the end
    assert read_csv(path) == [{"a": "1", "b": "2", "c": "3"}, {"a": "7", "b": "8", "c": "9"}]


def test_progress_rows_that_cannot_be_written_are_written_later_in_order(tmp_path, monkeypatch):
    from services.learner import progress as progress_mod

    counted = []
    p = progress_mod.Progress(10, tmp_path, errors=progress_mod.WriteErrors(counted.append))
    monkeypatch.setattr(p, "_tensorboard", lambda scalars: None)
    p.write(p.row(0))
    real = progress_mod.append_csv
    monkeypatch.setattr(progress_mod, "append_csv", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    p.write(p.row(1))
    p.write(p.row(2))
    assert counted == ["progress.csv", "progress.csv"] and len(p.unwritten) == 2
    monkeypatch.setattr(progress_mod, "append_csv", real)
    p.write(p.row(3))
    assert [r["policy_version"] for r in read_csv(tmp_path / "progress.csv")] == ["0", "1", "2", "3"]
    assert p.unwritten == []


def test_pool_elo_rows_that_cannot_be_written_take_no_room_from_the_progress_rows(tmp_path, monkeypatch):
    """While the disk is full the learner keeps MAX_UNWRITTEN progress rows, with a self-play pool
    too: each version's pool_elo.csv rows (a row per version at each progress row) are kept apart."""
    from services.learner import progress as progress_mod
    from shared.transport.pool import Scores

    monkeypatch.setattr(progress_mod, "MAX_UNWRITTEN", 4)
    scores = Scores()
    for v in range(8):
        scores.enter(v)
    p = progress_mod.Progress(10, tmp_path, errors=progress_mod.WriteErrors(), scores=scores)
    monkeypatch.setattr(p, "_tensorboard", lambda scalars: None)
    real = progress_mod.append_csv
    monkeypatch.setattr(progress_mod, "append_csv", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    for version in range(6):
        p.write(p.row(version))
    monkeypatch.setattr(progress_mod, "append_csv", real)
    p.write_rows()
    assert [r["policy_version"] for r in read_csv(tmp_path / "progress.csv")] == ["2", "3", "4", "5"]
    assert len(read_csv(tmp_path / "pool_elo.csv")) == 4  # the newest 4 of 48, whole


def test_the_footprint_sizes_a_ten_million_item_table_without_allocating_it():
    exp = api.experiment(CONFIGS / "cartpole_dqn.toml", ["replay.capacity=10000000", "replay.snapshot_interval_s=60"])
    t0 = time.monotonic()
    need = needs(exp, processes=4)
    assert time.monotonic() - t0 < 5
    assert need.shm["replay table"] > 10_000_000 * 4 * 4  # ten million CartPole observations at least
    assert need.run_dir["replay snapshots"] >= 2 * need.shm["replay table"] - 64 * pages(1)


# ---------------------------------------------------------------- full file systems


def test_on_a_full_disk_files_fail_whole_and_metrics_run_in_memory():
    """Checkpoints, CSV rows, table snapshots and metrics files on a 2 MiB tmpfs that fills up."""
    script = """
        import json, os, numpy as np, torch
        from pathlib import Path
        from shared.runtime.files import append_csv, read_csv
        from services.learner.checkpoints import Checkpoints
        root = Path("/tmp/rlpipe-space-test")
        out = {}
        ck = Checkpoints(root)
        ck.save({"w": torch.ones(1000)})
        try:
            ck.save({"w": torch.zeros(2_000_000)})  # 8 MB: more than the disk holds
        except OSError as e:
            out["checkpoint"] = e.errno
        out["checkpoint_left"] = sorted(p.name for p in (root / "checkpoints").iterdir())
        out["checkpoint_loads"] = float(torch.load(root / "checkpoints/latest.pt")["w"].sum())
        fd = os.open(root / "fill", os.O_WRONLY | os.O_CREAT)
        try:  # the disk is full to the last byte
            while os.write(fd, b"x" * 512):
                pass
        except OSError:
            os.close(fd)
        rows = 0
        for i in range(50):
            try:
                append_csv(root / "p.csv", ["a", "b"], {"a": i, "b": "y" * 100})
                rows += 1
            except OSError:
                pass
        out["rows_read"] = len(read_csv(root / "p.csv")) == rows
        out["whole"] = all(line.count(",") == 1 for line in (root / "p.csv").read_text().splitlines()) \\
            if (root / "p.csv").exists() else True
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(root)
        from shared.runtime import metrics
        m = metrics.for_service("learner", 0)
        m.updates.inc(3)
        out["metrics_in_memory"] = "PROMETHEUS_MULTIPROC_DIR" not in os.environ
        out["metrics_files"] = sorted(p.name for p in root.glob("*.db"))
        print(json.dumps(out))
    """
    done = in_namespace(script, {"/tmp/rlpipe-space-test": "2m"}, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["checkpoint"] == 28  # ENOSPC, raised: not torch's RuntimeError
    assert out["checkpoint_left"] == ["latest.pt"] and out["checkpoint_loads"] == 1000
    assert out["rows_read"] and out["whole"]
    assert out["metrics_in_memory"] and out["metrics_files"] == []
    assert "metrics of this process are not served" in done.stderr


def test_metrics_files_are_allocated_in_full(tmp_path):
    script = f"""
        import os
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = {str(tmp_path)!r}
        from shared.runtime import metrics
        metrics.for_service("replay", 0).inserts.inc()
    """
    subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, check=True, timeout=30)
    files = sorted(tmp_path.glob("*.db"))
    assert len(files) == 3
    for f in files:
        st = f.stat()
        assert st.st_size == st.st_blocks * 512 >= 256 << 10, f.name  # no hole a write could fault on


def test_launch_fails_at_once_when_dev_shm_is_too_small(tmp_path):
    script = f"""
        import sys
        from shared.launch import cli
        sys.exit(cli.main(["launch", {str(CONFIGS / 'cartpole_dqn.toml')!r}, "--set", "run.runs_dir='{tmp_path}/runs'",
                           "--set", "network.metrics_port=0"]))
    """
    t0 = time.monotonic()
    done = in_namespace(script, {"/dev/shm": "4m"}, timeout=60)
    took = time.monotonic() - t0
    assert done.returncode == 1, done.stdout + done.stderr
    assert took < 30
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("rlpipe: cannot start the run: /dev/shm has 4.0 MiB free, the run needs 8.")
    assert "replay table 8." in lines[0] and "--shm-size" in lines[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing made


def test_a_full_run_directory_crashes_nothing_tears_no_row_and_writes_resume(tmp_path):
    """A live DQN run whose run directory is a 32 MiB tmpfs, filled to the last byte while
    checkpoints, snapshots and rows come every second, until a checkpoint and a snapshot have
    failed; then the space is freed."""
    script = f"""
        import json, os, time
        from pathlib import Path
        from services.footprint import needs, pages
        from services.learner.progress import PROGRESS_FIELDS
        from tests.pipeline import Run, metric_value
        out = {{}}
        run = Run.launch(Path({str(tmp_path)!r}), "cartpole_dqn.toml", "replay.capacity=10000",
                         "replay.snapshot_interval_s=1", "learner.checkpoint_interval_s=1", "run.max_wall_s=90",
                         "run.max_env_steps=100000000", "run.target_return=1e9")
        try:
            ck, snap = run.dir / "checkpoints" / "latest.pt", run.dir / "replay" / "table"
            run.wait_for(lambda: ck.exists() and snap.exists() and len(run.progress()) >= 2, 60, "a checkpoint")
            held = {{p.name.split("-", 2)[2]: pages(p.stat().st_size) for p in Path("/dev/shm").glob(f"rlpipe-{{run.id}}-*")}}
            out["shm_held"] = sum(n for name, n in held.items() if name != "learner0-params")
            out["shm_needs"] = sum(needs(run.config(), 0).shm.values())
            fd = os.open(run.dir.parent / "fill", os.O_WRONLY | os.O_CREAT)
            for size in (1 << 20, 4096, 64):
                try:
                    while os.write(fd, b"x" * size):
                        pass
                except OSError:
                    pass
            os.close(fd)
            t_full = time.time()
            # Full until a checkpoint and a table snapshot have failed (each comes every second;
            # rows fail as their file's last page fills): waited for, not a fixed 5 s.
            def failed():
                page = run.metrics()
                rows, ck = (metric_value(page, "rlpipe_learner_write_errors_total", file=f)
                            for f in ("progress.csv", "checkpoint"))
                snapshots = metric_value(page, "rlpipe_replay_snapshot_errors_total")
                return (rows + ck, snapshots) if ck > 0 and snapshots > 0 else None
            out["write_errors"], out["snapshot_errors"] = run.wait_for(failed, 60, "a failed checkpoint and snapshot")
            out["rows_while_full"] = len(run.progress())
            os.unlink(run.dir.parent / "fill")
            t_free = time.time()
            run.wait_for(lambda: ck.stat().st_mtime > t_free and snap.stat().st_mtime > t_free
                         and len(run.progress()) > out["rows_while_full"], 20, "writes after the space was freed")
            out["exits"] = [l for l in (run.dir / "logs" / "supervisord.log").read_text().splitlines() if "exited:" in l]
            lines = (run.dir / "progress.csv").read_text().splitlines()
            out["torn"] = [l for l in lines if l.count(",") != len(PROGRESS_FIELDS) - 1]
            out["rows"], out["lines"] = len(run.progress()), len(lines)
            out["logged"] = "cannot write the checkpoint" in run.logs("learner") and \\
                "cannot write the table snapshot" in run.logs("replay")
            out["full_s"] = t_free - t_full
        finally:
            run.close()
        print(json.dumps(out))
    """
    done = in_namespace(script, {str(tmp_path / "runs"): "32m"}, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    print(out)
    assert out["exits"] == [], out["exits"]  # no service died
    assert out["torn"] == [] and out["rows"] == out["lines"] - 1
    assert out["write_errors"] > 0 and out["snapshot_errors"] > 0 and out["logged"]
    assert out["shm_held"] == out["shm_needs"]  # the launch's footprint is what the services allocate


def test_a_table_that_dev_shm_cannot_hold_when_replay_makes_it_is_one_clear_error(tmp_path):
    """/dev/shm fills between the launch's check and replay's table (made at the first sampler's
    hello): replay's one NoSpace line ends the run, no SIGBUS and no restart loop."""
    script = f"""
        import json, time
        from pathlib import Path
        from shared.config.schema import ConfigError
        from shared.launch import api, follow
        from tests.pipeline import CONFIGS
        api.space.check = lambda *args: None  # as if /dev/shm filled up after the launch's check
        exp = api.experiment(CONFIGS / "cartpole_dqn.toml", ["run.runs_dir='{tmp_path}/runs'", "network.metrics_port=0"])
        t0 = time.monotonic()
        run = api.launch(exp, wait=False)
        try:
            run.wait_until_built()
            run.follow(quiet=True)
            error = "no error"
        except ConfigError as e:
            error = str(e)
        except follow.ServiceCrashLoop as e:
            error = str(e) + "\\n" + e.log_tail()
        took = time.monotonic() - t0
        log = (run.dir / "logs" / "supervisord.log").read_text() if run.dir.exists() else ""
        run.clean()
        print(json.dumps({{"error": error, "took": took, "sigbus": "SIGBUS" in log}}))
    """
    done = in_namespace(script, {"/dev/shm": "4m"}, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    print(out)
    assert "replay0-t." in out["error"] and "MiB free" in out["error"] and "/dev/shm" in out["error"], out["error"]
    assert not out["sigbus"] and out["took"] < 60


def test_rows_appended_with_a_column_more_are_read_after_a_resume(tmp_path):
    """A run resumed by code that writes a progress column more (e.g. skipped_updates): the
    file gets the new header, old rows keep their values with the new column empty, and the
    new rows are read (they were all left out when the header kept the old columns)."""
    path = tmp_path / "progress.csv"
    append_csv(path, ["a", "b"], {"a": 1, "b": 2})
    append_csv(path, ["a", "b", "c"], {"a": 3, "b": 4, "c": 5})
    assert read_csv(path) == [{"a": "1", "b": "2", "c": ""}, {"a": "3", "b": "4", "c": "5"}]
    assert path.read_text().splitlines()[0] == "a,b,c" and not list(tmp_path.glob("*.tmp"))
    # A file a resumed writer appended to before its header was matched: every row is kept.
    path.write_text("a,b\n1,2\n3,4,5\n")
    append_csv(path, ["a", "b", "c"], {"a": 6, "b": 7, "c": 8})
    assert [r["a"] for r in read_csv(path)] == ["1", "3", "6"] and read_csv(path)[1]["c"] == "5"
