"""The Python API (``shared.launch.api``) and serial mode's run directory: experiments from a
path, a dict or dataclasses; a CartPole PPO run launched and followed to its result from
Python; ``train_serial`` learning CartPole to the config's target; ``rlpipe train --serial``
making the run directory a launched run makes, which ``ls``, ``plot``, ``evaluate`` and
``launch --resume`` then work on. Real processes and real gymnasium envs throughout."""

from __future__ import annotations

import _thread
import dataclasses
import io
import re
import signal
import threading
import time
import tomllib
from pathlib import Path

import pytest
import torch

from services.learner.learner import PROGRESS_FIELDS
from services.learner.progress import ETA_ROWS
from shared.runtime import runfiles
from shared.runtime.runfiles import CHECKPOINT
from shared.config import schema
from shared.launch import api, follow, rundirs, supervisor
from shared.runtime import evaluation
from shared.runtime.files import append_csv
from shared.runtime.runfiles import RUN_CONFIG, TB_DIR
from tests.pipeline import CONFIGS, Run, rlpipe, rlpipe_here

PPO = CONFIGS / "cartpole_ppo.toml"
ROW = re.compile(r"^\[ *\d+\.\ds\] steps +\d+ \( *\d+/s\)  updates +\d+  return +\S+  episodes +\d+  lag \d+\.\d\d(  eta (\d+h)?(\d+m)?\d+s)?$",
                 re.M)
"""A progress row as `rlpipe launch` prints it (``follow.follow``)."""


def small(tmp_path: Path, *more: str) -> list[str]:
    """Overrides that keep a run's files under tmp_path, start no metrics service and write a
    progress row every 0.2 s."""
    return [f"run.runs_dir='{tmp_path / 'runs'}'", "network.metrics_port=0", "run.log_interval_s=0.2", *more]


def segments(run_dir: Path) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"rlpipe-{Path(run_dir).name}-*")]


def test_an_experiment_is_the_same_from_a_path_a_dict_or_dataclasses_and_is_validated(tmp_path):
    overrides = ["sampler.envs=8", "algo.lr=1e-3", "run.name='api'"]
    from_path = api.experiment(PPO, overrides)
    assert from_path == api.experiment(str(PPO), overrides)
    assert from_path == api.experiment(tomllib.loads(PPO.read_text()), overrides)
    assert from_path == api.experiment(api.experiment(PPO), overrides)
    assert (from_path.sampler.envs, from_path.algo.lr, from_path.run.name) == (8, 1e-3, "api")

    built = api.experiment(PPO)
    unchecked = dataclasses.replace(built, sampler=dataclasses.replace(built.sampler, count=0))
    with pytest.raises(schema.ConfigError, match=r"^sampler.count = 0: must be >= 1$"):
        api.experiment(unchecked)  # dataclasses are checked as a TOML file is
    with pytest.raises(schema.ConfigError, match="unknown key sampler.envz"):
        api.experiment(PPO, ["sampler.envz=8"])
    with pytest.raises(TypeError):
        api.experiment(42)

    # Serial mode runs one learner: refused before anything is built, and no run directory stays.
    with pytest.raises(schema.ConfigError, match="learner.count = 2: serial mode runs one learner"):
        api.train_serial(api.experiment(PPO, small(tmp_path, "learner.count=2")), quiet=True)
    assert list((tmp_path / "runs").iterdir()) == []
    with pytest.raises(api.LaunchError, match="backend 'slurm'"):
        api.launch(api.experiment(PPO, small(tmp_path)), "slurm")
    assert list((tmp_path / "runs").iterdir()) == []
    with pytest.raises(api.NotResumable, match="no run directory"):
        api.resume(tmp_path / "nothing")


