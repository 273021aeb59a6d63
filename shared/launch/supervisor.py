"""supervisord: start a run's services, scale them, stop them, clean up after them.

This module is the supervisord backend (``shared.launch.backend.Backend``); it also finds
the processes of a run, whichever backend started them (``service_pids``), and removes what
a run left (``remove_leftovers``).

Every call to supervisord has a timeout (``RPC_TIMEOUT_S``): a supervisord that is stopped
(SIGSTOP) or hung does not hang ``stop``, ``clean``, ``status`` or ``scale``; ``stop`` kills
it and stops its services itself. A stopped one is told from its process state at once,
without the wait. Services whose supervisord is gone (killed under them) are
orphans that would run on: ``running`` counts them, ``supervised`` does not, and ``stop``
ends them as supervisord would have.
"""

from __future__ import annotations

import http.client
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import xmlrpc.client
from pathlib import Path
from shared.config import endpoints, loading, schema
from shared.transport import shm
from shared.config.schema import Experiment
from shared.runtime import runfiles
from shared.runtime.process import PRIVATE_UMASK
from shared.launch.rundirs import service_env, DEPLOY, programs


TEMPLATE = DEPLOY / "supervisord.conf.tmpl"
log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0
"""How long a call to supervisord may take before it counts as hung: it answers in
milliseconds (one event loop), but for the calls that wait for processes to stop (``scale``'s,
which get STOPWAIT_S more a process). A stop that takes a slow one for a hung one loses
nothing: it kills supervisord and stops the services itself."""

STOPWAIT_S = 5
"""Seconds a service has for its clean exit after SIGTERM before SIGKILL: supervisord's
``stopwaitsecs``, and ``stop``'s for services without a supervisord."""


