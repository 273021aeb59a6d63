"""A campaign that outlives its launcher: `rlpipe grid --resume` and `rlpipe results`.

One small grid of real runs (module fixture): CartPole PPO, one seed, two budgets (6k and 24k
env steps), one run at a time, checkpoints every second. Its launcher is killed (SIGKILL) once
the first run has ended and the second has a checkpoint; the second runs on without it (its
supervisord is a daemon) until `grid --resume` stops it and starts it again from its checkpoint:
its budget is seconds longer than the resume takes to reach it, and many times the env steps the
orphan makes before the resume stops it (a few thousand: it is stopped within a second of its
first checkpoint), yet short enough that the resumed run ends soon.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import signal
import subprocess
from pathlib import Path

import pytest

from shared.launch.lab import gridfile, results, runs
from shared.launch import provenance, rundirs, supervisor
from shared.launch.lab.grid import SUMMARY
from shared.runtime import evaluation
from tests.pipeline import CONFIGS, rlpipe_command, rlpipe_here, wait_for

SHORT, LONG = 6_000, 24_000


def fingerprint(path: Path) -> tuple[int, str]:
    return path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """(grid dir, {budget: run dir}, the finished run's files' fingerprints, the stopped run's
    env steps when its launcher was killed, `grid --resume`'s output)."""
    root = tmp_path_factory.mktemp("campaign")
    log = (root / "grid.log").open("w")  # not a pipe: the runs' supervisords outlive the launcher
    proc = subprocess.Popen(**rlpipe_command(
        "grid", str(CONFIGS / "cartpole_ppo.toml"), "--vary", f"run.max_env_steps={SHORT},{LONG}", "--parallel", "1",
        "--set", f"run.runs_dir='{root}'", "--set", "run.log_interval_s=0.2", "--set", "run.target_return=1e9",
        "--set", "learner.checkpoint_interval_s=1", "--set", "network.metrics_port=0"), stdout=log,
        stderr=subprocess.STDOUT)
    try:
        grid_dir = wait_for(lambda: next(root.glob("grid_*"), None), 120, "the grid directory")

        def started() -> dict[str, Path] | None:
            try:
                names = gridfile.GridFile.load(grid_dir).runs
            except gridfile.NotAGrid:
                return None
            by_budget = {seed_budget: grid_dir / name for (label, _), name in names.items()
                         for seed_budget in (int(label.split("=")[1]),)}
            return by_budget if len(by_budget) == 2 else None

        dirs = wait_for(started, 300, "the second run to start")
        long_dir = dirs[LONG]
        wait_for(lambda: (long_dir / "checkpoints").exists() and any((long_dir / "checkpoints").iterdir())
                 and rundirs.read_progress(long_dir) and int(rundirs.read_progress(long_dir)[-1]["env_steps"]) > 0,
                 300, "the second run's checkpoint")
        assert rundirs.read_result(dirs[SHORT])["reason"] == "budget"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        steps_at_kill = int(rundirs.read_progress(long_dir)[-1]["env_steps"])
        assert rundirs.read_result(long_dir) is None and steps_at_kill < LONG
        kept = {f: fingerprint(dirs[SHORT] / f) for f in ("result.json", "progress.csv")}
        out = rlpipe_here("grid", "--resume", str(grid_dir))
        yield grid_dir, dirs, kept, steps_at_kill, out
    finally:
        proc.kill()
        log.close()
        for d in runs.find_runs(root):
            killed, removed = supervisor.clean(d)
            assert not killed and not removed, f"{d.name} left processes {killed} or segments {removed}"


def test_a_killed_grid_resumes_its_stopped_run_from_its_checkpoint_and_keeps_the_finished_one(resumed):
    grid_dir, dirs, kept, steps_at_kill, out = resumed
    assert out.returncode == 0, out.stdout + out.stderr
    assert runs.find_runs(grid_dir) == sorted(dirs.values())  # no run directory was added
    short, long_ = dirs[SHORT], dirs[LONG]
    assert {f: fingerprint(short / f) for f in kept} == kept
    assert f"max_env_steps={SHORT} seed 0: kept {short.name} (budget)" in out.stdout
    assert f"stopping {long_.name}, left running by the launcher that stopped" in out.stdout
    assert f"resumed {long_.name} from its checkpoint" in out.stdout
    result = rundirs.read_result(long_)
    assert result["reason"] == "budget" and result["env_steps"] >= LONG
    # The learner took up its checkpoint (written when the resume stopped the orphaned run, at
    # or after the steps it had when its launcher died) and counted on from there, never from 0.
    resumed_at = [int(m) for m in re.findall(r"resumed from \S+: version \d+, (\d+) env steps",
                                             (long_ / "logs" / "learner0.log").read_text())]
    assert len(resumed_at) == 1 and resumed_at[0] >= steps_at_kill > 0, resumed_at
    steps = [int(r["env_steps"]) for r in rundirs.read_progress(long_)]
    assert steps == sorted(steps) and steps[-1] >= LONG
    rows = (grid_dir / SUMMARY).read_text().splitlines()[2:]
    assert [r.split(" | ")[2] for r in rows] == ["budget", "budget"], rows
    assert not supervisor.running(long_) and not list(Path("/dev/shm").glob(f"rlpipe-{long_.name}-*"))


def test_results_rows_of_a_grid_hold_what_its_run_directories_hold(resumed, tmp_path):
    grid_dir = resumed[0]
    md, js = tmp_path / "rows.md", tmp_path / "rows.json"
    out = rlpipe_here("results", str(grid_dir), "--out", str(md), "--json", str(js))
    assert out.returncode == 0, out.stderr
    rows = json.loads(js.read_text())
    assert len(rows) == 2  # one per budget (variant), each over its one seed
    plan = gridfile.GridFile.load(grid_dir).plan
    for row in rows:
        (run_name,) = row["runs"]
        run_dir = grid_dir / run_name
        result, meta = rundirs.read_result(run_dir), provenance.read(run_dir)
        assert (row["algorithm"], row["env"], row["config"], row["seeds"]) == ("ppo", "CartPole-v1",
                                                                               "cartpole_ppo.toml", [0])
        assert row["env_steps"] == [result["env_steps"]] and row["wall_s"] == [result["wall_s"]]
        assert row["final_returns"] == [round(result["mean_return"], 1)] and math.isfinite(row["final_returns"][0])
        assert row["greedy_returns"] == [None]  # no evaluator ran
        assert (row["created"], row["commits"], row["cpu"]) == ([meta["created"]], [meta["commit"]], [meta["cpu"]])
        label = next(r["variant"] for r in plan["runs"] if r["run"] == run_name)
        variant = next(v for v in plan["variants"] if v["label"] == label)
        assert row["command"].startswith("rlpipe grid deploy/configs/cartpole_ppo.toml --set ")
        assert f"--set {variant['overrides'][0]} --seeds 0 --parallel 1" in row["command"]
        assert row["reference"].startswith("500 ± 0 at 100k env steps")
    table = md.read_text().splitlines()
    assert table[0].startswith("| algorithm | env (config) | env steps | seeds | final mean return")
    assert len(table) == 4 and "\n".join(table) in out.stdout
    assert f"| PPO | CartPole-v1 (`cartpole_ppo.toml`) | {rows[0]['env_steps'][0]:,} | 1 (0) |" in table[2]


def test_results_group_seeds_of_one_config_with_median_spread_and_greedy_returns(tmp_path):
    """Three run directories of one config (seeds 0-2) as a launch makes them, with a result
    each and an evaluation for two: one row, the median and range of the finals, the greedy ones."""
    from shared.launch import api

    dirs = []
    for seed, final in ((0, 400.0), (1, 480.5), (2, 300.25)):
        exp = api.experiment(CONFIGS / "cartpole_dqn.toml", [f"run.runs_dir='{tmp_path}'", f"run.seed={seed}"])
        d = rundirs.make_run_dir(exp)
        (d / "result.json").write_text(json.dumps({"reason": "budget", "env_steps": 1000 * (seed + 1), "updates": 1,
                                                   "mean_return": final, "wall_s": 10.0 + seed}))
        if seed < 2:
            evaluation.record(d, {"policy_version": 3, "env_steps": 900, "episodes": 10, "mean_return": 500.0 - seed,
                                  "std_return": 1.5, "min_return": 0, "max_return": 0, "eval_s": 1, "wall_time": 0,
                                  "video": ""})
        dirs.append(d)
    (row,) = results.rows(dirs)
    assert row["seeds"] == [0, 1, 2] and row["final_returns"] == [400.0, 480.5, 300.2]
    assert [g and g["mean_return"] for g in row["greedy_returns"]] == [500.0, 499.0, None]
    cells = results.markdown([row]).splitlines()[2].split(" | ")
    assert cells[2:5] == ["2,000 median (1,000–3,000)", "3 (0, 1, 2)",
                          "400, 480.5, 300.2 (seed 0, 1, 2); median 400 (300.2–480.5); ended: budget"]
    assert cells[5] == ("500 ± 1.5 (10 episodes at 900 env steps); 499 ± 1.5 (10 episodes at 900 env steps) "
                        "(± over episodes)")
    meta = provenance.read(dirs[0])
    assert cells[7].startswith(meta["created"][:10]) and cells[7].endswith(f" UTC, {meta['commit']}, {meta['cpu']}")
    assert cells[8] == "500 ± 0 at 50k (rl-baselines3-zoo)"  # the known reference for DQN on CartPole
    assert results.rows(dirs, "none published")[0]["reference"] == "none published"


def test_ppo_on_v_trace_advantages_is_its_own_row_named_appo(tmp_path):
    from shared.launch import api

    dirs = []
    for advantages in ("gae", "vtrace"):
        exp = api.experiment(CONFIGS / "cartpole_ppo.toml", [f"run.runs_dir='{tmp_path}'", f"algo.advantages='{advantages}'"])
        d = rundirs.make_run_dir(exp)
        (d / "result.json").write_text(json.dumps({"reason": "budget", "env_steps": 1000, "updates": 1,
                                                   "mean_return": 100.0, "wall_s": 10.0}))
        dirs.append(d)
    rows = results.rows(dirs)
    assert [r["algorithm"] for r in rows] == ["ppo", "APPO (PPO, V-trace advantages)"]
    assert [line.split(" | ")[0] for line in results.markdown(rows).splitlines()[2:]] == \
        ["| PPO", "| APPO (PPO, V-trace advantages)"]


def test_results_show_a_grouped_runs_greedy_return_per_agent_group(tmp_path):
    """Agent groups that want opposite things: the row's greedy cell names each group's return
    (`rlpipe evaluate`'s ``group_returns``) beside the mean over all agents."""
    from shared.launch import api

    exp = api.experiment(CONFIGS / "simple_adversary_groups_ppo.toml", [f"run.runs_dir='{tmp_path}'"])
    d = rundirs.make_run_dir(exp)
    (d / "result.json").write_text(json.dumps({"reason": "budget", "env_steps": 1000, "updates": 1,
                                               "mean_return": -5.0, "wall_s": 10.0}))
    evaluation.record(d, {"policy_version": 3, "env_steps": 900, "episodes": 30, "mean_return": -2.0, "std_return": 4.0,
                          "min_return": 0, "max_return": 0, "eval_s": 1, "wall_time": 0, "video": "",
                          "group_returns": {"adversaries": {"mean_return": -12.25, "episodes": 10},
                                            "good": {"mean_return": 3.125, "episodes": 20}}})
    cells = results.markdown(results.rows([d])).splitlines()[2].split(" | ")
    assert cells[5] == ("-2 ± 4 (30 episodes at 900 env steps; adversaries -12.25; good 3.125) (± over episodes)")


def test_results_of_a_two_player_game_show_each_opponents_win_rates_not_only_the_last_evaluation(tmp_path):
    """`rlpipe evaluate --opponent heuristic`, then `--opponent random`, then a plain evaluation:
    eval.json holds the last one alone, the row each opponent's latest games from eval.csv."""
    from shared.launch import api

    exp = api.experiment(CONFIGS / "cartpole_dqn.toml", [f"run.runs_dir='{tmp_path}'"])
    d = rundirs.make_run_dir(exp)
    (d / "result.json").write_text(json.dumps({"reason": "budget", "env_steps": 4000, "updates": 1,
                                               "mean_return": 0.0, "wall_s": 10.0}))
    base = {"policy_version": 3, "env_steps": 4000, "std_return": 1.0, "min_return": -1, "max_return": 1,
            "eval_s": 1, "wall_time": 0, "video": ""}
    for opponent, first, second in (("heuristic", 0.1, 0.2), ("heuristic", 0.395, 0.345), ("random", 0.89, 0.835)):
        evaluation.record(d, {**base, "episodes": 400, "mean_return": 0.5, "opponent": opponent,
                              "win_first": first, "draw_first": 0.0, "loss_first": 1 - first,
                              "win_second": second, "draw_second": 0.0, "loss_second": 1 - second})
    assert evaluation.latest(d)["opponent"] == "random"
    (row,) = results.rows([d])
    assert list(row["matches"][0]) == ["heuristic", "random"]
    assert row["matches"][0]["heuristic"]["win_first"] == 0.395 and row["matches"][0]["random"]["win_second"] == 0.835
    cells = results.markdown([row]).splitlines()[2].split(" | ")
    assert cells[5] == ("vs heuristic: wins 39.5 / 34.5% as first / second player (200 games a seat at 4,000 env "
                        "steps); vs random: wins 89.0 / 83.5% as first / second player (200 games a seat at 4,000 "
                        "env steps)")
    evaluation.record(d, {**base, "episodes": 10, "mean_return": 0.2})  # no opponent: not a match row
    assert list(results.rows([d])[0]["matches"][0]) == ["heuristic", "random"]


def test_runs_whose_configs_differ_by_a_field_one_of_them_lacks_are_two_groups():
    """A run made before a field existed has none in its config: a group of its own, labelled None."""
    from shared.launch.lab import plots

    old = {"run.name": "ppo", "algo.name": "ppo", "env.id": "CartPole-v1", "algo.lr": 1e-3}
    new = {**old, "agent.init_log_std": 0.0}
    assert plots.group_runs({Path("old"): old, Path("new"): new}) == {"init_log_std=None": [Path("old")],
                                                                      "init_log_std=0.0": [Path("new")]}


def test_a_shipped_config_a_grid_ran_in_another_checkout_reads_as_this_checkouts_path(tmp_path):
    """A grid records the absolute config path it ran: rows made from another clone's records
    name the shipped config as ``deploy/configs/...``, the same in every checkout."""
    elsewhere = Path("/some/other/clone/deploy/configs/cartpole_ppo.toml")
    assert results.shown_config(elsewhere) == "deploy/configs/cartpole_ppo.toml"
    assert results.shown_config(CONFIGS / "cartpole_ppo.toml") == "deploy/configs/cartpole_ppo.toml"
    own = tmp_path / "deploy" / "configs" / "mine.toml"  # not shipped: its own path is the only right one
    assert results.shown_config(own) == str(own)


def test_resume_of_a_directory_that_is_not_a_grid_is_one_clear_line(tmp_path):
    out = rlpipe_here("grid", "--resume", str(tmp_path))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"rlpipe: grid --resume: {tmp_path.resolve()}: not a grid directory (no grid.json; "
                          "`rlpipe grid CONFIG ...` makes one, and --resume takes its directory)\n")
    out = rlpipe_here("grid", str(CONFIGS / "cartpole_ppo.toml"), "--resume", str(tmp_path))
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and "no CONFIG" in out.stderr


