"""The control plane when supervisord itself fails: stopped (SIGSTOP) or hung, `rlpipe stop`,
`clean` and `status` still return and leave nothing running; killed under a foreground
`rlpipe launch` or a detached run, its services do not run on as orphans, and `launch --resume`
starts exactly one set of them. One process a service instance: a second replay, action-server or sampler of
a run exits on the run's lock before it touches anything."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.launch import backend, rundirs, supervisor
from tests.pipeline import CONFIGS, REPO, Run, free_port, rlpipe, rlpipe_command, rlpipe_here, stop_process


def services_running(run_dir: Path) -> collections.Counter:
    """(service, instance) -> how many processes of it run for ``run_dir`` (supervisord left out)."""
    found = collections.Counter()
    for pid in supervisor.service_pids(run_dir):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if "-m" in argv and argv[argv.index("-m") + 1].startswith("services."):
                found[(argv[argv.index("-m") + 1], argv[argv.index("--instance") + 1])] += 1
    return found


@contextlib.contextmanager
def released(pid: int):
    """Whatever the test does to supervisord ``pid``, it does not outlive the test stopped."""
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too


@pytest.mark.parametrize("command", ["stop", "clean"])
def test_a_stopped_supervisord_does_not_hang_status_stop_or_clean(runs, command):
    run = runs("cartpole_ppo.toml", "run.target_return=1e9")
    pid = supervisor.supervisord_pid(run.dir)
    assert services_running(run.dir)
    with released(pid):
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        status = rlpipe("status", str(run.dir), timeout=60)
        stopped = "does not answer: it is stopped (SIGSTOP)"  # told from its process state, not by a timeout
        assert status.returncode == 1 and stopped in status.stdout, status.stdout + status.stderr
        t1 = time.monotonic()
        out = rlpipe(command, str(run.dir), timeout=60)
        took = time.monotonic() - t1
        assert out.returncode == 0, out.stdout + out.stderr
        assert took < 20, f"rlpipe {command} took {took:.1f} s"
        assert "does not answer (it is stopped (SIGSTOP))" in out.stderr  # says why it killed supervisord
        assert supervisor.supervisord_pid(run.dir) is None and supervisor.service_pids(run.dir) == []
        assert not run.segments()  # the services stopped cleanly: nothing left in /dev/shm
    print(f"status {t1 - t0:.1f} s, {command} {took:.1f} s")


def test_a_hung_supervisord_is_told_by_the_rpc_timeout_and_stop_kills_it(tmp_path, monkeypatch, capsys):
    """A supervisord that runs but never answers (its socket accepts, nothing replies): status
    says so after RPC_TIMEOUT_S, stop kills it. Stand-in: a process holding the run's socket,
    named by the run's supervisord.conf as supervisord is."""
    run_dir = tmp_path / "run_hung"
    run_dir.mkdir()
    sock = supervisor.endpoints.socket_dir(run_dir) / "supervisor.sock"
    sock.parent.mkdir(parents=True, exist_ok=True)
    code = ("import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(8); "
            "print('up', flush=True); time.sleep(120)")
    hung = subprocess.Popen([sys.executable, "-c", code, str(sock), "-c", str(run_dir / "supervisord.conf")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert hung.stdout.readline() == "up\n"
        (run_dir / "supervisord.pid").write_text(f"{hung.pid}\n")
        assert supervisor.supervisord_pid(run_dir) == hung.pid and not supervisor.is_stopped(hung.pid)
        monkeypatch.setattr(supervisor, "RPC_TIMEOUT_S", 0.5)
        t0 = time.monotonic()
        assert supervisor.status(run_dir) == 1
        assert 0.5 <= time.monotonic() - t0 < 10
        assert "does not answer: not within 0.5 s (hung, or stopped)" in capsys.readouterr().out
        assert supervisor.stop(run_dir, timeout_s=10)
        assert hung.wait(timeout=10) == -signal.SIGKILL
    finally:
        hung.kill()
        hung.wait()
        sock.unlink(missing_ok=True)


def test_a_killed_supervisord_leaves_no_orphans_and_resume_starts_one_set(tmp_path):
    args = ["launch", str(CONFIGS / "cartpole_ppo.toml")]
    for s in (f"run.runs_dir='{tmp_path / 'runs'}'", f"network.metrics_port={free_port()}", "run.log_interval_s=0.5",
              "run.target_return=1e9"):
        args += ["--set", s]
    launcher = subprocess.Popen(**rlpipe_command(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = None
    try:
        for line in launcher.stdout:
            found = re.match(r"run directory: (\S+)", line)
            if found:
                run = Run(Path(found.group(1)))
                break
        assert run is not None, "the launcher printed no run directory"
        run.wait_for(run.progress, 60, "a progress row")
        expected = services_running(run.dir)
        assert expected and set(expected.values()) == {1}, expected
        os.kill(supervisor.supervisord_pid(run.dir), signal.SIGKILL)
        rest = launcher.communicate(timeout=30)[0]
        # The services see supervisord die and exit by themselves; the launcher stops whatever is left.
        assert launcher.returncode == 1 and re.search("supervisor is gone|saw their supervisor die", rest), rest
        assert supervisor.service_pids(run.dir) == [], "services run on without their supervisord"
        assert not run.segments()
        steps = int(run.progress()[-1]["env_steps"])
        out = rlpipe_here("launch", "--resume", str(run.dir), "--detach")
        assert out.returncode == 0, out.stdout + out.stderr
        run.wait_for(lambda: int(run.progress()[-1]["env_steps"]) > steps + 500, 60, "the resumed run to go on")
        assert services_running(run.dir) == expected  # one process a service instance, each once
        # Detached, nothing follows the run: its services see their supervisord die and exit cleanly.
        # One stopped meanwhile (as one hung would be) is woken by the kernel as its process group is
        # orphaned (SIGHUP then SIGCONT: POSIX) and exits too, or, where it stays stopped, stays
        # alone, and no resume starts beside it.
        stopped = run.pid("sampler0")
        stop_process(stopped)  # stopped before supervisord dies, or its SIGHUP would end it first
        with released(stopped):
            os.kill(supervisor.supervisord_pid(run.dir), signal.SIGKILL)
            t0 = time.monotonic()
            sampler0 = {("services.sampler", "0"): 1}
            try:
                run.wait_for(lambda: services_running(run.dir) in (sampler0, {}), 10, "the services to exit")
            except AssertionError as e:
                raise AssertionError(f"left running: {services_running(run.dir)}") from e
            took = time.monotonic() - t0
            assert supervisor.killed(run.dir)  # what a grid reports it as
            if services_running(run.dir):
                assert all("-sampler0-" in name for name in run.segments()), run.segments()
                status = rlpipe("status", str(run.dir))
                assert status.returncode == 1 and "supervisord is gone" in status.stdout, status.stdout + status.stderr
                again = rlpipe_here("launch", "--resume", str(run.dir), "--detach")
                assert again.returncode == 2 and "without their supervisor" in again.stderr, again.stdout + again.stderr
                os.kill(stopped, signal.SIGCONT)  # it runs again and exits too
            run.wait_for(lambda: not supervisor.service_pids(run.dir), 10, "sampler0 to exit once it runs")
        assert not run.segments()
        stop = rlpipe("stop", str(run.dir))
        assert stop.returncode == 0 and supervisor.service_pids(run.dir) == [], stop.stdout + stop.stderr
        print(f"services gone {took:.1f} s after supervisord")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if run is not None:
            backend.clean(run.dir)
            assert not run.segments()


def test_a_second_replay_action_server_or_sampler_of_a_run_exits_on_its_lock(runs):
    run = runs("cartpole_ppo.toml", "sampler.inference='server'", "run.target_return=1e9")
    run.wait_steps(500, timeout=60)
    before = run.status()
    for service in ("replay", "action_server", "sampler"):
        second = subprocess.run([sys.executable, "-m", f"services.{service}", "--run-dir", str(run.dir), "--instance",
                                 "0"], cwd=REPO, capture_output=True, text=True, timeout=60)
        holder = before[f"{service}0"][1]
        assert second.returncode == 1, second.stderr[-2000:]
        assert f"another {service} (instance 0, pid {holder}) runs for" in second.stderr, second.stderr[-2000:]
    assert run.status() == before  # nothing restarted: the live ones kept their endpoints and tables
    steps = int(run.progress()[-1]["env_steps"])
    run.wait_steps(steps + 500, timeout=60)
