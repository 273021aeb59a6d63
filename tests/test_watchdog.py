"""The watchdog kills a service that is alive but hung (its heartbeat stale), and supervisord restarts it."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest

from shared.launch import supervisor
from shared.launch.watchdog import Watchdog, overdue
from shared.runtime import heartbeat, metrics
from shared.config import schema
from tests.pipeline import metric_value

PID = 4242


@pytest.mark.parametrize("beat, seen_at, now, expected", [
    ((PID, 100.0), 0.0, 102.9, None),            # beat 2.9 s ago, deadline 3 s
    ((PID, 100.0), 0.0, 103.5, (3.5, 3.0)),      # beat 3.5 s ago: overdue by its deadline
    (None, 100.0, 103.5, None),                  # no heartbeat yet: start-up grace (10 s)
    (None, 100.0, 111.0, (11.0, 10.0)),          # ... which runs out
    ((PID, math.nan), 100.0, 105.0, None),       # its file, no beat yet: still starting
    ((PID + 1, 50.0), 100.0, 105.0, None),       # a previous incarnation's beat is not this process's
    ((PID + 1, 50.0), 100.0, 110.5, (10.5, 10.0)),
])
def test_staleness_is_judged_by_its_own_latest_beat_or_by_the_start_up_grace(beat, seen_at, now, expected):
    late = overdue(now, PID, beat, seen_at, deadline_s=3.0, startup_s=10.0)
    assert late == (None if expected is None else pytest.approx(expected))


def test_beats_round_trip_through_the_heartbeat_file(tmp_path, monkeypatch):
    monkeypatch.setattr(heartbeat, "_map", None)  # this process publishes none after the test
    path = tmp_path / heartbeat.DIR / "sampler0"
    heartbeat.start(path)
    pid, t = heartbeat.read(path)
    assert pid == os.getpid() and math.isnan(t)
    heartbeat.beat()
    pid, t = heartbeat.read(path)
    assert pid == os.getpid() and 0 <= time.monotonic() - t < 1.0
    assert heartbeat.read(tmp_path / "nobody") is None


BEATING = ("import sys, time; from shared.runtime import heartbeat; from pathlib import Path; "
           "heartbeat.start(Path(sys.argv[1]))\nwhile True: heartbeat.beat(); time.sleep(0.1)")


def test_the_watchdog_kills_the_silent_process_only(tmp_path):
    """Two real processes: one beats, one never did and is past the start-up grace."""
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    alive = subprocess.Popen([sys.executable, "-c", BEATING, str(tmp_path / "alive0")])
    try:
        dog = Watchdog(tmp_path, deadline_s=3.0, startup_s=1.0, kills=metrics.for_service("watchdog", 0).kills)
        processes = [{"name": "hung0", "pid": hung.pid, "statename": "RUNNING"},
                     {"name": "alive0", "pid": alive.pid, "statename": "RUNNING"},
                     {"name": "watchdog", "pid": os.getpid(), "statename": "RUNNING"},
                     {"name": "gone0", "pid": 0, "statename": "BACKOFF"}]
        assert dog.check(processes, time.monotonic()) == []  # first sight: the grace starts now
        deadline = time.monotonic() + 20
        while not (beat := heartbeat.read(tmp_path / "alive0")) or math.isnan(beat[1]):
            assert time.monotonic() < deadline, "the beating process published no beat"
            time.sleep(0.1)
        time.sleep(1.5)  # past the hung one's grace
        killed = dog.check(processes, time.monotonic())
        assert [(name, pid) for name, pid, _ in killed] == [("hung0", hung.pid)]
        assert hung.wait(5) == -signal.SIGKILL and alive.poll() is None
    finally:
        for p in (hung, alive):
            p.kill()
            p.wait()


def test_the_watchdog_is_in_supervisord_conf_unless_off(tmp_path):
    on, off = schema.Experiment(), schema.Experiment(run=schema.RunConfig(watchdog_s=0))
    assert "[eventlistener:watchdog]" in supervisor.supervisord_conf(on, tmp_path)
    assert "shared.launch.watchdog" not in supervisor.supervisord_conf(off, tmp_path)


@pytest.mark.learning
def test_a_stopped_sampler_is_killed_by_the_watchdog_restarted_and_ships_segments_again(runs):
    run = runs("cartpole_ppo.toml", "run.watchdog_s=5", "run.target_return=1000.0")
    run.wait_steps(1_000)
    pid = run.pid("sampler0")
    os.kill(pid, signal.SIGSTOP)
    try:
        run.wait_for(lambda: run.status().get("sampler0", ("", None))[1] not in (None, pid), 25,
                     "the watchdog to kill sampler0 and supervisord to restart it")
    finally:
        try:  # whatever happened, the stopped process does not outlive the test
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    steps = max(int(r["env_steps"]) for r in run.progress())
    run.wait_steps(steps + 1_000, timeout=30)  # only the restarted sampler samples
    log = run.logs("watchdog")
    assert f"sampler0 (pid {pid}): no heartbeat for" in log, log
    assert log.count("killed (SIGKILL)") == 1, log  # nothing else was taken for hung
    assert "exited: sampler0 (terminated by SIGKILL" in (run.dir / "logs" / "supervisord.log").read_text()
    assert metric_value(run.metrics(), "rlpipe_watchdog_kills_total", process="sampler0") == 1


def test_an_env_that_hangs_in_step_is_interrupted_and_its_sampler_ships_on(runs):
    """``env.step_timeout_s``: the sampler's env sleeps 60 s in one step; the step is cut at 1 s,
    counted as an env failure, the env recreated, and the same sampler process goes on."""
    run = runs("cartpole_ppo.toml", "env.id='tests.envs_for_tests:make_cartpole_failing_once'",
               "env.kwargs='{\"mode\": \"sleep\", \"at\": 300}'", "env.step_timeout_s=1.0", "run.target_return=1e9")
    pid = run.pid("sampler0")
    run.wait_steps(2_000, timeout=60)
    assert metric_value(run.metrics(), "rlpipe_sampler_env_errors_total") == 1
    assert "step took longer than env.step_timeout_s = 1 s: interrupted" in run.logs("sampler0")
    assert run.status()["sampler0"] == ("RUNNING", pid)  # not restarted: neither a crash nor the watchdog