def test_sigterm_to_a_grid_stops_its_live_run_with_a_checkpoint_for_resume(tmp_path):
    """A scheduler's time limit or a closed terminal (SIGTERM, SIGHUP) ends a grid as Ctrl-C does."""
    proc = subprocess.Popen(**rlpipe_command(
        "grid", str(CONFIGS / "cartpole_ppo.toml"), "--parallel", "1", "--set", f"run.runs_dir='{tmp_path}'",
        "--set", "run.log_interval_s=0.2", "--set", "run.target_return=1e9", "--set", "run.max_env_steps=100000000",
        "--set", "learner.checkpoint_interval_s=1", "--set", "network.metrics_port=0"),
        stdout=(tmp_path / "grid.out").open("w"), stderr=subprocess.STDOUT)

    def started():
        assert proc.poll() is None, (tmp_path / "grid.out").read_text()  # the grid ended before its run did
        return next((d for d in tmp_path.glob("grid_*/*seed_0_*") if rundirs.read_progress(d)), None)

    def logs():  # why a run that started wrote no row (it once did not within 300 s of a whole suite)
        return "\n".join(f"{f}:\n{f.read_text()[-1500:]}" for f in [tmp_path / "grid.out", *tmp_path.glob("grid_*/*/logs/*")])

    try:
        wait_for(started, 300, "the run's first progress row", logs)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
        for run_dir in tmp_path.glob("grid_*/*seed_0_*"):
            supervisor.clean(run_dir)
    out = (tmp_path / "grid.out").read_text()
    (run_dir,) = tmp_path.glob("grid_*/*seed_0_*")
    assert proc.returncode == 1 and "interrupted: stopping the live runs" in out, out
    assert rundirs.read_result(run_dir) is None and (run_dir / "checkpoints" / "latest.pt").exists()
    assert not supervisor.running(run_dir) and not list(Path("/dev/shm").glob(f"rlpipe-{run_dir.name}-*"))


def test_every_known_reference_is_quoted_as_docs_benchmarks_quotes_it():
    from shared.launch.lab import results

    published = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    assert [text for text in results.REFERENCES.values() if text not in published] == []