def test_serial_rows_are_printed_as_launch_prints_them(tmp_path):
    """``follow.follow`` prints a launched run's rows from progress.csv in ``follow.format_row``'s
    line, which serial mode's terminal prints too: the row's fields, and the evaluation column
    once there is one."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    base = {field: "" for field in PROGRESS_FIELDS}
    rows = [{**base, "wall_s": 0.52, "env_steps": 256, "env_steps_per_s": 1596.3, "updates": 1, "policy_version": 1,
             "episodes": 7, "mean_return": 12.14, "policy_lag": 0.0},
            {**base, "wall_s": 61.2, "env_steps": 1_234_567, "env_steps_per_s": 20123.0, "updates": 4821,
             "policy_version": 4821, "episodes": 9000, "mean_return": float("nan"), "policy_lag": 1.06,
             "eval_return": 475.5, "eval_policy_version": 4800, "eta_s": 185.04}]
    assert set(evaluation.PROGRESS_COLUMNS) <= set(PROGRESS_FIELDS)
    for row in rows:
        append_csv(run_dir / "progress.csv", PROGRESS_FIELDS, row)
    (run_dir / "result.json").write_text('{"reason": "target"}')
    out = io.StringIO()
    assert follow.follow(run_dir, 1.0, out) == {"reason": "target"}
    assert out.getvalue().splitlines() == [follow.format_row(row) for row in rundirs.read_progress(run_dir)]
    assert ROW.match(out.getvalue().splitlines()[0]) and out.getvalue().splitlines()[1].endswith("  eval 475.5 (v4800)  eta 3m05s")


@pytest.mark.learning
def test_the_api_launches_a_cartpole_ppo_run_and_follows_it_to_its_result(tmp_path):
    exp = api.experiment(PPO, small(tmp_path, "run.log_interval_s=0.5", "run.target_return=200.0"))
    out = io.StringIO()
    t0 = time.monotonic()
    with api.launch(exp) as run:  # back once the learner has built the agent
        try:
            assert run.running() and (run.dir / "acting.json").exists()
            assert run.inference.startswith("inference ")
            result = run.follow(out)
            took = time.monotonic() - t0
            assert result == run.result() == rundirs.read_result(run.dir)
            assert result["reason"] == "target" and result["mean_return"] >= 200, result
            lines = out.getvalue().splitlines()
            assert lines and all(ROW.match(line) for line in lines), lines
            assert len(lines) == len(run.progress())
            # The ETA to the step budget: none at the first row (its rate would count the start-up),
            # then the remaining steps at the rate over the ETA_ROWS rows before (one interval
            # without an env step on a loaded machine leaves the window's rate above 0).
            rows = run.progress()
            assert rows[0]["eta_s"] == "nan" and "eta" not in lines[0] and " eta " in lines[-1]
            for i, row in enumerate(rows[1:], 1):
                before = rows[max(0, i - ETA_ROWS)]
                dt = float(row["wall_s"]) - float(before["wall_s"])
                steps = int(row["env_steps"]) - int(before["env_steps"])
                if dt == 0 or steps == 0:  # the last row can follow a periodic one within wall_s's 10 ms rounding
                    continue
                assert 0 < float(row["eta_s"]) < 5 * (exp.run.max_env_steps - int(row["env_steps"])) * dt / steps, row
            assert list(run.rows()) == run.progress()  # an ended run: its rows, then the end
            assert not run.running() and supervisor.service_pids(run.dir) == [] and segments(run.dir) == []
        finally:
            run.clean()
    assert took < 90, f"launch to result took {took:.1f} s"


@pytest.mark.learning
def test_train_serial_learns_cartpole_to_the_target_in_a_run_directory(tmp_path):
    """What the pipeline learns, serial mode learns (the same config, its own target), and it
    leaves the run directory a launched run leaves, with nothing in /dev/shm."""
    out = io.StringIO()
    t0 = time.monotonic()
    result = api.train_serial(api.experiment(PPO, [f"run.runs_dir='{tmp_path}'"]), out=out)
    assert result["reason"] == "target" and result["mean_return"] >= 475 and result["env_steps"] <= 200_000, result
    assert time.monotonic() - t0 < 180
    run_dir = Path(result["run_dir"])
    assert run_dir.parent == tmp_path and segments(run_dir) == []
    for name in (RUN_CONFIG, "progress.csv", "result.json", CHECKPOINT, f"logs/{runfiles.SERIAL_LOG}"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / TB_DIR).glob("events.out.tfevents.*"))
    assert rundirs.read_result(run_dir) == {k: v for k, v in result.items() if k != "run_dir"}
    assert torch.load(run_dir / CHECKPOINT, weights_only=True)["env_steps"] == result["env_steps"]
    lines = out.getvalue().splitlines()
    assert lines[0] == f"run directory: {run_dir}" and len(lines) == 1 + len(rundirs.read_progress(run_dir)) > 3
    assert all(ROW.match(line) for line in lines[1:]), lines


def test_rlpipe_train_serial_makes_a_run_directory_ls_plot_evaluate_and_launch_resume_work_on(tmp_path):
    out = rlpipe("train", str(PPO), "--serial", *(a for s in small(tmp_path, "run.max_env_steps=3072")
                                                    for a in ("--set", s)))
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = Path(re.search(r"^run directory: (\S+)$", out.stdout, re.M).group(1))
    rows = [line for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(rows) == len(rundirs.read_progress(run_dir)) >= 2 and all(ROW.match(r) for r in rows), out.stdout
    assert re.search(r"^serial run ended \(budget\): mean return \S+ after 3072 env steps in ", out.stdout, re.M)
    for name in (RUN_CONFIG, "progress.csv", "result.json", CHECKPOINT, f"logs/{runfiles.SERIAL_LOG}"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / TB_DIR).glob("events.out.tfevents.*")) and segments(run_dir) == []
    assert "services.learner.learner: steps 3072" in (run_dir / "logs" / runfiles.SERIAL_LOG).read_text()

    listed = rlpipe_here("ls", str(tmp_path / "runs"))
    assert listed.returncode == 0 and re.search(rf"\| {run_dir.name} \| ended \| budget \| 3072 \|", listed.stdout), \
        listed.stdout
    plotted = rlpipe_here("plot", str(run_dir), "--out", str(tmp_path / "curve.png"))
    assert plotted.returncode == 0 and (tmp_path / "curve.png").stat().st_size > 10_000, plotted.stderr
    evaluated = rlpipe_here("evaluate", str(run_dir), "--episodes", "2")
    assert evaluated.returncode == 0 and "2 greedy episodes of policy version" in evaluated.stdout, evaluated.stderr

    # The pipeline starts from the serial run's checkpoint (its step budget is spent: it ends at once).
    resumed = rlpipe_here("launch", "--resume", str(run_dir), "--detach")
    try:
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        again = Run(run_dir).wait_result(60)
        assert again["reason"] == "budget" and again["env_steps"] == 3072, again
        assert "resumed from" in (run_dir / "logs" / "learner0.log").read_text()
        assert (run_dir / "result.previous.json").exists()
    finally:
        Run(run_dir).close()
    assert segments(run_dir) == []


def test_an_interrupted_serial_run_keeps_a_checkpoint_and_resumes_from_it(tmp_path):
    """Ctrl-C (KeyboardInterrupt) in serial mode writes a checkpoint; ``train_serial(resume=RUN)``
    goes on from it to the run's end in the same directory."""
    # A budget the run cannot reach before the interrupt (8192 once ended first, alone on the CPU).
    exp = api.experiment(PPO, small(tmp_path, "run.max_env_steps=32768"))
    root = tmp_path / "runs"

    def interrupt_once_learning():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                learning = any(int(r["env_steps"]) >= 1024 for d in root.glob("*") for r in rundirs.read_progress(d))
            except (TypeError, ValueError):  # a row still being written
                learning = False
            if learning:
                _thread.interrupt_main()
                return
            time.sleep(0.02)

    threading.Thread(target=interrupt_once_learning, daemon=True).start()
    # Ctrl-C's own handler: a SIGINT handler another test of this worker left (a library's) would
    # take the simulated Ctrl-C instead (DID NOT RAISE in whole suites, never alone)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            api.train_serial(exp, quiet=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    [run_dir] = root.iterdir()
    steps = torch.load(run_dir / CHECKPOINT, weights_only=True)["env_steps"]
    assert 1024 <= steps < 32768 and rundirs.read_result(run_dir) is None and segments(run_dir) == []

    result = api.train_serial(resume=run_dir, quiet=True)
    assert result["reason"] == "budget" and result["env_steps"] >= 32768 and result["run_dir"] == str(run_dir)
    assert f"resumed from {run_dir / CHECKPOINT}: version" in (run_dir / "logs" / runfiles.SERIAL_LOG).read_text()
    assert int(rundirs.read_progress(run_dir)[-1]["env_steps"]) == result["env_steps"]
