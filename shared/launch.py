"""Run directories and supervisord: make a run, start it, follow it, stop it, clean up after it."""

from __future__ import annotations

import csv
import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
import xmlrpc.client
from datetime import datetime
from pathlib import Path

from shared import config as config_mod
from shared import ray_cluster, shm
from shared.auth import write_curve_keys, write_secret
from shared.config import Experiment
from shared.acting import ACTING_FILE
from shared.runtime import CONFIG_ERROR, RUN_CONFIG

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
TEMPLATE = DEPLOY / "supervisord.conf.tmpl"
PROGRAM = """
[program:{program}]
command={python} -m services.{service} --run-dir {run_dir} --instance {instance}
process_name={process}
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
stdout_logfile={run_dir}/logs/{process}.log
stdout_logfile_maxbytes=20MB
stdout_logfile_backups=1
environment=PROMETHEUS_MULTIPROC_DIR="{run_dir}/metrics",PYTHONUNBUFFERED="1"
"""
SCALABLE = ("sampler", "action_server")
"""Services ``rlpipe scale`` changes the count of: one supervisord program (and group) per
instance, so that adding or removing one leaves the others running."""


def make_run_dir(exp: Experiment, name: str | None = None) -> Path:
    """A fresh run directory ``<runs_dir>/<name>_<stamp>_<random>`` (name: ``run.name`` unless
    given) with the run's config and secret, and its private socket directory. The random
    suffix makes run ids unguessable and keeps two runs started in the same second apart."""
    stamp = datetime.now().strftime("%Y%m%dT%H%M%S")
    base = safe_name(name or exp.run.name)
    root = Path(exp.run.runs_dir)
    root.mkdir(parents=True, exist_ok=True)
    while True:
        run_dir = root / f"{base}_{stamp}_{secrets.token_hex(3)}"
        try:
            run_dir.mkdir()
            break
        except FileExistsError:
            continue
    for sub in ("logs", "metrics", "checkpoints"):
        (run_dir / sub).mkdir()
    make_private_dir(config_mod.socket_base())
    config_mod.socket_dir(run_dir).mkdir(mode=0o700)
    write_secret(run_dir)
    if exp.network.transport == "tcp":
        write_curve_keys(run_dir)
    (run_dir / RUN_CONFIG).write_text(config_mod.dumps(exp))
    return run_dir.resolve()


def reopen_run_dir(run_dir: Path) -> None:
    """Make a stopped run's directory ready to start again (``launch --resume``): its socket
    directory back, the previous result set aside (the run goes on to a new one), the
    previous learner's acting.json gone."""
    make_private_dir(config_mod.socket_base())
    config_mod.socket_dir(run_dir).mkdir(mode=0o700, exist_ok=True)
    result = run_dir / "result.json"
    if result.exists():
        result.replace(run_dir / "result.previous.json")
    (run_dir / ACTING_FILE).unlink(missing_ok=True)  # the restarted learner writes it when its agent is built


def safe_name(name: str) -> str:
    """``name`` with each character a run id may not hold (letters, digits, '_' and '.') made '_'."""
    return "".join(c if c.isalnum() or c in "_." else "_" for c in name)