WATCHDOG_STOPWAIT_S = STOPWAIT_S + 10
"""The watchdog's ``stopwaitsecs``: when it stops a run it outlives the others' SIGKILL (it
unlinks the segments they leave), though its own stop of them sends it SIGTERM too."""


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
stopwaitsecs={stopwait}
stopasgroup=true
killasgroup=true
redirect_stderr=true
stdout_logfile={run_dir}/{logs}/{process}.log
stdout_logfile_maxbytes=20MB
stdout_logfile_backups=1
environment=PROMETHEUS_MULTIPROC_DIR="{run_dir}/{metrics}",PYTHONUNBUFFERED="1",{environment}
"""


WATCHDOG = """
[eventlistener:watchdog]
command={python} -m shared.launch.watchdog --run-dir {run_dir}
events=TICK_5
priority=1
autorestart=true
startsecs=1
stopsignal=TERM
stopwaitsecs={stopwait}
stderr_logfile={run_dir}/{logs}/watchdog.log
stderr_logfile_maxbytes=20MB
stderr_logfile_backups=1
environment=PROMETHEUS_MULTIPROC_DIR="{run_dir}/{metrics}",PYTHONUNBUFFERED="1",{environment}
"""
"""The run's watchdog (``shared.launch.watchdog``), where ``run.watchdog_s`` > 0: an event listener
(its stdout is supervisord's protocol, its log is its stderr), woken every 5 s by TICK_5."""


_DIRS = {"logs": runfiles.LOGS_DIR, "metrics": runfiles.METRICS_DIR}
"""The run directory's folders the program sections name."""


SCALABLE = ("sampler", "action_server")
"""Services ``rlpipe scale`` changes the count of: one supervisord program (and group) per
instance, so that adding or removing one leaves the others running."""


def supervisord_conf(exp: Experiment, run_dir: Path) -> str:
    programs_ = []
    environment = ",".join(f'{k}="{v}"' for k, v in service_env(exp).items()).replace("%", "%%")
    for service, count, priority, autorestart in programs(exp):
        common = dict(service=service, priority=priority, autorestart=autorestart, run_dir=run_dir, python=sys.executable,
                      environment=environment, stopwait=STOPWAIT_S, **_DIRS)
        if service in SCALABLE:
            programs_ += [PROGRAM.format(program=f"{service}{i}", process=f"{service}{i}", instance=i, count=1, **common)
                          for i in range(count)]
        else:
            programs_.append(PROGRAM.format(program=service, process=f"{service}%(process_num)d",
                                            instance="%(process_num)d", count=count, **common))
    if exp.run.watchdog_s:
        programs_.append(WATCHDOG.format(run_dir=run_dir, python=sys.executable, environment=environment,
                                         stopwait=WATCHDOG_STOPWAIT_S, **_DIRS))
    return TEMPLATE.read_text().format(run_dir=run_dir, socket_dir=endpoints.socket_dir(run_dir),
                                       logfile=run_dir / runfiles.LOGS_DIR / runfiles.SUPERVISORD_LOG,
                                       pidfile=run_dir / runfiles.SUPERVISORD_PID) + "".join(programs_)


def start(exp: Experiment, run_dir: Path) -> None:
    conf = run_dir / runfiles.SUPERVISORD_CONF
    conf.write_text(supervisord_conf(exp, run_dir))
    # umask 077 from the start: supervisord opens its own log before it applies the config's umask.
    subprocess.run([sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)], check=True,
                   preexec_fn=lambda: os.umask(PRIVATE_UMASK))
    deadline = time.monotonic() + 30  # supervisord daemonizes: wait until it answers
    while True:
        try:
            rpc(run_dir).supervisor.getState()
            return
        except (*_NO_ANSWER, xmlrpc.client.Error):
            if time.monotonic() > deadline:
                log = run_dir / runfiles.LOGS_DIR / runfiles.SUPERVISORD_LOG
                raise RuntimeError(f"supervisord for {run_dir} did not come up; see {log}") from None
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
    unknown = sorted(set(counts) - set(SCALABLE))
    if unknown:
        raise ScaleError(f"cannot scale {', '.join(unknown)}: scalable services are {', '.join(SCALABLE)}")
    pid = supervisord_pid(run_dir)
    if pid is None:
        raise ScaleError(f"run {run_dir.name} is not running: scale applies to a live run")
    if is_stopped(pid):
        raise ScaleError(f"supervisord of run {run_dir.name} (pid {pid}) is stopped (SIGSTOP): it cannot scale; "
                         "`kill -CONT` it, or `rlpipe stop` the run")
    path = run_dir / runfiles.RUN_CONFIG
    exp = loading.load(path)
    if "action_server" in counts and exp.sampler.inference != "server":
        raise ScaleError(f"action_server={counts['action_server']}: this run's samplers act locally "
                         f"(sampler.inference = {exp.sampler.inference}): it runs no action-servers")
    for service, n in counts.items():
        most = schema.most_count(getattr(exp, service))
        if not 1 <= n <= most:
            raise ScaleError(f"{service}={n}: this run takes 1 to {most} (its {service}.max_count, set at launch: "
                             f"launch with --set {service}.max_count=N for room up to N)")
    try:  # ConfigError names a conflict (e.g. learner.batch_segments with fewer samplers)
        new = loading.load(path, [f"{service}.count={n}" for service, n in counts.items()])
    except schema.ConfigError as e:
        raise ScaleError(", ".join(f"{k}={v}" for k, v in counts.items()) + f": {e}") from None
    tmp = path.with_suffix(".tmp")
    tmp.write_text(loading.dumps(new))
    tmp.replace(path)
    (run_dir / runfiles.SUPERVISORD_CONF).write_text(supervisord_conf(new, run_dir))
    # The stops wait for the processes' exits: up to STOPWAIT_S each, then SIGKILL.
    server = rpc(run_dir, timeout_s=RPC_TIMEOUT_S + 2 * STOPWAIT_S).supervisor
    old_m, new_m = exp.action_server.count, new.action_server.count
    moved = [f"sampler{i}" for i in range(min(exp.sampler.count, new.sampler.count)) if i % old_m != i % new_m]
    try:
        added, changed, removed = server.reloadConfig()[0]
        for group in removed + changed:
            server.stopProcessGroup(group, True)
            server.removeProcessGroup(group)
        for group in changed + added:
            server.addProcessGroup(group)
        for name in moved:  # to the action-server i mod new count (a sampler picks it when it starts)
            server.stopProcess(name, True)
            server.startProcess(name, False)
    except _NO_ANSWER as e:
        raise ScaleError(f"supervisord of run {run_dir.name} did not answer ({type(e).__name__}: {e}): the new counts "
                         "are in its config.toml; `rlpipe stop` it and `launch --resume` to apply them") from None
    return sorted(changed + added), sorted(removed + changed), moved


