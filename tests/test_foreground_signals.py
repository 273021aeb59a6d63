"""Commands that follow their runs in the foreground, ended as job schedulers, CI runners and
``timeout`` end them: SIGTERM (or SIGHUP, a closed terminal) to ``rlpipe launch`` stops its run
as Ctrl-C does; ``rlpipe grid`` and ``tune`` work under ``umask 002``; SIGTERM to ``tune`` stops
its trial runs and fails their trials, and the tune after one killed outright (SIGKILL) does; a
second tune of the same study is refused in one line; grid (and tune) check each run's room in
/dev/shm and on the disk before it starts."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from shared.launch import rundirs, supervisor
from shared.launch.lab import runs, tune
from tests.pipeline import CONFIGS, rlpipe_command, rlpipe_here

CONFIG = str(CONFIGS / "cartpole_ppo.toml")


def group_writable_umask():
    os.umask(0o002)


def wait_for_progress(root: Path, pattern: str, timeout: float = 120) -> Path:
    """The run directory matching ``pattern`` under ``root`` once it has a progress row."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for run_dir in root.glob(pattern):
            if rundirs.read_progress(run_dir):
                return run_dir
        time.sleep(0.05)
    raise AssertionError(f"no run {pattern} with progress under {root} within {timeout:.0f} s")


def assert_nothing_left(run_dir: Path) -> None:
    assert not supervisor.running(run_dir)
    killed, removed = supervisor.clean(run_dir)
    assert not killed and not removed, f"{run_dir.name} left processes {killed} or segments {removed}"


def wait_for_run_dir(root: Path, pattern: str, timeout: float = 60) -> Path:
    """The run directory matching ``pattern`` under ``root`` the moment it exists (its launch
    is then making it or starting its supervisord)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for run_dir in root.glob(pattern):
            return run_dir
        time.sleep(0.002)
    raise AssertionError(f"no run {pattern} under {root} within {timeout:.0f} s")


@pytest.mark.parametrize("sig,when", [(signal.SIGTERM, "running"), (signal.SIGHUP, "running"),
                                      (signal.SIGTERM, "starting")])
def test_a_signal_to_a_foreground_launch_stops_its_run(tmp_path, sig, when):
    """``starting``: the signal comes as the run directory appears, inside the launch's start of
    supervisord and its services, before the run is announced."""
    proc = subprocess.Popen(**rlpipe_command("launch", CONFIG, "--set", f"run.runs_dir='{tmp_path}'",
                                             "--set", "network.metrics_port=0", "--set", "run.log_interval_s=0.2",
                                             "--set", "run.max_env_steps=10000000"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait = wait_for_progress if when == "running" else wait_for_run_dir
        run_dir = wait(tmp_path, "cartpole_ppo_*")
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, stdout + stderr
    assert "Traceback" not in stderr, stderr
    if when == "running":
        assert "interrupted: stopping the run" in stdout and f"run {run_dir} stopped" in stdout
    else:  # where it landed decides the line; either way the run is stopped
        assert "interrupted while starting: the run is stopped" in stdout or f"run {run_dir} stopped" in stdout, stdout
    assert_nothing_left(run_dir)


def test_grid_and_tune_under_umask_002_and_sigterm_to_tune_fails_its_live_trials(tmp_path):
    grid = subprocess.run(**rlpipe_command("grid", CONFIG, "--seeds", "0", "--set", f"run.runs_dir='{tmp_path}'",
                                           "--set", "run.max_env_steps=2048", "--set", "network.metrics_port=0"),
                          capture_output=True, text=True, timeout=300, preexec_fn=group_writable_umask)
    assert grid.returncode == 0, grid.stdout + grid.stderr
    (grid_dir,) = tmp_path.glob("grid_*")
    assert grid_dir.stat().st_mode & 0o777 == 0o700 and (grid_dir / "summary.md").exists()

    study_dir = tmp_path / "study"
    args = ["tune", CONFIG, "--param", "algo.lr=loguniform:1e-4:1e-3", "--trials", "3", "--parallel", "1",
            "--out", str(study_dir), "--set", f"run.runs_dir='{tmp_path}'", "--set", "network.metrics_port=0",
            "--set", "run.max_env_steps=10000000", "--set", "run.log_interval_s=0.2"]
    proc = subprocess.Popen(**rlpipe_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=group_writable_umask)
    try:
        run_dir = wait_for_progress(study_dir, "trial_0_*")
        second = rlpipe_here(*args)
        assert second.returncode == 2
        assert second.stderr.splitlines() == [f"rlpipe: tune: {study_dir / tune.STUDY_DB} is being written by another "
                                              f"rlpipe tune (pid {proc.pid}): wait for it to end, or give this one "
                                              "another --out"]
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "interrupted: stopping the live runs" in stdout, stdout + stderr
    study = tune.optuna().load_study(study_name="cartpole_ppo", storage=f"sqlite:///{study_dir / tune.STUDY_DB}")
    assert [t.state.name for t in study.trials] == ["FAIL"]  # the live one; no other was started
    assert [d.name for d in runs.find_runs(study_dir)] == [run_dir.name]
    assert_nothing_left(run_dir)


def test_a_grid_run_that_does_not_fit_is_not_started_and_said_so(tmp_path):
    """grid (and tune: the same launcher) checks /dev/shm and the disk before each run, as launch does."""
    out = rlpipe_here("grid", CONFIG, "--seeds", "0", "--set", f"run.runs_dir='{tmp_path}'", "--set",
                      "sampler.horizon=1000000", "--set", "sampler.envs=1024", "--set", "network.metrics_port=0")
    assert out.returncode == 1, out.stdout + out.stderr
    (run_dir,) = runs.find_runs(next(tmp_path.glob("grid_*")))
    (line,) = [line for line in out.stdout.splitlines() if line.startswith(f"{run_dir.name}: not started: ")]
    assert "/dev/shm has " in line and "sampler rings and slots" in line
    assert "| no room |" in (run_dir.parent / "summary.md").read_text()
    assert not supervisor.running(run_dir) and not list(Path("/dev/shm").glob(f"rlpipe-{run_dir.name}-*"))


def test_a_tune_after_one_killed_outright_stops_its_runs_and_fails_its_trials(tmp_path):
    """SIGKILL leaves tune no chance to clean up: its trial's run goes on and the trial stays RUNNING;
    the next tune of the same directory stops that run and fails that trial, then runs its own."""
    study_dir = tmp_path / "study"
    args = ["tune", CONFIG, "--param", "algo.lr=loguniform:1e-4:1e-3", "--trials", "1", "--out", str(study_dir),
            "--set", f"run.runs_dir='{tmp_path}'", "--set", "network.metrics_port=0", "--set", "run.log_interval_s=0.2"]
    proc = subprocess.Popen(**rlpipe_command(*args, "--set", "run.max_env_steps=10000000"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    left = None
    try:
        left = wait_for_progress(study_dir, "trial_0_*")
        proc.kill()
        proc.wait(timeout=30)
        assert supervisor.running(left)
        again = rlpipe_here(*args, "--set", "run.max_env_steps=2048")
    finally:
        proc.kill()
        if left is not None:
            supervisor.clean(left)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{left.name}: left running by an earlier tune: stopping it" in again.stdout
    assert "trial 0: left running by an earlier tune: failed" in again.stdout
    study = tune.optuna().load_study(study_name="cartpole_ppo", storage=f"sqlite:///{study_dir / tune.STUDY_DB}")
    assert [t.state.name for t in study.trials] == ["FAIL", "COMPLETE"]
    for run_dir in runs.find_runs(study_dir):
        assert_nothing_left(run_dir)
