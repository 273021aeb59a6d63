"""Watching and comparing runs: the learner's TensorBoard files, `rlpipe plot`, `rlpipe grid`,
`rlpipe ls` and `rlpipe tensorboard`.

One tiny grid of real runs serves every test here (module fixture): CartPole PPO with
algo.lr = 1e-3 and 5e-4, seeds 0 and 1, 12k env steps each (mean returns reach 40-80, short
of the target 150, which keeps the plot's y axis close to the curves), two runs at a time;
the test kills the supervisord of one run (lr 5e-4, seed 0) with SIGKILL while it learns.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from shared.config import checks, endpoints, loading, schema
from shared.launch import rundirs, supervisor
from shared.launch.lab import runs
from shared.launch.lab import stats
from shared.launch.lab.grid import STATS, SUMMARY, Ports, parse_vary, processes_per_run
from shared.launch.lab.plots import flat_config
from shared.runtime.runfiles import TB_DIR
from tests.pipeline import CONFIGS, REPO, free_port, rlpipe, rlpipe_command

STEPS = 12_000


def kill_supervisord_once_learning(root: Path, pattern: str, timeout: float = 300) -> Path:
    """SIGKILL the supervisord of the run matching ``pattern`` under ``root`` once it has
    written progress and before it ends; its run directory."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for run_dir in root.glob(pattern):
            pid = supervisor.supervisord_pid(run_dir)
            if pid and rundirs.read_progress(run_dir) and rundirs.read_result(run_dir) is None:
                os.kill(pid, signal.SIGKILL)
                return run_dir
        time.sleep(0.05)
    raise AssertionError(f"no run {pattern} learning under {root} within {timeout:.0f} s")


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """(grid directory, `rlpipe grid` output, {(algo.lr, run.seed): run dir}, the killed run's dir)."""
    root = tmp_path_factory.mktemp("grid")
    proc = subprocess.Popen(**rlpipe_command(
        "grid", str(CONFIGS / "cartpole_ppo.toml"), "--vary", "algo.lr=1e-3,5e-4", "--seeds", "0,1", "--parallel", "2",
        "--set", f"run.runs_dir='{root}'", "--set", f"run.max_env_steps={STEPS}", "--set", "run.log_interval_s=0.2",
        "--set", "run.target_return=150", "--set", "network.metrics_port=0"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        killed = kill_supervisord_once_learning(root, "grid_*/lr_0.0005_seed_0_*")
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    grid_dir = Path(re.search(r"^grid (\S+):", out.stdout, re.M).group(1))
    run_dirs = {(c["algo.lr"], c["run.seed"]): d for d, c in ((d, flat_config(d)) for d in runs.find_runs(grid_dir))}
    yield grid_dir, out, run_dirs, killed
    for d in run_dirs.values():
        killed, removed = supervisor.clean(d)
        assert not killed and not removed, f"{d.name} left processes {killed} or segments {removed}"


def good_runs(grid) -> list[Path]:
    return [grid[2][(1e-3, seed)] for seed in (0, 1)]


def test_grid_runs_every_variant_and_seed_two_at_a_time_and_survives_a_killed_supervisord(grid):
    grid_dir, out, run_dirs, killed = grid
    assert out.returncode == 1, out.stdout + out.stderr  # not every run ended with a result
    assert sorted(run_dirs) == [(5e-4, 0), (5e-4, 1), (1e-3, 0), (1e-3, 1)], out.stdout
    assert run_dirs[(5e-4, 0)] == killed
    assert all(d.parent == grid_dir and d.name.startswith(("lr_0.001_seed_", "lr_0.0005_seed_")) for d in run_dirs.values())
    rows = [line.split("|")[1:-1] for line in (grid_dir / SUMMARY).read_text().splitlines()[2:]]
    summary = {(r[0].strip(), int(r[1])): [c.strip() for c in r] for r in rows}
    assert len(rows) == 4 and len(summary) == 4, rows
    for key, row in summary.items():
        if key == ("lr=0.0005", 0):
            assert row[2] == "killed", row  # supervisord died under its services
        else:
            assert row[2] == "budget" and int(row[6]) >= STEPS and math.isfinite(float(row[5])), row
    assert rundirs.read_result(killed) is None
    assert "lr=0.0005 seed 0: killed" in out.stdout
    starts = [line for line in out.stdout.splitlines() if ": started " in line]
    assert len(starts) == 4 and "2 at a time" in out.stdout
    # the killed run's orphaned services were stopped and its segments removed (the fixture's
    # teardown checks every run the same way)
    assert supervisor.service_pids(killed) == [] and not list(Path("/dev/shm").glob(f"*{killed.name}*"))
    for png in ("lr_0.001.png", "lr_0.0005.png", "all.png"):
        assert (grid_dir / png).stat().st_size > 10_000, png
    # stats.md: each variant's final returns over the seeds that ended as configured (the killed
    # run is left out); of two runs the IQM is their mean, and the 95% interval spans them.
    lines = (grid_dir / STATS).read_text().splitlines()
    assert [c.strip() for c in lines[2].strip("|").split("|")] == list(stats.COLUMNS), lines
    stat_rows = {r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[4:])}
    finals = sorted(float(summary[("lr=0.001", seed)][5]) for seed in (0, 1))
    method, task, n, iqm, iqm_ci, mean, mean_ci = stat_rows["lr=0.001"]
    assert (task, n) == ("CartPole-v1", "2") and float(iqm) == pytest.approx(np.mean(finals), rel=1e-3)
    assert iqm_ci == mean_ci == f"[{finals[0]:.4g}, {finals[1]:.4g}]"
    assert stat_rows["lr=0.0005"][2] == "1" and "Final returns over seeds" in out.stdout


def test_tensorboard_files_hold_the_progress_scalars_and_diagnostics_against_env_steps(grid):
    from tensorboard.backend.event_processing import event_accumulator

    run_dir = good_runs(grid)[0]
    acc = event_accumulator.EventAccumulator(str(run_dir / TB_DIR))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {f"progress/{f}" for f in ("mean_return", "mean_length", "env_steps_per_s", "updates_per_s",
                                          "policy_lag", "wall_s", "episodes", "updates", "dropped", "replay_size")}
    expected |= {f"algo/{t}" for t in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction",
                                       "grad_norm", "explained_variance", "lr")}
    expected |= {f"time/learner_{phase}" for phase in ("batch", "update", "publish", "report", "checkpoint")}
    assert expected <= tags, expected - tags
    # The learner's time split: its phases' shares of each row's interval add up to 1.
    split = [sum(acc.Scalars(f"time/learner_{p}")[i].value for p in ("batch", "update", "publish", "report",
                                                                       "checkpoint")) for i in (1, -1)]
    assert split == [pytest.approx(1.0, abs=0.02)] * 2, split
    rows = rundirs.read_progress(run_dir)
    returns = {int(r["env_steps"]): float(r["mean_return"]) for r in rows if math.isfinite(float(r["mean_return"]))}
    events = {e.step: e.value for e in acc.Scalars("progress/mean_return")}
    assert len(events) >= 5 and events.keys() == returns.keys()
    assert all(abs(events[s] - returns[s]) < 1e-3 for s in returns)
    assert max(e.step for e in acc.Scalars("algo/entropy")) == int(rows[-1]["env_steps"])
    assert 0 < acc.Scalars("algo/entropy")[0].value <= math.log(2) + 1e-6  # CartPole: 2 actions
    lengths = [e.value for e in acc.Scalars("progress/mean_length")]
    assert min(lengths) >= 8 and max(lengths) <= 500