_NO_ANSWER = (OSError, http.client.HTTPException)
"""What a call to a supervisord that does not answer raises: TimeoutError past its timeout,
ConnectionRefusedError or FileNotFoundError when its socket is gone."""


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a unix socket, every connect, send and receive bounded by ``timeout``."""

    def __init__(self, path: Path, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self.path))


class _UnixTransport(xmlrpc.client.Transport):
    """XML-RPC over supervisord's unix socket with a timeout (supervisor's own transport has
    none: a stopped supervisord hung every caller)."""

    def __init__(self, path: Path, timeout_s: float):
        super().__init__()
        self.path, self.timeout_s = path, timeout_s

    def make_connection(self, host):
        return _UnixConnection(self.path, self.timeout_s)


def rpc(run_dir: Path, timeout_s: float | None = None) -> xmlrpc.client.ServerProxy:
    """supervisord's XML-RPC interface over the run's unix socket (no supervisorctl process to
    start). A call that gets no answer within ``timeout_s`` (default RPC_TIMEOUT_S) raises TimeoutError."""
    return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=_UnixTransport(
        endpoints.socket_dir(run_dir) / "supervisor.sock", RPC_TIMEOUT_S if timeout_s is None else timeout_s))


def supervisorctl(run_dir: Path, *args: str, capture: bool = False,
                  timeout_s: float = 10 + RPC_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``supervisorctl ARGS`` for the run; subprocess.TimeoutExpired (the process killed) past
    ``timeout_s``: an interpreter's start, and supervisorctl's own calls, which have no timeout."""
    return subprocess.run([sys.executable, "-m", "supervisor.supervisorctl", "-c", str(run_dir / runfiles.SUPERVISORD_CONF),
                           *args], capture_output=capture, text=True, timeout=timeout_s)


def supervisord_pid(run_dir: Path) -> int | None:
    """The pid of this run's supervisord, if it runs: the pidfile's process must name this
    run's config (a stale pidfile whose pid was reused by another process counts as gone)."""
    try:
        pid = int((run_dir / runfiles.SUPERVISORD_PID).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _of_run(pid, run_dir) else None


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, SIGTSTP, a debugger): its state in
    /proc/PID/stat is T or t. Such a supervisord cannot answer, and no timeout need tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False  # gone


def _of_run(pid: int, run_dir: Path) -> bool:
    """Whether process ``pid`` is one of the run's (its arguments name the run directory)."""
    try:
        return Path(run_dir).resolve() in _run_dirs_named(Path(f"/proc/{pid}"))
    except OSError:  # no such process (any more)
        return False


def running(run_dir: Path) -> bool:
    """Whether any process of the run is there: its supervisord, or a service (one whose
    supervisord was killed runs on: ``supervised`` tells)."""
    return supervisord_pid(run_dir) is not None or bool(service_pids(run_dir))


def running_here(run_dir: Path) -> bool:
    """As ``running``: supervisord runs on this host."""
    return running(run_dir)


def supervised(run_dir: Path) -> bool:
    """Whether the run's supervisord is there (services may run on without it: ``running``)."""
    return supervisord_pid(run_dir) is not None


def killed(run_dir: Path) -> bool:
    """Whether the run's supervisord died without its own exit (``kill -9``): it is gone but left
    its pidfile, which it removes as it exits. Its services exit with it
    (``runtime.process.exit_with_supervisord``), so ``running`` alone no longer tells."""
    return (run_dir / runfiles.SUPERVISORD_PID).exists() and supervisord_pid(run_dir) is None


def status(run_dir: Path) -> int:
    """``supervisorctl status`` of the run (one line a process, printed by supervisorctl); its
    exit status. A supervisord that is gone or does not answer is one line saying so, exit status 1."""
    if not supervised(run_dir):
        print(f"{run_dir.name}: supervisord is gone; {len(service_pids(run_dir))} process(es) of the run go on "
              f"without it: `rlpipe stop {run_dir}` ends them")
        return 1
    pid = supervisord_pid(run_dir)
    why = "it is stopped (SIGSTOP)" if is_stopped(pid) else None
    if why is None:
        try:
            rpc(run_dir).supervisor.getState()
            return supervisorctl(run_dir, "status").returncode
        except (*_NO_ANSWER, subprocess.TimeoutExpired):
            why = f"not within {RPC_TIMEOUT_S:g} s (hung, or stopped)"
    print(f"{run_dir.name}: supervisord (pid {pid}) does not answer: {why}: `rlpipe stop {run_dir}` kills it and "
          "stops the services")
    return 1


