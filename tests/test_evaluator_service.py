"""Greedy evaluation: the evaluator service in a real run, `rlpipe evaluate` (and its video), `[eval]` config.

The live test runs the default PPO CartPole experiment with the evaluator on: its returns
rise to what the trained policy plays, and reach eval.csv, eval.json, the learner's
progress rows, TensorBoard and the metrics endpoint; a `kill -9` of the evaluator is
restarted by supervisord and reports again; between evaluations it sleeps.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from services.evaluator.episodes import play
from shared.config import loading, schema
from shared.runtime import evaluation
from shared.launch import supervisor as launch
from services.build import env_probe, make_agent
from shared.runtime.runfiles import RUN_CONFIG, TB_DIR
from tests.pipeline import cpu_seconds, metric_value, rlpipe, rlpipe_here


@pytest.mark.parametrize("key, value, message", [
    ("every_s", -1.0, "eval.every_s = -1.0: must be a finite number of seconds >= 0"),
    ("every_s", 0.2, "eval.every_s = 0.2: at least 1 s between evaluations"),
    ("every_s", "often", "eval.every_s = 'often': expected float"),
    ("episodes", 0, "eval.episodes = 0: must be >= 1"),
    ("envs", 0, "eval.envs = 0: must be >= 1"),
    ("seed_offset", 10, "eval.seed_offset = 10: must be >= 20014"),
    ("opponents", ["random", "champion"], "eval.opponents: 'champion' is unknown; give some of random, heuristic, latest"),
    ("every", 5.0, "unknown key eval.every (did you mean 'every_s'?)"),
])
def test_bad_eval_values_are_one_line_config_errors(key, value, message):
    with pytest.raises(schema.ConfigError) as e:
        loading.from_dict({"eval": {key: value}})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_rlpipe_launch_rejects_a_bad_eval_value_before_starting_anything(tmp_path):
    out = rlpipe("launch", "--set", f"run.runs_dir='{tmp_path}'", "--set", "eval.episodes=-3")
    assert out.returncode == 2
    assert out.stderr.strip() == "rlpipe: config error: eval.episodes = -3: must be >= 1"
    assert not any(tmp_path.iterdir())


def test_the_evaluator_runs_under_supervisord_only_when_on(tmp_path):
    off = loading.from_dict({})
    on = loading.from_dict({"eval": {"every_s": 5}})
    assert off.eval.every_s == 0 and "[program:evaluator]" not in launch.supervisord_conf(off, tmp_path)
    conf = launch.supervisord_conf(on, tmp_path)
    assert "[program:evaluator]" in conf and "-m services.evaluator --run-dir" in conf


def untrained_agent(exp):
    probe = env_probe(exp)
    agent = make_agent(exp, probe).eval()
    probe.close()
    return agent


def checkpointed_run(tmp_path: Path, env_id: str) -> Path:
    """A run directory holding only a config and an (untrained) checkpoint of version 3."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    exp = loading.from_dict({"env": {"id": env_id}})
    (run_dir / RUN_CONFIG).write_text(loading.dumps(exp))
    torch.save({"agent": untrained_agent(exp).state_dict(), "version": 3, "env_steps": 1234},
               run_dir / "checkpoints" / "latest.pt")
    return run_dir


def test_rlpipe_evaluate_plays_the_checkpoint_and_records_a_video(tmp_path):
    run_dir = checkpointed_run(tmp_path, "CartPole-v1")
    out = rlpipe_here("evaluate", str(run_dir), "--episodes", "3")
    assert out.returncode == 0, out.stderr
    assert re.search(r"3 greedy episodes of policy version 3 \(1234 env steps\): return \S+ \+- ", out.stdout)
    recorded = evaluation.latest(run_dir)  # an ended run's evaluation is kept for `rlpipe results`
    assert (recorded["episodes"], recorded["policy_version"], recorded["env_steps"]) == (3, 3, 1234)
    assert f"return {recorded['mean_return']:.1f} +- {recorded['std_return']:.1f}" in out.stdout

    video = tmp_path / "video"
    out = rlpipe_here("evaluate", str(run_dir), "--episodes", "2", "--video", str(video))
    assert out.returncode == 0, out.stderr
    files = list(video.glob("*.mp4"))
    assert len(files) == 1 and files[0].stat().st_size > 1000, files
    assert str(files[0]) in out.stdout
    assert files[0].read_bytes()[4:8] == b"ftyp"  # an MP4 container