def band_pixels(png: Path, color: str, alpha: float) -> int:
    """Pixels of ``png`` of ``color`` drawn at ``alpha`` over white (a band nothing covers)."""
    from matplotlib import colors, image

    img = image.imread(png)[..., :3]
    band = alpha * np.array(colors.to_rgb(color)) + (1 - alpha)
    return int((np.abs(img - band).max(axis=-1) < 2 / 255).sum())


def test_plot_of_two_seeds_draws_one_band_for_their_config(grid, tmp_path):
    from matplotlib import image

    from shared.launch.lab.plots import BAND_ALPHA

    runs_ = [str(d) for d in good_runs(grid)]
    one, per_seed = tmp_path / "one.png", tmp_path / "per_seed.png"
    for png, extra in ((one, []), (per_seed, ["--group-by", "run.seed"])):
        out = rlpipe("plot", *runs_, "--out", str(png), *extra)
        assert out.returncode == 0, out.stdout + out.stderr
        assert image.imread(png).shape[:2] == (500, 800)
    bands = [band_pixels(one, c, BAND_ALPHA) for c in ("C0", "C1")]
    # The band's area is the two seeds' spread: 800-2500 pixels in runs of the shipped config
    # since it learns at 256 env steps an update (over 2000 before, when seeds parted more).
    assert bands[0] > 300 and bands[1] == 0, bands
    # one curve per seed: two lines and no band
    assert max(band_pixels(per_seed, c, BAND_ALPHA) for c in ("C0", "C1")) < bands[0] / 10


