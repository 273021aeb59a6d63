"""The watchdog kills a service that is alive but hung (its heartbeat stale), and supervisord restarts it."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from shared.launch import backend, supervisor
from shared.launch.watchdog import HungService, Watchdog, overdue
from shared.runtime import heartbeat, metrics
from shared.config import schema
from tests.pipeline import metric_value, rlpipe_here

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
    pid, t, phase = heartbeat.read(path)
    assert pid == os.getpid() and math.isnan(t) and phase == "starting"
    heartbeat.phase("restoring the replay snapshot")
    pid, t, phase = heartbeat.read(path)
    assert pid == os.getpid() and 0 <= time.monotonic() - t < 1.0 and phase == "restoring the replay snapshot"
    assert heartbeat.read(tmp_path / "nobody") is None


BEATING = ("import sys, time; from shared.runtime import heartbeat; from pathlib import Path; "
           "heartbeat.start(Path(sys.argv[1]))\nwhile True: heartbeat.beat(); time.sleep(0.1)")


def test_a_heartbeat_folder_removed_under_a_service_is_made_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(heartbeat, "_map", None)  # this process publishes none after the test
    monkeypatch.setattr(heartbeat, "_lost", False)
    monkeypatch.setattr(heartbeat, "CHECK_S", 0.0)  # every beat looks
    sockets = tmp_path / "sockets"
    sockets.mkdir()
    path = sockets / heartbeat.DIR / "sampler0"
    heartbeat.start(path)
    heartbeat.phase("sampling")
    shutil.rmtree(path.parent)
    heartbeat.beat()
    again = heartbeat.read(path)
    assert again.pid == os.getpid() and again.phase == "sampling" and not math.isnan(again.time)
    heartbeat.beat()
    assert heartbeat.read(path).time >= again.time  # the beats go to the new file
    assert "was gone (its folder removed under the run?): published again" in caplog.text
    shutil.rmtree(sockets)  # its parent too: nothing to publish into; said once, and the beats go on
    for _ in range(3):
        heartbeat.beat()
    assert caplog.text.count("is gone and cannot be made again") == 1


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
        # Judged 1.2 s on (the clock is the check's argument), past the hung one's 1 s grace: the
        # beating one's beat is still well inside its 3 s deadline, as it would be after a sleep.
        killed = dog.check(processes, time.monotonic() + 1.2)
        assert [(name, pid) for name, pid, _ in killed] == [("hung0", hung.pid)]
        assert hung.wait(5) == -signal.SIGKILL and alive.poll() is None
    finally:
        for p in (hung, alive):
            p.kill()
            p.wait()


SPAWNING = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']); print(child.pid, flush=True); time.sleep(60)")


def _hung(tmp_path, name: str, beat_at: float | None = None) -> subprocess.Popen:
    """A process leading its own group (as supervisord starts a service) that never beats, or
    whose heartbeat file says it beat at ``beat_at`` (monotonic), while sampling."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    if beat_at is not None:
        (tmp_path / name).write_bytes(heartbeat._RECORD.pack(proc.pid, b"sampling", beat_at))
    return proc


