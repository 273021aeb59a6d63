"""What every service process does first: arguments, logging, signals, its config; and how it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Callable, NoReturn
from shared.config import loading, schema
from shared.config.endpoints import socket_dir
from shared.runtime import heartbeat
from shared.transport import shm
from shared.runtime.process import (CONFIG_ERROR, PRIVATE_UMASK, check_own_dir, exit_with_supervisord,
                                    install_signal_handlers, lock_service, raise_open_files_limit, setup_logging)
from shared.runtime.runfiles import RUN_CONFIG

_lock = None  # the process's service-instance lock, held until it exits


def service_args(service: str, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m services.{service}", description=f"rlpipe {service} service")
    p.add_argument("--run-dir", required=True, help="the run directory made by `rlpipe launch`")
    p.add_argument("--instance", type=int, default=0, help="index of this process among its service's processes")
    return p.parse_args(argv)


def start_service(service: str, argv=None) -> tuple[schema.Experiment, Path, int]:
    """Parse args, set up logging and signals (an exit when the run's supervisord dies:
    ``runtime.process.exit_with_supervisord``), one BLAS thread (``torch_device``), private files
    (umask 077), the open-files limit raised to its hard limit, check that the run directory is
    ours (services import from it), take the instance's lock (``runtime.process.lock_service``:
    one process a service instance of a run), publish the process's heartbeat
    (``shared.runtime.heartbeat``: its loops beat it), read the run's resolved config."""
    global _lock
    from threadpoolctl import threadpool_limits

    args = service_args(service, argv)
    # A SIGSEGV, SIGBUS (a full /dev/shm), SIGABRT or SIGFPE prints every thread's Python stack
    # to stderr (the service's log) before the process dies: the log names the cause.
    faulthandler.enable()
    setup_logging(f"{service}{args.instance}")
    install_signal_handlers()
    threadpool_limits(1, user_api="blas")  # torch-free services too: a numpy acting step is numpy's BLAS
    os.umask(PRIVATE_UMASK)  # checkpoints, snapshots, CSV rows, metrics files: the run's user's only
    raise_open_files_limit()
    run_dir = Path(args.run_dir)
    check_own_dir(run_dir, "not this user's run directory (swapped?); start runs with `rlpipe launch`")
    exit_with_supervisord(run_dir, f"{service}{args.instance}")  # no orphans of a killed supervisord
    # Before anything of the instance's is touched (its heartbeat file, endpoint, segments, table):
    # a second process of it (started by hand, or by a supervisord beside orphans) exits here.
    _lock = lock_service(run_dir, service, args.instance)
    if socket_dir(run_dir).is_dir():  # made by the launch on this host (a Ray node may have none: no watchdog there)
        heartbeat.start(socket_dir(run_dir) / heartbeat.DIR / f"{service}{args.instance}")  # no beat yet: start-up grace
    # The launch checked the env; a service that steps one builds it, and one that does not (the
    # replay, the metrics endpoint) need not import its family (MinAtar's costs ~1.5 s).
    exp = loading.load(run_dir / RUN_CONFIG, check_env=False)
    if exp.network.transport == "tcp":
        from shared.transport import auth
        from shared.transport import sockets

        # Every tcp socket of this process speaks CURVE; only services that bind hold the server's secret key.
        sockets.use_curve(auth.read_curve_keys(run_dir, server=service in auth.CURVE_SERVERS))
    return exp, run_dir, args.instance


def serve(service: str, run: Callable[[schema.Experiment, Path, int], None]) -> NoReturn:
    """A service's process: ``run(exp, run_dir, instance)``, then exit at once.

    The exit skips the interpreter's teardown of its modules (torch's alone takes up to a
    second, which every `rlpipe stop` would wait for): by then ``run``'s finally blocks have
    closed its sockets, and the segments it still owns are unlinked here. A SIGTERM
    (SystemExit) exits with its code; a ConfigError, or a segment /dev/shm cannot hold
    (``shm.NoSpace``: the run must be smaller or the machine's /dev/shm larger), is one
    ``config error: ...`` line and exits 2; any other exception is logged and exits 1.
    """
    code = 0
    try:
        run(*start_service(service))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except (schema.ConfigError, shm.NoSpace) as e:  # one line the launcher shows as it is (follow.wait_until_built)
        print(f"{CONFIG_ERROR}{e}", file=sys.stderr)
        code = 2
    except BaseException:  # noqa: BLE001 - reported, then the process ends as it would have
        traceback.print_exc()
        code = 1
    finally:
        shm.unlink_all_owned()
        with contextlib.suppress(OSError):  # a log pipe whose reader is gone (a killed supervisord)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