def test_ls_lists_each_run_with_its_status_and_result(grid):
    grid_dir, _, run_dirs, killed = grid
    out = rlpipe("ls", str(grid_dir))
    assert out.returncode == 0, out.stderr
    lines = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
             for line in out.stdout.splitlines()[2:]}
    assert set(lines) == {d.name for d in run_dirs.values()}
    for d in run_dirs.values():
        row = lines[d.name]
        assert row[1:3] == (["crashed", ""] if d == killed else ["ended", "budget"]), row  # no result: crashed


def test_tensorboard_serves_the_runs_on_loopback(grid):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "shared.launch.cli", "tensorboard", str(grid[0]), "--port", str(port)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        expected = {f"{d.name}/." for d in good_runs(grid)}  # each name's tb dir itself holds the events
        deadline, served = time.monotonic() + 60, set()
        while not expected <= served:
            assert time.monotonic() < deadline, f"TensorBoard served {served} after 60 s, not {expected}"
            time.sleep(0.5)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=5) as r:
                    served = set(json.loads(r.read()))
            except OSError:
                pass  # not listening yet
    finally:
        proc.terminate()
        proc.wait(10)


# ---------------------------------------------------------------- without runs


def test_vary_makes_the_product_of_values_with_short_labels():
    variants = parse_vary(["algo.lr=1e-3,3e-4", "sampler.count=1,2"])
    assert [v.label for v in variants] == ["lr=0.001,count=1", "lr=0.001,count=2", "lr=0.0003,count=1",
                                           "lr=0.0003,count=2"]
    assert variants[3].overrides == ("algo.lr=3e-4", "sampler.count=2")
    assert [v.label for v in parse_vary(["algo.lr=1", "run.lr=2"])] == ["algo.lr=1,run.lr=2"]
    with pytest.raises(schema.ConfigError, match="algo.lr=1e-3,3e-4"):
        parse_vary(["lr=1"])