def stop(run_dir: Path, timeout_s: float = 60.0) -> bool:
    """Stop every process of the run (services first, then supervisord); True once all are gone.

    A supervisord that does not answer within RPC_TIMEOUT_S (stopped, hung) is killed; services
    without a supervisord (killed now, or before: orphans) get SIGTERM from here, and SIGKILL
    after STOPWAIT_S, as supervisord would have done (to their process groups)."""
    deadline = time.monotonic() + timeout_s
    pid = supervisord_pid(run_dir)
    if pid is not None:
        why = "it is stopped (SIGSTOP)" if is_stopped(pid) else None
        try:
            if why is None:
                server = rpc(run_dir).supervisor
                # Every service gets SIGTERM at once; shutdown alone would stop them group by group.
                server.stopAllProcesses(False)
                server.shutdown()
        except _NO_ANSWER as e:
            why = f"{type(e).__name__}: {e}"
        except xmlrpc.client.Error:
            pass  # it answered, with a fault: already shutting down (another stop)
        if why is not None:
            log.warning("supervisord of run %s (pid %d) does not answer (%s): killing it and stopping its "
                        "services directly", run_dir.name, pid, why)
            _signal(pid, signal.SIGKILL)  # a stopped process takes no SIGTERM, a hung one may ignore it
        # supervisord removes its pidfile before it has exited: wait for the process itself, or
        # what is left of its exit would be taken for an orphan of the run.
        while _of_run(pid, run_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
            _nudge(run_dir)
            _terminate_unguarded(run_dir)
    if supervisord_pid(run_dir) is None:
        _stop_orphans(run_dir)
    stopped = supervisord_pid(run_dir) is None and not service_pids(run_dir)
    if stopped:  # what a process that lived to its SIGKILL left (a SIGTERM lost to a restart: watchdog.stop_all)
        shutil.rmtree(endpoints.socket_dir(run_dir), ignore_errors=True)
        shm.clean(run_dir.name)
    return stopped


def _stop_orphans(run_dir: Path) -> None:
    """SIGTERM the run's processes left without a supervisord (supervisord's exit waits for its
    children: these are another's), SIGKILL what is left after STOPWAIT_S; each to its process
    group where it leads one (supervisord makes one a service, and signals the group:
    ``stopasgroup``, ``killasgroup``)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = service_pids(run_dir)
        if not pids:
            return
        if sig == signal.SIGTERM:
            log.warning("run %s: %d process(es) without their supervisord: stopping them", run_dir.name, len(pids))
        for pid in pids:
            _signal(pid, sig)
        deadline = time.monotonic() + STOPWAIT_S
        while service_pids(run_dir) and time.monotonic() < deadline:
            time.sleep(0.05)


def _signal(pid: int, sig: int) -> None:
    """``sig`` to process ``pid``, to its whole process group if it leads one; nothing if it is gone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # gone meanwhile (its pid not yet reused: we found it by its run directory a moment ago)


def _nudge(run_dir: Path) -> None:
    """Wake supervisord's event loop with a request: once its last child is reaped it exits
    at its next loop turn, which otherwise may come only with its 1 s poll timeout."""
    try:
        rpc(run_dir).supervisor.getState()
    except (*_NO_ANSWER, xmlrpc.client.Error):
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
        elif flag == "-c" and Path(value).name == runfiles.SUPERVISORD_CONF:
            named.append(str(Path(value).parent))
    named += [a.split("=", 1)[1] for a in argv if a.startswith("--run-dir=")]
    if not named:
        return set()
    cwd = os.readlink(proc / "cwd")
    return {(Path(cwd) / value).resolve() for value in named}


def clean(run_dir: Path) -> tuple[list[int], list[str]]:
    """Stop what still runs of the run, kill what will not stop, remove its shm segments (a
    supervisord run; ``backend.clean`` cleans a run of either backend)."""
    stop(run_dir, timeout_s=20)
    return remove_leftovers(run_dir)


def remove_leftovers(run_dir: Path) -> tuple[list[int], list[str]]:
    """SIGKILL every process of the run still there (``service_pids``: whichever backend
    started it), remove its socket directory and its shm segments; (pids killed, segments
    removed). For after a stop: a backend that still runs would restart what is killed."""
    killed = service_pids(run_dir)
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while service_pids(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(endpoints.socket_dir(run_dir), ignore_errors=True)
    return killed, shm.clean(run_dir.name)
