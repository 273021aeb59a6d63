"""The DQN family through the real pipeline: learning, the rate limiter, scaling, replay restarts."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from shared.launch import supervisor as launch
from tests.pipeline import check_nstep, check_time_split, cpu_seconds, label_values, metric_value, rlpipe_here

pytestmark = pytest.mark.learning


def test_dqn_cartpole_reaches_475_within_its_300k_step_budget(runs):
    """Local inference: each sampler's epsilon schedule follows the env steps in the learner's segment.
    The shipped config spends env steps to save updates (seeds 0-9 reached 475 at 94k-179k)."""
    result = runs("cartpole_dqn.toml", "sampler.inference=local").wait_result(300)
    assert result["reason"] == "target" and result["mean_return"] >= 475 and result["env_steps"] <= 300_000, result


def test_rainbow_minus_noisy_cartpole_reaches_400_within_100k_steps_through_a_scale_up_and_a_replay_kill(runs):
    """Server inference: the action-server's per-env epsilons follow the published env steps.
    At 10k steps `rlpipe scale` adds a third sampler: the table's n-step returns, recomputed
    from the steps it stores, are right in every column. Then replay is killed by SIGKILL: the
    restarted one re-attaches its table in shared memory with every item, priority and
    rate-limiter count it had, and the run goes on to its target."""
    run = runs("cartpole_rainbow.toml", "sampler.inference=server", "sampler.max_count=3")
    run.wait_steps(10_000, timeout=120)
    assert run.scale(3) < 10
    run.wait_for(lambda: metric_value(run.metrics(), "rlpipe_sampler_segments_total", instance="2") > 50,
                 30, "sampler 2's segments")
    before = run.stop_replay_between_operations()
    exp = run.config()
    cols = check_nstep(run.replay_table(), exp.replay.transitions.gamma, exp.replay.transitions.n_step)
    assert set(cols // exp.sampler.envs) == {0, 1, 2}  # items of every sampler, the added one too
    os.kill(before["pid"], signal.SIGKILL)
    line = run.wait_for(lambda: re.search(r"re-attached after a restart: (\{.*\})", run.logs("replay")), 30,
                        "the restarted replay to re-attach its table")
    restored = json.loads(line.group(1))
    assert restored["op"] == "none" and restored["dropped"] == 0, restored
    assert [restored[k] for k in ("size", "inserts", "samples")] == [before[k] for k in ("size", "inserts", "samples")]
    assert before["size"] > 8_000
    assert restored["priority_alpha_mean"] == pytest.approx(before["priority_total"] / before["size"], rel=1e-9)
    result = run.wait_result(300)
    assert result["reason"] == "target" and result["mean_return"] >= 400 and result["env_steps"] <= 100_000, result
    page = run.metrics()
    assert metric_value(page, "rlpipe_replay_priority_updates_total") > 0
    assert metric_value(page, "rlpipe_replay_priority_max") > 0
    assert metric_value(page, "rlpipe_replay_table_restarts") == 2  # the test's view, then the restarted replay


def test_rate_limiter_holds_the_ratio_the_learner_waits_without_spinning_and_a_killed_replay_restarts(runs):
    """One run (3 samplers, 4 samples per insert) for the rate limiter, an idle learner, then a
    replay killed mid-run; 2 s timeouts: samplers and learner give up on the dead replay soon."""
    spi, items_per_insert, batch = 4.0, 16 * 8, 64
    run = runs("cartpole_dqn.toml", "sampler.count=3", "sampler.envs=8", "sampler.horizon=16",
               f"replay.samples_per_insert={spi}", "replay.min_size_to_sample=500", f"algo.batch_size={batch}",
               "run.target_return=1e9", "run.max_env_steps=100000000", "sampler.timeout_ms=2000",
               "learner.timeout_ms=2000")
    run.wait_steps(20_000, timeout=120)
    assert label_values(run.metrics(), "rlpipe_sampler_up") == {"0", "1", "2"}
    page = run.metrics()
    inserts = metric_value(page, "rlpipe_replay_insert_steps_total")
    samples = metric_value(page, "rlpipe_replay_samples_total")  # items
    # Reverb's invariant: |inserts * spi - samples| stays within the band (one insert + one sample
    # wide), counted in table items. From metrics: inserted env steps include each writer's
    # newest n_step steps whose n-step windows are not closed yet (not items yet), the first
    # min_size_to_sample items are free, and a scrape may fall between a sample and its count.
    band = items_per_insert * spi + batch
    not_yet_items = 5 * 3 * 8 * spi  # n_step (config) x samplers x envs
    assert abs(inserts * spi - samples) <= band + 500 * spi + not_yet_items + batch, (inserts, samples)
    assert samples / inserts == pytest.approx(spi, rel=0.1)
    # The table's size reaches the learner with each batch (progress.csv, TensorBoard): it
    # grows with the inserts, below capacity (100k) nothing leaves it.
    sizes = [int(r["replay_size"]) for r in run.progress() if int(r["updates"]) > 0]
    assert sizes == sorted(sizes) and 15_000 < sizes[-1] <= inserts, (sizes, inserts)
    # Where the time goes: each process's phases add up to its wall time; the learner is the
    # bottleneck (one update per 16 env steps here), its samplers wait on the rate limiter.
    status = check_time_split(run)
    assert re.search(r"bottleneck: learner \(update \d+%\)", status), status
    assert re.search(r"sampler +x3 .*waiting: .*ring \d+%", status), status
    top = rlpipe_here("top", str(run.dir), "--interval", "1", "--count", "1")
    assert top.returncode == 0 and "where the time goes (over the last 1 s): bottleneck: " in top.stdout, top

    # No sampler alive: the learner blocks on its poll timeout instead of spinning.
    launch.supervisorctl(run.dir, "stop", "sampler0", "sampler1", "sampler2", capture=True)
    time.sleep(2.0)
    learner = run.pid("learner0")
    updates0, cpu0 = metric_value(run.metrics(), "rlpipe_learner_updates_total"), cpu_seconds(learner)
    time.sleep(4.0)
    assert metric_value(run.metrics(), "rlpipe_learner_updates_total") == updates0
    assert cpu_seconds(learner) - cpu0 < 0.4, "the learner spins while it waits for data"

    launch.supervisorctl(run.dir, "start", "sampler0", "sampler1", "sampler2", capture=True)
    run.wait_for(lambda: metric_value(run.metrics(), "rlpipe_learner_updates_total") > updates0 + 100, 60,
                 "the learner to resume when data arrives")

    # Replay killed mid-run: supervisord restarts it, samplers and learner reconnect and go on.
    replay = run.pid("replay0")
    os.kill(replay, signal.SIGKILL)
    run.wait_for(lambda: run.status().get("replay0", ("", None))[1] not in (None, replay), 30,
                 "supervisord to restart replay")
    steps = int(run.progress()[-1]["env_steps"])
    updates = int(run.progress()[-1]["updates"])
    run.wait_for(lambda: int(run.progress()[-1]["env_steps"]) > steps + 5_000 and
                 int(run.progress()[-1]["updates"]) > updates + 500, 90,
                 "samplers and learner to reconnect to the new replay and go on")