def test_vary_takes_arrays_and_inline_tables_as_one_value_each():
    groups = ["{ good = 'agent_*', adversaries = 'adversary_*' }", "{ all = '*' }"]
    variants = parse_vary(["model.hidden_sizes=[64,64],[256, 256]", f"env.groups={groups[0]},{groups[1]}"])
    assert [v.overrides for v in variants] == [(f"model.hidden_sizes={h}", f"env.groups={g}")
                                               for h in ("[64,64]", "[256, 256]") for g in groups]
    assert variants[0].label == "hidden_sizes=[64;64],groups={good=agent_*;adversaries=adversary_*}"
    assert variants[0].method == variants[0].label  # a label's fields part at its commas alone
    # a comma inside a string, escaped quotes included, belongs to the string
    assert [v.overrides for v in parse_vary(['run.name="a,\\"b",c', "run.seed=1"])] == [
        ('run.name="a,\\"b"', "run.seed=1"), ("run.name=c", "run.seed=1")]
    exp = loading.load(CONFIGS / "simple_adversary_groups_ppo.toml", list(variants[2].overrides))
    assert list(exp.env.groups.items()) == [("good", "agent_*"), ("adversaries", "adversary_*")]
    assert exp.model.hidden_sizes == (256, 256)


def test_a_vary_string_with_commas_keeps_its_labels_fields_apart():
    """A string value may hold commas (env.kwargs is JSON in a string): its label shows none, so the
    label's fields stay one per --vary axis and ``method`` drops the env.id field, not a piece of another."""
    variants = parse_vary(["""env.kwargs='{"N": 2, "local_ratio": 0.5}','{"N": 3}'""", "env.id=A,B"])
    assert [v.overrides[0] for v in variants[::2]] == ["""env.kwargs='{"N": 2, "local_ratio": 0.5}'""",
                                                      """env.kwargs='{"N": 3}'"""]
    assert variants[0].label == 'kwargs={"N": 2; "local_ratio": 0.5},id=A'
    assert variants[0].method == variants[1].method == 'kwargs={"N": 2; "local_ratio": 0.5}'


def test_concurrent_runs_get_distinct_free_ports():
    exp = loading.load(CONFIGS / "cartpole_ppo.toml", ["network.transport='tcp'"])
    ports = Ports()
    first, second = ports.assign(exp), ports.assign(exp)
    blocks = [set(range(e.network.base_port, e.network.base_port + len(endpoints.tcp_offsets(e)))) | {e.network.metrics_port}
              for e in (first, second)]
    assert not blocks[0] & blocks[1]
    assert all(endpoints.port_free("127.0.0.1", p) for p in blocks[0] | blocks[1])
    ports.release(first)
    assert ports.assign(exp).network.metrics_port == first.network.metrics_port
    # Another grid started at the same time (its own Ports: another process's, as flocks go)
    # skips the ports this one handed out although nothing has bound them yet.
    other = Ports().assign(exp)
    assert other.network.metrics_port not in {first.network.metrics_port, second.network.metrics_port}
    assert other.network.base_port not in {first.network.base_port, second.network.base_port}
    # the default run keeps 3 processes busy (sampler, replay, learner); 4 with a second sampler:
    # on 2 cores one run at a time
    assert processes_per_run(checks.resolve_inference(loading.load(CONFIGS / "cartpole_ppo.toml"))[0]) == 3
    assert processes_per_run(checks.resolve_inference(loading.load(CONFIGS / "cartpole_ppo.toml",
                                                                  ["sampler.count=2"]))[0]) == 4


def test_summary_counts_steps_and_time_to_target_only_for_runs_that_reached_it(tmp_path):
    (tmp_path / "config.toml").write_text("")
    with (tmp_path / "progress.csv").open("w", newline="") as f:
        csv.writer(f).writerows([["wall_s", "env_steps", "mean_return"], [1.0, 100, 20.0]])
    assert runs.summary(tmp_path)["status"] == "crashed"
    assert runs.summary(tmp_path)["final_return"] == "20.0"
    for reason, to_target in (("target", 5000), ("budget", "")):
        (tmp_path / "result.json").write_text(json.dumps({"reason": reason, "env_steps": 5000, "wall_s": 9.5,
                                                          "mean_return": 480.0}))
        row = runs.summary(tmp_path)
        assert (row["status"], row["steps_to_target"], row["final_return"]) == ("ended", to_target, 480.0)
