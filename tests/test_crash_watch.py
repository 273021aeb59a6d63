"""CrashWatch reads supervisord's log: error exits and signal deaths soon after a spawn count."""

from __future__ import annotations

import pytest

from shared.launch.follow import CrashWatch, ServiceCrashLoop


def _watch(tmp_path, lines: list[str]) -> CrashWatch:
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "logs" / "supervisord.log").write_text("".join(line + "\n" for line in lines))
    return CrashWatch(tmp_path)


def _life(name: str, t0: int, end: str) -> list[str]:
    return [f"2026-12-01 10:00:{t0:02d},000 INFO spawned: '{name}' with pid {100 + t0}",
            f"2026-12-01 10:00:{t0 + 2:02d},000 WARN exited: {name} ({end}; not expected)"]


@pytest.mark.parametrize("end", ["terminated by SIGBUS (core dumped)", "terminated by SIGSEGV", "exit status 1"])
def test_quick_error_exits_and_signal_deaths_are_a_crash_loop(tmp_path, end):
    watch = _watch(tmp_path, _life("replay0", 0, end) + _life("replay0", 5, end))
    with pytest.raises(ServiceCrashLoop) as info:
        watch.check()
    assert "replay0" in str(info.value)


@pytest.mark.parametrize("end", ["terminated by SIGKILL", "terminated by SIGTERM", "exit status 0"])
def test_kill9_stop_and_clean_exits_do_not_count(tmp_path, end):
    watch = _watch(tmp_path, _life("sampler0", 0, end) + _life("sampler0", 5, end) + _life("sampler0", 10, end))
    watch.check()
    assert watch.crashes == 0


@pytest.mark.learning
def test_a_service_killed_by_sigbus_leaves_its_python_stack_in_its_log_and_is_restarted(runs):
    """faulthandler is on in every service: the log names the signal and where Python was."""
    import os
    import signal

    run = runs("cartpole_ppo.toml", "run.target_return=1000.0")
    run.wait_steps(2_000)
    pid = run.pid("sampler0")
    os.kill(pid, signal.SIGBUS)
    run.wait_for(lambda: run.status().get("sampler0", ("", None))[1] not in (None, pid), 30,
                 "supervisord to restart sampler0")
    log = run.logs("sampler0")
    assert "Fatal Python error: Bus error" in log and 'File "' in log, log[-2000:]
    assert "terminated by SIGBUS" in (run.dir / "logs" / "supervisord.log").read_text()
