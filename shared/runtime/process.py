"""What every process of a run shares: logging, signals, BLAS threads, the torch device.

This module does not import torch: replay, metrics and samplers in server mode never load
it (its import is most of a process's start-up: docs/benchmarks.md, "Start-up and stop").
Services that run a network call ``torch_device``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import resource
import signal
import stat
import sys
from pathlib import Path

from shared.runtime import runfiles

CONFIG_ERROR = "config error: "  # how a service's log says its config cannot work (then it exits 2)


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=os.environ.get("RLPIPE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


PRIVATE_UMASK = 0o077  # what a run writes (run directory, logs, checkpoints, snapshots) only its user reads


def check_own_dir(path: Path, fix: str, shared_ok: bool = False) -> None:
    """Refuse ``path`` unless it is a directory (not a symlink) of our uid that no other user
    can write to, and make it 0700; PermissionError naming ``fix`` otherwise. ``shared_ok``
    (a directory of runs): others may read it, and a symlink to such a directory will do.

    Anyone who can write to a directory of runs can swap a run directory, and services import
    the config's ``module:attribute`` references from theirs: that would be code execution."""
    st = os.stat(path) if shared_ok else os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory of uid {os.getuid()} (owner uid {st.st_uid}, "
                              f"{stat.filemode(st.st_mode)}): {fix}")
    if shared_ok:
        if st.st_mode & 0o022:
            raise PermissionError(f"{path} can be written by other users ({stat.filemode(st.st_mode)}): {fix}")
    elif st.st_mode & 0o077:
        os.chmod(path, 0o700)


def raise_open_files_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; the new soft limit.

    Every TCP connection a bound socket accepts is a file descriptor (idle ones until the
    handshake timeout), and the default soft limit (often 1024) is soon reached."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def exit_once(code: int):
    """Raise SystemExit(code) and ignore the exit signals from now on: a second one (SIGHUP at
    supervisord's death, then `rlpipe stop`'s SIGTERM) would raise again inside the finally
    blocks the first started and leave segments behind; SIGKILL still ends a process that hangs."""
    for sig in EXIT_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(code)


def install_signal_handlers() -> None:
    """SIGTERM/SIGINT raise SystemExit (once: ``exit_once``) so that finally blocks and atexit
    unlink segments."""

    def handler(signum, frame):
        exit_once(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


@contextlib.contextmanager
def terminate_as_interrupt():
    """Inside, SIGTERM and SIGHUP raise KeyboardInterrupt as Ctrl-C does, once (later ones are
    ignored until the end, so the stop they start is not cut short): a command that follows its
    runs in the foreground (launch, grid, tune) stops them when a job scheduler, a CI runner or
    ``timeout`` ends it, or its terminal closes, instead of leaving them running. The previous
    handlers are back on leaving."""

    def handler(signum, frame):
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, was in previous.items():
            signal.signal(sig, was)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def signal_at_parent_death(sig: int) -> bool:
    """Have the kernel send this process ``sig`` when its parent dies (Linux ``PR_SET_PDEATHSIG``,
    no cost until then); False (errno set) where the call fails."""
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def exit_with_supervisord(run_dir: Path, process: str) -> None:
    """Under the run's supervisord, exit cleanly when it dies (``kill -9``): have the kernel send
    this process SIGHUP at its parent's death (Linux ``PR_SET_PDEATHSIG``, no cost until then),
    which raises SystemExit, so finally blocks and ``serve`` close sockets and unlink segments
    as at a stop (the learner writes its checkpoint). Without it the services of a detached run
    ran on as orphans until ``rlpipe stop`` or ``clean``. Nothing of the exit reaches the
    service's log: supervisord wrote it, from the pipe it no longer reads. A process that runs
    no Python signal handler (a C extension holding the GIL, a stopped process) exits once it
    does; ``stop``/``clean`` kill it meanwhile.

    Only where supervisord started this very process (it sets ``SUPERVISOR_PROCESS_NAME`` to its
    process name, ``process``); under Ray, honcho or serial mode the parent is another's and
    this does nothing. If supervisord died before this call (the parent is no longer the pid in
    the run's ``supervisord.pid``), it raises SystemExit at once."""
    if os.environ.get("SUPERVISOR_PROCESS_NAME") != process or not sys.platform.startswith("linux"):
        return

    def gone(signum, frame):
        exit_once(0)

    signal.signal(signal.SIGHUP, gone)
    if not signal_at_parent_death(signal.SIGHUP):
        logging.getLogger(__name__).warning("%s: prctl(PR_SET_PDEATHSIG) failed (%s): it will not notice if "
                                            "supervisord dies", process, os.strerror(ctypes.get_errno()))
        return
    try:
        supervisord = int((run_dir / runfiles.SUPERVISORD_PID).read_text())
    except (OSError, ValueError):
        return  # cannot tell; the signal is armed for a death from now on
    if os.getppid() != supervisord:  # it died before the signal was armed
        gone(signal.SIGHUP, None)


def torch_device(name: str, threads: int = 1):
    """Import torch, set its and numpy's BLAS intra-op threads and resolve ``run.device``
    (auto: cuda if present).

    One thread by default: the pipeline already runs one process per core's worth of work, and
    a second thread spinning for a core that another process holds slows a numpy acting step
    or a torch update down many times over (docs/benchmarks.md, "Numpy acting and one BLAS
    thread").
    """
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(threads)
    threadpool_limits(threads, user_api="blas")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (ours or another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_service(run_dir: Path, service: str, instance: int = 0):
    """Hold ``<run_dir>/<service><instance>.lock`` (flock) for this process's life: one process a
    service instance of a run. A second one (started by hand, or by a supervisord started beside
    the orphans of a killed one) would take over the first's endpoint and segments; it gets a
    RuntimeError naming the holder's pid before it touches anything. The kernel drops the lock
    when its holder dies, however it dies. Returns the open lock file (keep a reference)."""
    f = open(run_dir / f"{service}{instance}.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise RuntimeError(f"another {service} (instance {instance}, pid {holder}) runs for {run_dir}: one process "
                           "an instance; stop it first (rlpipe stop)") from None
    try:  # the pid is for the message above only: a full disk must not stop the service starting
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
    except OSError:
        pass
    return f


def run_id_of(run_dir: Path) -> str:
    """The run id is the run directory's name (letters, digits, '_' and '.')."""
    return Path(run_dir).resolve().name