def test_the_watchdog_kills_the_process_group_so_an_envs_simulator_is_not_orphaned(tmp_path):
    hung = subprocess.Popen([sys.executable, "-c", SPAWNING], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = int(hung.stdout.readline())
    try:
        dog = Watchdog(tmp_path, deadline_s=3.0, startup_s=1.0, kills=metrics.for_service("watchdog", 0).kills)
        processes = [{"name": "sampler0", "pid": hung.pid, "statename": "RUNNING"}]
        dog.check(processes, time.monotonic())
        assert [name for name, _, _ in dog.check(processes, time.monotonic() + 2.0)] == ["sampler0"]
        assert hung.wait(5) == -signal.SIGKILL
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/{child}") and "Z" not in open(f"/proc/{child}/stat").read().split()[2]:
            assert time.monotonic() < deadline, "the env's child process outlived its sampler"
            time.sleep(0.05)
    finally:
        hung.kill()
        hung.wait()
        hung.stdout.close()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_three_kills_in_a_row_are_a_hung_service_and_a_life_that_beat_for_a_deadline_resets_the_count(tmp_path):
    """Killed, killed, a life beating for a whole deadline, killed, killed: no verdict; a third
    kill in a row then names the service, its last phase and the deadline."""
    dog = Watchdog(tmp_path, deadline_s=3.0, startup_s=1.0, kills=metrics.for_service("watchdog", 0).kills)
    now = time.monotonic()

    def life(beat_at: float) -> list:
        """One incarnation of sampler0, checked once at ``now`` (first seen then)."""
        proc = _hung(tmp_path, "sampler0", beat_at)
        try:
            return dog.check([{"name": "sampler0", "pid": proc.pid, "statename": "RUNNING"}], now)
        finally:
            proc.kill()
            proc.wait()

    assert life(now - 10) and life(now - 10)
    assert not life(now + 3.5)  # first seen at now, beat 3.5 s later: it made progress for a whole deadline
    assert life(now - 10) and life(now - 10)
    proc = _hung(tmp_path, "sampler0", now - 10)
    try:
        with pytest.raises(HungService, match=r"^sampler0 hung 3 times in a row \(killed by the watchdog each time: no "
                           r"heartbeat for [\d.]+ s, limit 3 s, while sampling\); run stopped"):
            dog.check([{"name": "sampler0", "pid": proc.pid, "statename": "RUNNING"}], now)
    finally:
        proc.kill()
        proc.wait()


def test_the_watchdog_is_in_supervisord_conf_unless_off(tmp_path):
    on, off = schema.Experiment(), schema.Experiment(run=schema.RunConfig(watchdog_s=0))
    assert "[eventlistener:watchdog]" in supervisor.supervisord_conf(on, tmp_path)
    assert "shared.launch.watchdog" not in supervisor.supervisord_conf(off, tmp_path)


def test_a_slow_env_is_not_killed_a_stopped_sampler_is_and_a_module_that_prints_does_not_blind_the_watchdog(runs):
    """An env taking 40 ms a step, 2 envs, 96 steps a segment: 7.7 s a segment, past
    run.watchdog_s = 2 (the sampler beats every step, not every segment). One segment shows it:
    the sampler beats as it starts to sample (and at each segment's start), so a sampler that beat
    only per segment would be 7.7 s silent in its first, and a TICK_5 check (one every 5 s) falls
    in that silence past its 2 s deadline. Its module prints at import, in the watchdog too (which
    reads the run's config, and the module names the algorithm). Then sampler0 is SIGSTOPped: the
    watchdog kills it (its process group) and supervisord restarts it."""
    run = runs("cartpole_ppo.toml", "env.id='tests.noisy_envs_for_tests:make_slow_cartpole'", "sampler.envs=2",
               "algo.name='tests.noisy_envs_for_tests:PPO'",
               "sampler.horizon=96", "sampler.inference='local'", "run.watchdog_s=2", "run.target_return=1e9")
    pid = run.pid("sampler0")
    run.wait_steps(2 * 96, timeout=90)  # one segment: 7.7 s of a sampler busy in its env
    assert run.status()["sampler0"] == ("RUNNING", pid), run.logs("watchdog")
    assert "killed (SIGKILL" not in run.logs("watchdog")
    os.kill(pid, signal.SIGSTOP)
    try:
        run.wait_for(lambda: run.status().get("sampler0", ("", None))[1] not in (None, pid), 30,
                     "the watchdog to kill sampler0 and supervisord to restart it")
    finally:
        try:  # whatever happened, the stopped process does not outlive the test
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    steps = max(int(r["env_steps"]) for r in run.progress())
    run.wait_steps(steps + 2 * 96, timeout=60)  # only the restarted sampler samples
    log = run.logs("watchdog")
    assert "noisy_envs_for_tests: imported" in log, log  # its print went to the log, not the protocol
    assert f"sampler0 (pid {pid}): no heartbeat for" in log and "while sampling: killed (SIGKILL" in log, log
    assert log.count("killed (SIGKILL") == 1, log  # nothing else was taken for hung
    assert "exited: sampler0 (terminated by SIGKILL" in (run.dir / "logs" / "supervisord.log").read_text()
    assert metric_value(run.metrics(), "rlpipe_watchdog_kills_total", process="sampler0") == 1


def test_a_service_the_watchdog_kills_three_times_in_a_row_stops_the_run_with_one_line(runs):
    """Each sampler0 hangs at its 50th env step (a 60 s sleep, no env.step_timeout_s): killed,
    restarted, hung again. At the third kill the run stops, result.json and `rlpipe status` say why.

    A 2 s deadline: the watchdog checks at supervisord's TICK_5 (every 5 s), and a sampler
    restarted at one tick hangs 1-2 s later, so with 4 s each hang was killed only at the second
    tick after it (10 s a life, 30 s a test); within 2 s it is killed at the first."""
    run = runs("cartpole_ppo.toml", "env.id='tests.envs_for_tests:make_cartpole_failing_once'",
               "env.kwargs='{\"mode\": \"sleep\", \"at\": 50}'", "sampler.inference='local'", "run.watchdog_s=2",
               "run.target_return=1e9")
    result = run.wait_result(120)
    assert result["reason"] == "watchdog", result
    line = result["error"]
    assert line.startswith("sampler0 hung 3 times in a row") and "limit 2 s, while sampling" in line, line
    assert run.logs("watchdog").count("killed (SIGKILL") == 3
    run.wait_for(lambda: not backend.for_run(run.dir).running(run.dir), 30, "the run's processes to end")
    assert run.segments() == []  # the hung sampler's too, though it was killed
    status = rlpipe_here("status", str(run.dir))
    assert f"not running; ended (watchdog): {line}" in status.stdout, status.stdout


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


def test_a_rank_waiting_on_rank_0_beats_as_long_as_rank_0_does(tmp_path, monkeypatch):
    """A data-parallel rank > 0 blocked in a collective while rank 0 writes a checkpoint: its
    heartbeat follows rank 0's (``heartbeat.following``), so neither is taken for hung."""
    monkeypatch.setattr(heartbeat, "_map", None)  # this process publishes none after the test
    heartbeat.start(tmp_path / "learner1")
    leader = tmp_path / "learner0"
    with heartbeat.following(leader, every_s=0.02):
        assert math.isnan(heartbeat.read(tmp_path / "learner1").time)  # rank 0 has not beaten: nothing to follow
        beat_at = time.monotonic()
        leader.write_bytes(heartbeat._RECORD.pack(PID, b"writing a checkpoint", beat_at))
        deadline = time.monotonic() + 10
        while heartbeat.read(tmp_path / "learner1").time != beat_at:
            assert time.monotonic() < deadline, "rank 1's heartbeat did not follow rank 0's"
            time.sleep(0.02)


def test_a_samplers_wait_for_the_learners_agent_is_bounded_and_says_what_it_waited_for(tmp_path, monkeypatch):
    from services.sampler.__main__ import wait_for

    monkeypatch.setattr(heartbeat, "_map", None)
    heartbeat.start(tmp_path / "sampler0")
    with pytest.raises(RuntimeError, match=r"^waited 0.2 s \(run.watchdog_startup_s\) for the learner's acting.json"):
        wait_for("the learner's acting.json", lambda: None, 0.2)
    beat = heartbeat.read(tmp_path / "sampler0")
    assert beat.phase == "waiting for the learner's acting.json" and time.monotonic() - beat.time < 1.0
    assert wait_for("a value", lambda: 7, 0.2) == 7
