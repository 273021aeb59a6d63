"""Multi-seed statistics (shared/launch/lab/stats.py): IQM, mean and their stratified bootstrap
intervals equal rliable's on fixed scores and hand computations; `rlpipe plot --stats` and a
grid's stats.md over run directories made as launch and grid make them."""

from __future__ import annotations

import csv
import json
import re

import numpy as np
import pytest

from shared.config import loading
from shared.launch.lab import grid, plots, stats
from shared.runtime.runfiles import RUN_CONFIG
from tests.pipeline import CONFIGS, rlpipe_here

SCORES = np.random.RandomState(3).normal(size=(7, 3)) * [1.0, 10.0, 100.0]  # 7 runs x 3 tasks of unlike scales


def rliable_library():
    """rliable.library, or a skip: it imports arch, whose releases break with some pandas ones."""
    try:
        from rliable import library
    except Exception as e:  # noqa: BLE001 (ImportError, or arch's TypeError at import under pandas 3)
        pytest.skip(f"rliable.library does not import here: {type(e).__name__}: {e}")
    return library


def test_iqm_and_mean_equal_rliables_on_fixed_scores():
    metrics = pytest.importorskip("rliable.metrics")
    for scores in (SCORES, SCORES[:4, :1], SCORES[:1]):
        assert stats.iqm(scores) == pytest.approx(metrics.aggregate_iqm(scores), rel=1e-12)
        assert stats.mean(scores) == pytest.approx(metrics.aggregate_mean(scores), rel=1e-12)
    assert stats.iqm(np.arange(1.0, 9.0).reshape(4, 2)) == 4.5  # 1..8 less the lowest and highest two


def test_bootstrap_intervals_and_profiles_equal_rliables_with_the_same_seed():
    library, metrics = rliable_library(), pytest.importorskip("rliable.metrics")
    for ours, theirs in ((stats.iqm, metrics.aggregate_iqm), (stats.mean, metrics.aggregate_mean)):
        np.random.seed(5)  # rliable's StratifiedBootstrap draws from the global RandomState
        points, intervals = library.get_interval_estimates({"m": SCORES}, lambda s: np.array([theirs(s)]), reps=5000)
        low, high = stats.bootstrap_ci(SCORES, ours, reps=5000, seed=5)
        assert ours(SCORES) == pytest.approx(points["m"][0], rel=1e-12)
        assert (low, high) == pytest.approx(tuple(intervals["m"].ravel()), rel=1e-12)
    taus = np.linspace(-100, 100, 11)
    np.random.seed(9)
    profile, bands = library.create_performance_profile({"m": SCORES}, taus, reps=3000)
    low, high = stats.bootstrap_ci(SCORES, lambda s: stats.profile(s, taus), reps=3000, seed=9)
    np.testing.assert_array_equal(stats.profile(SCORES, taus), profile["m"])
    np.testing.assert_array_equal(np.stack([low, high]), bands["m"])


def test_bootstrap_intervals_by_hand():
    # Two runs of one task: a resample's mean is a, (a + b) / 2 or b with probabilities 1/4,
    # 1/2, 1/4, so its 2.5th and 97.5th percentiles are a and b.
    low, high = stats.bootstrap_ci(np.array([[2.0], [6.0]]), stats.mean)
    assert (low, high) == (2.0, 6.0)
    # Stratified: each task's column is drawn from its own runs. Runs that agree within each
    # task leave nothing to resample, however far apart the tasks are.
    same = np.array([[1.0, 1000.0]] * 5)
    for statistic in (stats.iqm, stats.mean):
        assert stats.bootstrap_ci(same, statistic) == (statistic(same), statistic(same))
    # More runs narrow the interval of the mean about as 1 / sqrt(runs).
    draws = np.random.RandomState(0).normal(size=(400, 1))
    widths = [np.subtract(*stats.bootstrap_ci(draws[:n], stats.mean, reps=4000)[::-1]) for n in (25, 400)]
    assert 3.0 < widths[0] / widths[1] < 5.0, widths
    np.testing.assert_array_equal(stats.profile(np.array([[0.1], [0.5], [0.9]]), np.array([0.0, 0.5, 1.0])),
                                  [1.0, 1 / 3, 0.0])


def test_scores_are_normalised_per_task_over_every_methods_runs():
    normalised = stats.normalise({"a": {"x": [0.0, 10.0], "y": [-300.0]}, "b": {"x": [5.0], "y": [-100.0, -200.0]}})
    assert {m: {t: list(v) for t, v in by_task.items()} for m, by_task in normalised.items()} == \
        {"a": {"x": [0.0, 1.0], "y": [0.0]}, "b": {"x": [0.5], "y": [1.0, 0.5]}}