def test_video_of_an_env_that_cannot_render_is_a_one_line_error(tmp_path):
    run_dir = checkpointed_run(tmp_path, "tests.envs_for_tests:make_lives_env")
    out = rlpipe_here("evaluate", str(run_dir), "--episodes", "1", "--video", str(tmp_path / "video"))
    assert out.returncode == 1
    assert out.stderr.strip() == ("rlpipe: env tests.envs_for_tests:make_lives_env cannot render (its constructor "
                                  "takes no render_mode): no video can be recorded")
    assert not list((tmp_path / "video").glob("*.mp4"))


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / TB_DIR))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


@pytest.mark.learning
def test_evaluator_reports_rising_returns_and_survives_kill9(runs):
    run = runs("cartpole_ppo.toml", "eval.every_s=2.0", "eval.episodes=8")
    rows = run.wait_for(lambda: evaluation.read_rows(run.dir), 60, "a first evaluation")
    first = float(rows[0]["mean_return"])
    # The kill must not land inside a report (its rows are written, then TensorBoard flushed, then the
    # count taken: a niced evaluator on a loaded machine can sit there for a while), or the endpoint's
    # count is one short of the rows for good: kill once the reports so far are counted.
    run.wait_for(lambda: metric_value(run.metrics(), "rlpipe_evaluator_evaluations_total")
                 >= len(evaluation.read_rows(run.dir)), 30, "the first evaluations to be counted")

    pid = run.pid("evaluator0")
    os.kill(pid, signal.SIGKILL)
    evaluated = len(evaluation.read_rows(run.dir))
    run.wait_for(lambda: run.status().get("evaluator0", ("", None))[1] not in (None, pid), 30,
                 "supervisord to restart the evaluator")
    run.wait_for(lambda: len(evaluation.read_rows(run.dir)) > evaluated, 60, "the restarted evaluator to report")
    pid = run.pid("evaluator0")
    t_restart, cpu_restart = time.monotonic(), cpu_seconds(pid)

    result = run.wait_result(240)
    assert result["reason"] == "target", result
    # The learner's last version is evaluated too (the evaluator still holds its segment mapped).
    last = run.wait_for(lambda: [r for r in evaluation.read_rows(run.dir)
                                 if int(r["policy_version"]) == result["policy_version"]], 30,
                        "an evaluation of the final version")[0]
    final = float(last["mean_return"])
    # CartPole's returns stop at 500, and greedy play of an early version may reach it already:
    # the rise is measured against the untrained agent (version 0) on the same seeds, whose
    # greedy play lasts 10-120 steps depending on its initial weights.
    exp = loading.load(run.dir / RUN_CONFIG)
    untrained = play(exp, untrained_agent(exp), exp.eval.episodes, exp.eval.envs).returns.mean()
    assert final > 300 and final - untrained > 200 and final >= first, (untrained, first, final)
    assert int(last["env_steps"]) == result["env_steps"] and int(last["episodes"]) == 8
    cost = (cpu_seconds(pid) - cpu_restart) / (time.monotonic() - t_restart)

    # Every evaluation reached eval.json, TensorBoard and the endpoint; the learner's rows carry the latest.
    assert evaluation.latest(run.dir)["policy_version"] == result["policy_version"]
    def final_page():
        page = run.metrics()
        return page if metric_value(page, "rlpipe_evaluator_policy_version") == result["policy_version"] else None

    page = run.wait_for(final_page, 10, "the endpoint to show the final evaluation")
    assert metric_value(page, "rlpipe_evaluator_mean_return") == pytest.approx(final)
    assert metric_value(page, "rlpipe_evaluator_env_steps") == result["env_steps"]
    assert metric_value(page, "rlpipe_evaluator_evaluations_total") == len(evaluation.read_rows(run.dir))
    tb = dict(tensorboard_scalars(run.dir, "eval/mean_return"))
    assert tb[result["env_steps"]] == pytest.approx(final)
    by_version = {r["policy_version"]: r["mean_return"] for r in evaluation.read_rows(run.dir)}
    carried = [r for r in run.progress() if r["eval_return"]]
    assert carried, "no progress row carries an evaluation"
    for r in carried:
        assert float(by_version[r["eval_policy_version"]]) == pytest.approx(float(r["eval_return"]))

    # With nothing new to evaluate it sleeps.
    before, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(4.0)
    idle = (cpu_seconds(pid) - before) / (time.monotonic() - t0)
    print(f"\nevaluator: {len(by_version)} evaluations, CPU {cost:.0%} of a core while the run learned, "
          f"{idle:.1%} idle; returns: untrained {untrained:.1f}, first {first:.1f}, final {final:.1f}")
    assert idle < 0.05, f"the evaluator used {idle:.0%} of a core with nothing to evaluate"
