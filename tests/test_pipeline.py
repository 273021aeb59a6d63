"""The whole pipeline, real processes under supervisord: learning, restarts, cleanup, metrics."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from shared import launch
from tests.pipeline import CONFIGS, instances, metric_value, rlpipe

pytestmark = pytest.mark.learning


def test_ppo_cartpole_learns_through_kills_of_sampler_and_learner(runs):
    """The default experiment reaches 475 within 200k steps although a sampler and the
    learner are killed with SIGKILL mid-run; supervisord restarts both, the learner resumes
    from its checkpoint with increasing policy versions; `rlpipe stop` leaves nothing."""
    run = runs("cartpole_ppo.toml", "learner.checkpoint_interval_s=2.0")
    run.wait_steps(25_000)
    sampler_pid = run.pid("sampler0")
    os.kill(sampler_pid, signal.SIGKILL)
    run.wait_for(lambda: run.status().get("sampler0", ("", None))[1] not in (None, sampler_pid), 30,
                 "supervisord to restart sampler0")

    run.wait_for(lambda: (run.dir / "checkpoints" / "latest.pt").exists(), 30, "a checkpoint")
    version_before = max(int(r["policy_version"]) for r in run.progress())
    learner_pid = run.pid("learner0")
    os.kill(learner_pid, signal.SIGKILL)
    run.wait_for(lambda: run.status().get("learner0", ("", None))[1] not in (None, learner_pid), 30,
                 "supervisord to restart the learner")

    result = run.wait_result(240)
    assert result["reason"] == "target", result
    assert result["mean_return"] >= 475 and result["env_steps"] <= 200_000
    assert result["policy_version"] > version_before
    learner_log = run.logs("learner")
    assert "resumed from" in learner_log
    versions = [int(r["policy_version"]) for r in run.progress()]
    assert versions == sorted(versions), f"policy version went backwards after the restart: {versions}"

    out = rlpipe("stop", str(run.dir))
    assert out.returncode == 0, out.stdout + out.stderr
    assert launch.service_pids(run.dir) == []
    assert run.segments() == []

    # The final checkpoint plays greedily on held-out seeds at least as well as it trained.
    out = rlpipe("evaluate", str(run.dir), "--episodes", "5")
    assert out.returncode == 0, out.stderr
    assert float(re.search(r"return (\S+) \+-", out.stdout).group(1)) >= 475


def test_kill9_learner_then_clean_leaves_nothing_and_lost_samplers_are_noticed(runs):
    run = runs("cartpole_ppo.toml", "action_server.peer_timeout_s=2.0", "replay.peer_timeout_s=2.0",
               "run.target_return=1000.0")
    run.wait_steps(5_000)
    # A sampler that goes away is reported by the action-server and replay, which keep serving.
    launch.supervisorctl(run.dir, "stop", "sampler:sampler1", capture=True)
    run.wait_for(lambda: "peers_lost_total" in run.metrics() and
                 metric_value(run.metrics(), "rlpipe_action_server_peers_lost_total") >= 1 and
                 metric_value(run.metrics(), "rlpipe_replay_peers_lost_total") >= 1, 30, "the lost sampler to be reported")
    steps = int(run.progress()[-1]["env_steps"])
    run.wait_steps(steps + 2_000, timeout=60)  # sampler0 alone keeps the run going

    os.kill(run.pid("learner0"), signal.SIGKILL)
    out = rlpipe("clean", str(run.dir))
    assert out.returncode == 0, out.stdout + out.stderr
    assert launch.service_pids(run.dir) == []
    assert run.segments() == []


def test_sampler_count_follows_config_and_metrics_show_instances(runs):
    """A2C with 3 samplers reaches 200; the endpoint shows 3 sampler instances."""
    run = runs("cartpole_a2c.toml", "sampler.count=3")
    run.wait_steps(5_000)
    page = run.metrics()
    assert instances(page, "rlpipe_sampler_up") == {"0", "1", "2"}
    for name in ("rlpipe_sampler_env_steps_total", "rlpipe_action_server_batch_size_requests_count",
                 "rlpipe_action_server_latency_seconds_count", "rlpipe_replay_inserts_total",
                 "rlpipe_learner_updates_total"):
        assert metric_value(page, name) > 0, name
    for name in ("rlpipe_learner_policy_lag_versions", "rlpipe_replay_size_items", "rlpipe_learner_mean_return"):
        assert f"\n{name}{{" in page, name
    result = run.wait_result(240)
    assert result["reason"] == "target" and result["mean_return"] >= 200 and result["env_steps"] <= 200_000, result


def test_pendulum_ppo_gaussian_one_sampler(runs):
    run = runs("pendulum_ppo.toml", "sampler.count=1", "sampler.envs=32", "learner.batch_segments=1",
               "replay.capacity=1")
    run.wait_steps(2_000)
    assert instances(run.metrics(), "rlpipe_sampler_up") == {"0"}
    result = run.wait_result(300)
    assert result["reason"] == "target" and result["mean_return"] > -500 and result["env_steps"] <= 200_000, result
    first = [float(r["mean_return"]) for r in run.progress() if r["mean_return"] != "nan"][0]
    assert first < -900, f"Pendulum should start near -1200, started at {first}"


def test_serial_mode_learns_the_same_config():
    from services.serial import train_serial
    from shared import config

    t0 = time.monotonic()
    result = train_serial(config.load(CONFIGS / "cartpole_ppo.toml"))
    assert result["reason"] == "target" and result["env_steps"] <= 200_000, result
    assert time.monotonic() - t0 < 180