def fake_run(root, name: str, env_id: str, final_return: float, reason: str = "budget"):
    """A run directory as launch leaves one after a run: its config, progress rows and result."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    exp = loading.load(CONFIGS / "cartpole_ppo.toml", [f"env.id='{env_id}'", f"run.name='{name.split('_seed')[0]}'"])
    (run_dir / RUN_CONFIG).write_text(loading.dumps(exp))
    with (run_dir / "progress.csv").open("w", newline="") as f:
        csv.writer(f).writerows([["wall_s", "env_steps", "mean_return"], [1.0, 500, final_return / 2],
                                 [2.0, 1000, final_return]])
    (run_dir / "result.json").write_text(json.dumps({"reason": reason, "env_steps": 1000, "wall_s": 2.0,
                                                     "mean_return": final_return}))
    return run_dir


RETURNS = {("ppo", "CartPole-v1"): [480.0, 300.0, 420.0], ("ppo", "Acrobot-v1"): [-90.0, -120.0, -100.0]}


def table(text: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def test_plot_stats_prints_iqm_and_mean_per_env_and_draws_a_profile_across_envs(tmp_path, capsys):
    from matplotlib import image

    dirs = [fake_run(tmp_path, f"{env}_{seed}", env, r) for (_, env), values in RETURNS.items()
            for seed, r in enumerate(values)]
    out = tmp_path / "curves.png"
    done = rlpipe_here("plot", *map(str, dirs), "--out", str(out), "--stats")
    assert done.returncode == 0, done.stderr
    rows = {r["task"]: r for r in table(done.stdout)}
    assert list(table(done.stdout)[0]) == list(stats.COLUMNS)
    cartpole = np.array(RETURNS[("ppo", "CartPole-v1")])[:, None]
    assert rows["CartPole-v1"]["runs"] == "3" and rows["CartPole-v1"]["method"] == "name=ppo"
    assert float(rows["CartPole-v1"]["mean"]) == pytest.approx(400.0)
    low, high = stats.bootstrap_ci(cartpole, stats.iqm)
    assert rows["CartPole-v1"]["iqm_ci95"] == f"[{low:.4g}, {high:.4g}]"
    assert rows["all (normalised)"]["runs"] == "3 x 2 tasks"
    profile = tmp_path / "curves_profile.png"
    assert f"wrote {profile}" in done.stdout and image.imread(profile).shape[:2] == (500, 800)


def test_grid_stats_of_a_grid_directory_count_finished_runs_per_variant_and_env(tmp_path):
    from matplotlib import image

    variants = grid.parse_vary(["algo.lr=1e-3,5e-4", "env.id='CartPole-v1','Acrobot-v1'"])
    assert [v.method for v in variants] == ["lr=0.001", "lr=0.001", "lr=0.0005", "lr=0.0005"]
    rows = []
    for v in variants:
        env = re.search(r"id=(\S+)", v.label).group(1)
        for seed, r in enumerate(RETURNS[("ppo", env)] + [0.0]):
            reason = "crashed" if seed == 3 else "budget"  # a crashed run's last return is no final one
            name, r = f"{v.label.replace(',', '_')}_seed{seed}", r * (2 if v.method == "lr=0.001" else 1)
            fake_run(tmp_path, name, env, r, reason)
            rows.append({"variant": v.label, "seed": seed, "reason": reason, "final_return": r, "run": name})
    scores = grid.final_scores(tmp_path, rows, {v.label: v.method for v in variants})
    assert scores["lr=0.0005"] == {"CartPole-v1": RETURNS[("ppo", "CartPole-v1")],
                                   "Acrobot-v1": RETURNS[("ppo", "Acrobot-v1")]}
    lines = grid.write_stats(tmp_path, scores)
    written = table((tmp_path / grid.STATS).read_text())
    assert table(lines[0]) == written and list(written[0]) == list(stats.COLUMNS)
    assert [(r["method"], r["task"], r["runs"]) for r in written] == [
        ("lr=0.001", "CartPole-v1", "3"), ("lr=0.001", "Acrobot-v1", "3"),
        ("lr=0.0005", "CartPole-v1", "3"), ("lr=0.0005", "Acrobot-v1", "3"),
        ("lr=0.001", "all (normalised)", "3 x 2 tasks"), ("lr=0.0005", "all (normalised)", "3 x 2 tasks")]
    assert float(written[0]["iqm"]) == pytest.approx(800.0)  # of 3 runs int(3 / 4) = 0 are cut: their mean
    assert image.imread(tmp_path / grid.PROFILE).shape[:2] == (500, 800)


def test_a_target_out_of_the_curves_reach_gets_no_line_and_the_others_do():
    """MinAtar's budget-only configs set target_return = 1e9: a line there would stretch the y
    axis to 1e9 and draw every curve flat on the floor."""
    assert plots.targets_in_reach({1e9, 475.0, 30.0}, 0.0, 500.0) == [30.0, 475.0]
    assert plots.targets_in_reach({1e9}, -2.0, 12.0) == []
    assert plots.targets_in_reach({-200.0, -100.0}, -1500.0, -150.0) == [-200.0, -100.0]
