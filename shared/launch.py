"""Run directories and supervisord: make a run, start it, follow it, stop it, clean up after it."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xmlrpc.client
from datetime import datetime
from pathlib import Path

from shared import config as config_mod
from shared import shm
from shared.config import Experiment
from shared.runtime import RUN_CONFIG

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
TEMPLATE = DEPLOY / "supervisord.conf.tmpl"
PROGRAM = """
[program:{name}]
command={python} -m services.{service} --run-dir {run_dir} --instance %(process_num)d
process_name={name}%(process_num)d
numprocs={count}
priority={priority}
autorestart={autorestart}
exitcodes=0
startsecs=1
startretries=10
stopsignal=TERM
stopwaitsecs=5
stopasgroup=true
killasgroup=true
redirect_stderr=true
stdout_logfile={run_dir}/logs/{name}%(process_num)d.log
stdout_logfile_maxbytes=20MB
stdout_logfile_backups=1
environment=PROMETHEUS_MULTIPROC_DIR="{run_dir}/metrics",PYTHONUNBUFFERED="1"
"""


def make_run_dir(exp: Experiment) -> Path:
    stamp = datetime.now().strftime("%Y%m%dT%H%M%S")
    base = "".join(c if c.isalnum() or c in "_." else "_" for c in exp.run.name)
    root = Path(exp.run.runs_dir)
    run_dir, n = root / f"{base}_{stamp}", 1
    while run_dir.exists() or config_mod.socket_dir(run_dir).exists():
        n += 1
        run_dir = root / f"{base}_{stamp}_{n}"
    for sub in ("logs", "metrics", "checkpoints"):
        (run_dir / sub).mkdir(parents=True)
    config_mod.socket_dir(run_dir).mkdir(parents=True)
    (run_dir / RUN_CONFIG).write_text(config_mod.dumps(exp))
    return run_dir.resolve()


def supervisord_conf(exp: Experiment, run_dir: Path) -> str:
    services = [("replay", "replay", 1, 10, "true"), ("learner", "learner", 1, 20, "unexpected"),
                ("sampler", "sampler", exp.sampler.count, 40, "true")]
    if exp.sampler.inference == "server":
        services.insert(2, ("action_server", "action_server", exp.action_server.count, 30, "true"))
    if exp.network.metrics_port:
        services.insert(0, ("metrics", "metrics", 1, 5, "true"))
    programs = "".join(PROGRAM.format(name=name, service=service, count=count, priority=priority,
                                      autorestart=autorestart, run_dir=run_dir, python=sys.executable)
                       for name, service, count, priority, autorestart in services)
    return TEMPLATE.read_text().format(run_dir=run_dir, socket_dir=config_mod.socket_dir(run_dir)) + programs


def start(exp: Experiment, run_dir: Path) -> None:
    conf = run_dir / "supervisord.conf"
    conf.write_text(supervisord_conf(exp, run_dir))
    subprocess.run([sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)], check=True)
    deadline = time.monotonic() + 30  # supervisord daemonizes: wait until it answers
    while True:
        try:
            rpc(run_dir).supervisor.getState()
            return
        except (OSError, xmlrpc.client.Error):
            if time.monotonic() > deadline:
                raise RuntimeError(f"supervisord for {run_dir} did not come up; see {run_dir}/logs/supervisord.log") \
                    from None
            time.sleep(0.02)


def rpc(run_dir: Path) -> xmlrpc.client.ServerProxy:
    """supervisord's XML-RPC interface over the run's unix socket (no supervisorctl process to start)."""
    from supervisor.xmlrpc import SupervisorTransport

    url = f"unix://{config_mod.socket_dir(run_dir) / 'supervisor.sock'}"
    return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=SupervisorTransport(None, None, url))


def supervisorctl(run_dir: Path, *args: str, capture: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c", str(run_dir / "supervisord.conf"),
                           *args], capture_output=capture, text=True)


def supervisord_pid(run_dir: Path) -> int | None:
    try:
        pid = int((run_dir / "supervisord.pid").read_text().strip())
        os.kill(pid, 0)
        return pid
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None


def stop(run_dir: Path, timeout_s: float = 60.0) -> bool:
    """Stop every process of the run (services first, then supervisord); True once all are gone."""
    pid = supervisord_pid(run_dir)
    if pid is not None:
        try:
            server = rpc(run_dir).supervisor
            # Every service gets SIGTERM at once; shutdown alone would stop them group by group.
            server.stopAllProcesses(False)
            server.shutdown()
        except (OSError, xmlrpc.client.Error):
            supervisorctl(run_dir, "shutdown", capture=True)
        deadline = time.monotonic() + timeout_s
        while supervisord_pid(run_dir) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
            _nudge(run_dir)
    deadline = time.monotonic() + 5  # children may still be exiting when supervisord is gone
    while service_pids(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    stopped = supervisord_pid(run_dir) is None and not service_pids(run_dir)
    if stopped:
        shutil.rmtree(config_mod.socket_dir(run_dir), ignore_errors=True)
    return stopped


def _nudge(run_dir: Path) -> None:
    """Wake supervisord's event loop with a request: once its last child is reaped it exits
    at its next loop turn, which otherwise may come only with its 1 s poll timeout."""
    try:
        rpc(run_dir).supervisor.getState()
    except (OSError, xmlrpc.client.Error):
        pass  # already gone


def service_pids(run_dir: Path) -> list[int]:
    """Processes whose command line names this run directory (services, supervisord)."""
    needle = str(run_dir).encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if needle in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def clean(run_dir: Path) -> tuple[list[int], list[str]]:
    """Stop what still runs of the run, kill what will not stop, remove its shm segments."""
    stop(run_dir, timeout_s=20)
    killed = service_pids(run_dir)
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while service_pids(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(config_mod.socket_dir(run_dir), ignore_errors=True)
    return killed, shm.clean(run_dir.name)


def resolve_run(name: str, runs_dir: str = "runs") -> Path:
    """A run directory from a path or a run id under ``runs_dir``."""
    for candidate in (Path(name), Path(runs_dir) / name):
        if (candidate / RUN_CONFIG).exists():
            return candidate.resolve()
    raise FileNotFoundError(f"no run directory {name!r} (give its path, or its id under {runs_dir}/)")


def read_progress(run_dir: Path) -> list[dict]:
    path = run_dir / "progress.csv"
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def read_result(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "result.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def follow(run_dir: Path, max_wall_s: float, out=sys.stdout) -> dict | None:
    """Print progress rows as the learner writes them; return the result when the run ends."""
    shown = 0
    deadline = time.monotonic() + max_wall_s + 60
    while time.monotonic() < deadline:
        rows = read_progress(run_dir)
        for row in rows[shown:]:
            print(f"[{float(row['wall_s']):7.1f}s] steps {int(row['env_steps']):>8} "
                  f"({float(row['env_steps_per_s']):>7.0f}/s)  updates {int(row['updates']):>5}  "
                  f"return {float(row['mean_return']):8.1f}  episodes {int(row['episodes']):>5}  "
                  f"lag {float(row['policy_lag']):.2f}", file=out, flush=True)
        shown = len(rows)
        result = read_result(run_dir)
        if result is not None:
            return result
        if supervisord_pid(run_dir) is None:
            print("supervisord is gone: the run was stopped", file=out, flush=True)
            return None
        time.sleep(0.5)
    print(f"the run did not end within {max_wall_s + 60:.0f} s", file=out, flush=True)
    return None