def make_private_dir(path: Path) -> None:
    """Make ``path`` a directory only we can enter (0700), or refuse one another user owns."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory of uid {os.getuid()} (owner uid {st.st_uid}): another user "
                              "could reach this run's sockets; remove it, or set XDG_RUNTIME_DIR to a private directory")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def programs(exp: Experiment) -> list[tuple[str, int, int, str]]:
    """The run's services: (service, instances, start priority, autorestart: "true", or
    "unexpected" for the learner, whose exit 0 ends the run), under supervisord or Ray."""
    services = [("replay", 1, 10, "true"), ("learner", exp.learner.count, 20, "unexpected"), ("sampler", exp.sampler.count, 40, "true")]
    if exp.sampler.inference == "server":
        services.insert(2, ("action_server", exp.action_server.count, 30, "true"))
    if exp.network.metrics_port:
        services.insert(0, ("metrics", 1, 5, "true"))
    if exp.eval.every_s:
        services.append(("evaluator", 1, 50, "true"))
    return services


def supervisord_conf(exp: Experiment, run_dir: Path) -> str:
    programs_ = []
    for service, count, priority, autorestart in programs(exp):
        common = dict(service=service, priority=priority, autorestart=autorestart, run_dir=run_dir, python=sys.executable)
        if service in SCALABLE:
            programs_ += [PROGRAM.format(program=f"{service}{i}", process=f"{service}{i}", instance=i, count=1, **common)
                          for i in range(count)]
        else:
            programs_.append(PROGRAM.format(program=service, process=f"{service}%(process_num)d",
                                            instance="%(process_num)d", count=count, **common))
    return TEMPLATE.read_text().format(run_dir=run_dir, socket_dir=config_mod.socket_dir(run_dir)) + "".join(programs_)


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


class ScaleError(ValueError):
    """A scale request that cannot be applied (one line, naming why)."""


def scale(run_dir: Path, counts: dict[str, int]) -> tuple[list[str], list[str], list[str]]:
    """Change service counts of a live run, e.g. ``{"sampler": 4, "action_server": 2}``. Writes
    the new counts to the run's config (services started from now on read it), regenerates
    supervisord.conf and applies it over XML-RPC: instances beyond a new count are stopped
    (SIGTERM: a sampler drops the segment it is collecting; replay still inserts what it
    announced) and removed, new ones are added and started; the others are not touched, but
    for the samplers whose action-server (i mod count) changes with the action-server count,
    which are restarted. Returns (processes added, removed, restarted)."""
    if ray_cluster.is_cluster_run(run_dir):
        raise ScaleError("this run's services are Ray actors: live scaling works on supervisord runs only")
    unknown = sorted(set(counts) - set(SCALABLE))
    if unknown:
        raise ScaleError(f"cannot scale {', '.join(unknown)}: scalable services are {', '.join(SCALABLE)}")
    if supervisord_pid(run_dir) is None:
        raise ScaleError(f"run {run_dir.name} is not running: scale applies to a live run")
    path = run_dir / RUN_CONFIG
    exp = config_mod.load(path)
    if "action_server" in counts and exp.sampler.inference != "server":
        raise ScaleError(f"action_server={counts['action_server']}: this run's samplers act locally "
                         f"(sampler.inference = {exp.sampler.inference}): it runs no action-servers")
    for service, n in counts.items():
        most = config_mod.most_count(getattr(exp, service))
        if not 1 <= n <= most:
            raise ScaleError(f"{service}={n}: this run takes 1 to {most} (its {service}.max_count, set at launch)")
    try:  # ConfigError names a conflict (e.g. learner.batch_segments with fewer samplers)
        new = config_mod.load(path, [f"{service}.count={n}" for service, n in counts.items()])
    except config_mod.ConfigError as e:
        raise ScaleError(", ".join(f"{k}={v}" for k, v in counts.items()) + f": {e}") from None
    tmp = path.with_suffix(".tmp")
    tmp.write_text(config_mod.dumps(new))
    tmp.replace(path)
    (run_dir / "supervisord.conf").write_text(supervisord_conf(new, run_dir))
    server = rpc(run_dir).supervisor
    added, changed, removed = server.reloadConfig()[0]
    for group in removed + changed:
        server.stopProcessGroup(group, True)
        server.removeProcessGroup(group)
    for group in changed + added:
        server.addProcessGroup(group)
    old_m, new_m = exp.action_server.count, new.action_server.count
    moved = [f"sampler{i}" for i in range(min(exp.sampler.count, new.sampler.count)) if i % old_m != i % new_m]
    for name in moved:  # to the action-server i mod new count (a sampler picks it when it starts)
        server.stopProcess(name, True)
        server.startProcess(name, False)
    return sorted(changed + added), sorted(removed + changed), moved


def rpc(run_dir: Path) -> xmlrpc.client.ServerProxy:
    """supervisord's XML-RPC interface over the run's unix socket (no supervisorctl process to start)."""
    from supervisor.xmlrpc import SupervisorTransport

    url = f"unix://{config_mod.socket_dir(run_dir) / 'supervisor.sock'}"
    return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=SupervisorTransport(None, None, url))


def supervisorctl(run_dir: Path, *args: str, capture: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c", str(run_dir / "supervisord.conf"),
                           *args], capture_output=capture, text=True)


def supervisord_pid(run_dir: Path) -> int | None:
    """The pid of this run's supervisord, if it runs: the pidfile's process must name this
    run's config (a stale pidfile whose pid was reused by another process counts as gone)."""
    try:
        pid = int((run_dir / "supervisord.pid").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    try:
        return pid if Path(run_dir).resolve() in _run_dirs_named(Path(f"/proc/{pid}")) else None
    except OSError:  # no such process (any more)
        return None


def running(run_dir: Path) -> bool:
    """Whether the run's supervisord (or, for a run on a cluster, any of its actors) is there."""
    if ray_cluster.is_cluster_run(run_dir):
        return ray_cluster.running(run_dir)
    return supervisord_pid(run_dir) is not None


def stop(run_dir: Path, timeout_s: float = 60.0) -> bool:
    """Stop every process of the run (services first, then supervisord, or the cluster's
    actors); True once all are gone."""
    if ray_cluster.is_cluster_run(run_dir):
        stopped = ray_cluster.stop(run_dir, timeout_s)
        shutil.rmtree(config_mod.socket_dir(run_dir), ignore_errors=True)
        return stopped and not service_pids(run_dir)
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
            _terminate_unguarded(run_dir)
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


def _terminate_unguarded(run_dir: Path) -> None:
    """SIGTERM the run's processes that have no SIGTERM handler: services still starting, before
    install_signal_handlers. supervisord loses its stop signal to a process it forked a moment
    before (sent to a process group the child has not made yet, or caught by the handler the
    child inherited from supervisord until it execs the service), e.g. one it was restarting
    after a crash, and would wait stopwaitsecs (5 s) to kill it; such a process dies at once on
    SIGTERM's default action. Processes that handle SIGTERM (supervisord, running services)
    have had theirs and are left to finish their clean exit."""
    for pid in service_pids(run_dir):
        try:
            with open(f"/proc/{pid}/status") as f:
                masks = dict(line.split(":", 1) for line in f if line.startswith(("SigCgt", "SigIgn")))
            if not (int(masks["SigCgt"], 16) | int(masks["SigIgn"], 16)) & (1 << (signal.SIGTERM - 1)):
                os.kill(pid, signal.SIGTERM)
        except (OSError, KeyError):
            pass  # gone meanwhile


def service_pids(run_dir: Path) -> list[int]:
    """Processes of this run: services whose ``--run-dir`` argument is this directory and
    supervisord whose ``-c`` is its supervisord.conf. Arguments are compared as resolved
    paths (relative ones against the process's cwd), never as substrings: run ``X`` is not
    run ``X_2``."""
    target = Path(run_dir).resolve()
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if target in _run_dirs_named(proc):
                    pids.append(int(proc.name))
            except OSError:
                pass  # gone, or another user's
    return pids


def _run_dirs_named(proc: Path) -> set[Path]:
    argv = [a.decode(errors="surrogateescape") for a in (proc / "cmdline").read_bytes().split(b"\0")]
    named = []
    for flag, value in zip(argv, argv[1:]):
        if flag == "--run-dir":
            named.append(value)
        elif flag == "-c" and Path(value).name == "supervisord.conf":
            named.append(str(Path(value).parent))
    named += [a.split("=", 1)[1] for a in argv if a.startswith("--run-dir=")]
    if not named:
        return set()
    cwd = os.readlink(proc / "cwd")
    return {(Path(cwd) / value).resolve() for value in named}


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


BUILD_TIMEOUT_S = 120.0  # a learner this slow to build its agent is left to `follow` and `status`


def wait_until_built(run_dir: Path, timeout_s: float = BUILD_TIMEOUT_S) -> str | None:
    """Wait for the learner to have built the agent (its ``acting.json``): None; or the one
    line of a service's config error (a model that cannot exist for the env: the learner,
    and action-servers, exit 2 with it). Raises ServiceCrashLoop when services keep dying at
    start-up for another reason (the caller stops the run).

    The launcher used to build the agent itself, which imported torch while the learner did
    the same on two cores: the first env step waited for both.
    """
    deadline, watch = time.monotonic() + timeout_s, CrashWatch(run_dir)
    while time.monotonic() < deadline and not (run_dir / ACTING_FILE).exists():
        error = _config_error(run_dir)
        if error is not None:
            return error
        try:
            watch.check()
        except ServiceCrashLoop:
            error = _config_error(run_dir)  # its line may have reached the log after the exit
            if error is None:
                raise
            return error
        time.sleep(0.05)
    return None


def _config_error(run_dir: Path) -> str | None:
    """The config error a service of the run logged before it exited (``runtime.serve``), if any."""
    for log in sorted((run_dir / "logs").glob("*.log")):
        try:
            lines = log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            if line.startswith(CONFIG_ERROR):
                return line[len(CONFIG_ERROR):]
    return None


class ServiceCrashLoop(RuntimeError):
    """Services of the run die again and again right after they start."""

    def __init__(self, process: str, log_path: str, crashes: int):
        super().__init__(f"{process} exited with an error within {CRASH_WINDOW_S:.0f} s of starting "
                         f"({crashes} such exits in this run)")
        self.process, self.log_path = process, log_path

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(cannot read {self.log_path}: {e.strerror})"


CRASH_WINDOW_S = 20.0  # a process that dies this soon after it started has crashed at start-up
CRASHES_TO_FAIL = 2  # quick crashes, of any processes of the run: a one-off may be a transient


class CrashWatch:
    """Counts quick deaths of the run's processes from supervisord's own log, which records
    every spawn and every exit with its status (a process restarted at once leaves no trace of
    its exit status in the process table). ``check()`` raises ServiceCrashLoop at the
    CRASHES_TO_FAIL-th exit with an error status within CRASH_WINDOW_S of that process's
    spawn, or when supervisord gave up on a process (FATAL). A process killed by a signal
    (``kill -9``) is restarted by supervisord and does not count."""

    _LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ (?:spawned: '(?P<spawned>[^']+)' with pid"
                       r"|exited: (?P<exited>\S+) \(exit status (?P<status>\d+);|gave up: (?P<fatal>\S+) entered FATAL)")

    def __init__(self, run_dir: Path):
        self.log, self.logs = run_dir / "logs" / "supervisord.log", run_dir / "logs"
        self.offset = 0
        self.spawned: dict[str, datetime] = {}
        self.crashes = 0

    def check(self) -> None:
        try:
            with self.log.open("rb") as f:
                f.seek(self.offset)
                text = f.read()
        except FileNotFoundError:
            return
        text = text[:text.rfind(b"\n") + 1]  # whole lines only; the rest is read next time
        self.offset += len(text)
        for line in text.decode(errors="replace").splitlines():
            m = self._LINE.match(line)
            if m is None:
                continue
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
            if m.group("spawned"):
                self.spawned[m.group("spawned")] = at
            elif m.group("fatal"):
                raise ServiceCrashLoop(m.group("fatal"), str(self.logs / f"{m.group('fatal')}.log"), self.crashes)
            elif int(m.group("status")) != 0:
                name = m.group("exited")
                self.crashes += (at - self.spawned.get(name, at)).total_seconds() < CRASH_WINDOW_S
                if self.crashes >= CRASHES_TO_FAIL:
                    raise ServiceCrashLoop(name, str(self.logs / f"{name}.log"), self.crashes)


