"""The whole pipeline, real processes under supervisord: learning, restarts, cleanup, metrics."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from shared.launch import supervisor as launch
from tests.pipeline import cpu_seconds, label_values, maps_library, metric_value, rlpipe, rlpipe_here

pytestmark = pytest.mark.learning


@pytest.mark.parametrize("inference", ["local", "server"])
def test_ppo_cartpole_learns_through_kills_of_sampler_and_learner(runs, inference):
    """The default experiment reaches 475 within 200k steps although a sampler and the
    learner are killed with SIGKILL mid-run; supervisord restarts both, the learner resumes
    from its checkpoint with increasing policy versions; `rlpipe stop` leaves nothing. No
    sampler loads torch, a restarted one neither.
    In server mode the action-server notices the killed sampler through its doorbell at
    once, long before its peer timeout."""
    run = runs("cartpole_ppo.toml", "learner.checkpoint_interval_s=2.0", f"sampler.inference={inference}",
               "action_server.peer_timeout_s=60")
    run.wait_steps(25_000)
    sampler_pid = run.pid("sampler0")
    assert not maps_library(sampler_pid)  # local inference acts in numpy from the learner's acting.json
    os.kill(sampler_pid, signal.SIGKILL)
    t_kill = time.monotonic()
    if inference == "server":
        run.wait_for(lambda: metric_value(run.metrics(), "rlpipe_action_server_peers_lost_total") >= 1, 10,
                     "the action-server to notice the killed sampler")
        assert time.monotonic() - t_kill < 10  # well within peer_timeout_s = 60: the doorbell closed
    run.wait_for(lambda: run.status().get("sampler0", ("", None))[1] not in (None, sampler_pid), 30,
                 "supervisord to restart sampler0")
    run.wait_for(lambda: run.logs("sampler0").count("services.sampler: sampler 0:") >= 2, 30,
                 "the restarted sampler0 to step its envs")
    assert not maps_library(run.pid("sampler0"))

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
    out = rlpipe_here("evaluate", str(run.dir), "--episodes", "5")
    assert out.returncode == 0, out.stderr
    assert float(re.search(r"return (\S+) \+-", out.stdout).group(1)) >= 475


def test_kill9_learner_then_clean_leaves_nothing_and_lost_samplers_are_noticed(runs):
    # Two samplers, each segment a batch: sampler0 alone keeps the learner going.
    run = runs("cartpole_ppo.toml", "action_server.peer_timeout_s=2.0", "replay.peer_timeout_s=2.0",
               "run.target_return=1000.0", "sampler.inference=server", "sampler.count=2")
    run.wait_steps(5_000)
    # A sampler that goes away is reported by the action-server and replay, which keep serving.
    server, replay = run.pid("action_server0"), run.pid("replay0")
    launch.supervisorctl(run.dir, "stop", "sampler1", capture=True)
    run.wait_for(lambda: "peers_lost_total" in run.metrics() and
                 metric_value(run.metrics(), "rlpipe_action_server_peers_lost_total") >= 1 and
                 metric_value(run.metrics(), "rlpipe_replay_peers_lost_total") >= 1, 30, "the lost sampler to be reported")
    steps = int(run.progress()[-1]["env_steps"])
    run.wait_steps(steps + 2_000, timeout=60)  # sampler0 alone keeps the run going
    assert (run.pid("action_server0"), run.pid("replay0")) == (server, replay), "a service crashed on the loss"

    os.kill(run.pid("learner0"), signal.SIGKILL)
    out = rlpipe("clean", str(run.dir))
    assert out.returncode == 0, out.stdout + out.stderr
    assert launch.service_pids(run.dir) == []
    assert run.segments() == []


def test_an_idle_pipeline_waits_without_spinning_and_only_networks_load_torch(runs):
    """With the learner stopped nothing can move: every process must sleep in its bounded
    waits (< 5% of a core each), not spin. Replay, metrics and server-mode samplers never
    load torch (it costs seconds of start-up), nor does the watchdog; the action-server does."""
    run = runs("cartpole_ppo.toml", "sampler.inference=server", "sampler.count=2", "run.target_return=1000.0")
    run.wait_steps(3_000)
    pids = {name: pid for name, (state, pid) in run.status().items() if state == "RUNNING"}
    assert {name for name in pids if not maps_library(pids[name])} == {"replay0", "metrics0", "sampler0", "sampler1",
                                                                     "watchdog"}
    launch.supervisorctl(run.dir, "stop", "learner:learner0", capture=True)
    time.sleep(2.0)
    del pids["learner0"]
    before, t0 = {name: cpu_seconds(pid) for name, pid in pids.items()}, time.monotonic()
    time.sleep(6.0)
    for name, pid in pids.items():
        share = (cpu_seconds(pid) - before[name]) / (time.monotonic() - t0)
        assert share < 0.05, f"{name} used {share:.0%} of a core while the pipeline was idle"


def test_sampler_count_follows_config_metrics_show_instances_and_action_servers_scale(runs):
    """A2C with 3 samplers and an action-server reaches 200; the endpoint shows 3 sampler
    instances. `rlpipe scale RUN action_server=2` adds a second action-server: sampler 1 (1 mod 2)
    is restarted onto it, samplers 0 and 2 stay where they are, untouched. The run has no
    target, so that it outlasts the scaling (A2C can reach 200 in 5 s); the return is read from
    its progress rows."""
    run = runs("cartpole_a2c.toml", "sampler.count=3", "sampler.inference=server", "action_server.max_count=2",
               "run.target_return=1e9")
    run.wait_steps(5_000)
    page = run.metrics()
    assert label_values(page, "rlpipe_sampler_up") == {"0", "1", "2"}
    kept = run.pid("sampler0"), run.pid("sampler2")
    out = rlpipe_here("scale", str(run.dir), "action_server=2")
    assert out.returncode == 0 and "restarted sampler1" in out.stdout, out
    run.wait_for(lambda: metric_value(run.metrics(), "rlpipe_action_server_requests_total", instance="1") > 100, 20,
                 "action-server 1 to serve sampler 1")
    assert (run.pid("sampler0"), run.pid("sampler2")) == kept
    page = run.metrics()
    for name in ("rlpipe_sampler_env_steps_total", "rlpipe_action_server_batch_size_requests_count",
                 "rlpipe_action_server_latency_seconds_count", "rlpipe_replay_inserts_total",
                 "rlpipe_learner_updates_total"):
        assert metric_value(page, name) > 0, name
    for name in ("rlpipe_learner_policy_lag_versions", "rlpipe_replay_size_items", "rlpipe_learner_mean_return"):
        assert f"\n{name}{{" in page, name
    run.wait_for(lambda: any(float(r["mean_return"]) >= 200 for r in run.progress() if int(r["env_steps"]) <= 200_000),
                 240, "a mean return of 200 within 200k env steps")


def test_pendulum_ppo_gaussian_one_sampler(runs):
    run = runs("pendulum_ppo.toml", "sampler.count=1", "sampler.envs=32", "learner.batch_segments=1",
               "replay.capacity=1")
    run.wait_steps(2_000)
    assert label_values(run.metrics(), "rlpipe_sampler_up") == {"0"}
    result = run.wait_result(300)
    assert result["reason"] == "target" and result["mean_return"] > -500 and result["env_steps"] <= 200_000, result
    first = [float(r["mean_return"]) for r in run.progress() if r["mean_return"] != "nan"][0]
    assert first < -900, f"Pendulum should start near -1200, started at {first}"
