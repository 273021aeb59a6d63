"""The learner's files: the previous checkpoint is kept and used when the latest cannot be
loaded, a lock in the run directory keeps a second learner of the run from starting, and
acting.json appears only once the parameters are published; the row at a run's end repeats no row."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch
import zmq

from services.learner.__main__ import start_publishing
from services.learner.learner import Learner
from shared.runtime.runfiles import CHECKPOINT, PREVIOUS_CHECKPOINT
from shared.agents.acting import read_acting_file
from shared.runtime.runfiles import ACTING_FILE
from shared.config import loading as config
from shared.transport import shm
from services.build import env_probe, make_agent, make_algo
from shared.launch import rundirs
from shared.runtime.process import lock_service
from shared.runtime.runfiles import RUN_CONFIG
from tests.pipeline import CONFIGS, REPO


def make_learner(run_dir, seed: int = 0) -> Learner:
    exp = config.load(CONFIGS / "cartpole_ppo.toml")
    torch.manual_seed(seed)
    probe = env_probe(exp)
    agent = make_agent(exp, probe)
    probe.close()
    return Learner(exp, agent, make_algo(exp, agent), torch.device("cpu"), run_dir)


def test_a_corrupt_latest_checkpoint_resumes_from_the_previous_one(tmp_path, caplog):
    first = make_learner(tmp_path)
    first.version, first.env_steps = 7, 700
    first.maybe_checkpoint(force=True)
    kept = {k: v.clone() for k, v in first.agent.state_dict().items()}
    first.version, first.env_steps = 9, 900
    with torch.no_grad():
        for p in first.agent.parameters():
            p.add_(1.0)
    first.maybe_checkpoint(force=True)
    assert (tmp_path / PREVIOUS_CHECKPOINT).exists()
    latest = tmp_path / CHECKPOINT
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # a full disk, a kill mid-copy

    second = make_learner(tmp_path, seed=1)
    assert second.resume()
    assert (second.version, second.env_steps) == (7, 700)
    for k, v in second.agent.state_dict().items():
        assert torch.equal(v, kept[k]), k
    assert any("cannot resume from" in r.getMessage() and "latest.pt" in r.getMessage() for r in caplog.records)


def test_the_rows_end_follows_the_last_row_only_with_something_counted_since(tmp_path):
    """The run's end forces a row; when the periodic row fell on the run's last update, a second
    row would repeat it (two rows of one env-step count: pool_elo.csv's versions twice at it)."""
    learner = make_learner(tmp_path)
    assert learner.maybe_report(force=True) is not None  # this incarnation's first row
    assert learner.maybe_report(force=True) is None
    learner.progress.record_update({}, lag=0.0)
    assert learner.maybe_report(force=True)["updates"] == 1
    learner.write_result("budget")
    assert [int(r["updates"]) for r in rundirs.read_progress(tmp_path)] == [0, 1]


def test_a_good_latest_checkpoint_is_used_and_none_at_all_starts_fresh(tmp_path):
    assert not make_learner(tmp_path).resume()
    first = make_learner(tmp_path)
    for version in (3, 4):
        first.version = version
        first.maybe_checkpoint(force=True)
    second = make_learner(tmp_path, seed=1)
    assert second.resume() and second.version == 4


def test_no_loadable_checkpoint_is_an_error_naming_both_files(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    for name in (CHECKPOINT, PREVIOUS_CHECKPOINT):
        (tmp_path / name).write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match="latest.pt.*previous.pt.*move them away"):
        make_learner(tmp_path).resume()


def test_a_second_learner_of_the_run_stops_before_touching_the_live_segments(tmp_path, run_id):
    run_dir = tmp_path / run_id
    run_dir.mkdir()
    (run_dir / RUN_CONFIG).write_text(config.dumps(config.load(CONFIGS / "cartpole_ppo.toml")))
    held = lock_service(run_dir, "learner")
    with pytest.raises(RuntimeError, match="another learner .* runs for"):
        lock_service(run_dir, "learner")
    seg = shm.Segment.create(shm.segment_name(run_id, "learner", 0, "params"), 64)  # the live learner's
    try:
        out = subprocess.run([sys.executable, "-m", "services.learner", "--run-dir", str(run_dir)], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "another learner" in out.stderr, out.stderr[-2000:]
        assert (shm.SHM_DIR / seg.name).exists()
    finally:
        seg.unlink()
        seg.close()
        held.close()
    lock_service(run_dir, "learner").close()  # free again once the holder is gone


def test_acting_json_appears_only_once_the_parameters_socket_is_bound(tmp_path, run_id):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    exp = config.load(CONFIGS / "cartpole_ppo.toml", ["network.transport='tcp'", f"network.base_port={port - 1}"])
    run_dir = tmp_path / run_id
    run_dir.mkdir()
    probe = env_probe(exp)
    agent = make_agent(exp, probe)
    probe.close()
    ctx = zmq.Context()
    try:
        with pytest.raises(zmq.ZMQError):  # the params port (base_port + 1) is taken
            start_publishing(ctx, exp, run_dir, agent, 3, 0)
        assert not (run_dir / ACTING_FILE).exists()  # no sampler is sent to a learner that cannot publish
        taken.close()
        params, version = start_publishing(ctx, exp, run_dir, agent, 3, 0)
        assert version == 3 and read_acting_file(run_dir) is not None
        params.close()
    finally:
        taken.close()
        ctx.destroy(linger=0)