def _eval_column(row: dict) -> str:
    """The evaluator's latest return in a progress row, once there is one."""
    if not row.get("eval_return"):
        return ""
    return f"  eval {float(row['eval_return']):.1f} (v{row['eval_policy_version']})"


def follow(run_dir: Path, max_wall_s: float, out=sys.stdout) -> dict | None:
    """Print progress rows as the learner writes them; return the result when the run ends.

    Raises ServiceCrashLoop when a service keeps dying at start-up (the caller stops the run).
    """
    shown = 0
    deadline = time.monotonic() + max_wall_s + 60
    watch = CrashWatch(run_dir)
    while time.monotonic() < deadline:
        rows = read_progress(run_dir)
        for row in rows[shown:]:
            print(f"[{float(row['wall_s']):7.1f}s] steps {int(row['env_steps']):>8} "
                  f"({float(row['env_steps_per_s']):>7.0f}/s)  updates {int(row['updates']):>5}  "
                  f"return {float(row['mean_return']):8.1f}  episodes {int(row['episodes']):>5}  "
                  f"lag {float(row['policy_lag']):.2f}" + _eval_column(row), file=out, flush=True)
        shown = len(rows)
        result = read_result(run_dir)
        if result is not None:
            return result
        if not running(run_dir):
            print("the run's processes are gone: it was stopped", file=out, flush=True)
            return None
        watch.check()
        time.sleep(0.5)
    print(f"the run did not end within {max_wall_s + 60:.0f} s", file=out, flush=True)
    return None
