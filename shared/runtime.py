"""What every service process does first: arguments, logging, signals, config; torch only where used.

This module does not import torch: replay, metrics and samplers in server mode never load
it (it costs ~2 s of CPU at start-up). Services that run a network call ``torch_device``.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Callable, NoReturn

from shared import config as config_mod
from shared import shm

RUN_CONFIG = "config.toml"
CONFIG_ERROR = "config error: "  # how a service's log says its config cannot work (then it exits 2)
TB_DIR = "tb"
"""The run directory's TensorBoard folder: the learner's event files (progress scalars and
algorithm diagnostics against env steps); other services add theirs beside them with their own writers."""


def service_args(service: str, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m services.{service}", description=f"rlpipe {service} service")
    p.add_argument("--run-dir", required=True, help="the run directory made by `rlpipe launch`")
    p.add_argument("--instance", type=int, default=0, help="index of this process among its service's processes")
    return p.parse_args(argv)


def start_service(service: str, argv=None) -> tuple[config_mod.Experiment, Path, int]:
    """Parse args, set up logging and signals, one BLAS thread (``torch_device``), read the
    run's resolved config."""
    from threadpoolctl import threadpool_limits

    args = service_args(service, argv)
    setup_logging(f"{service}{args.instance}")
    install_signal_handlers()
    threadpool_limits(1, user_api="blas")  # torch-free services too: a numpy acting step is numpy's BLAS
    run_dir = Path(args.run_dir)
    exp = config_mod.load(run_dir / RUN_CONFIG)
    if exp.network.transport == "tcp":
        from shared import auth, sockets

        sockets.use_curve(auth.read_curve_keys(run_dir))  # every tcp socket of this process speaks CURVE
    return exp, run_dir, args.instance


def serve(service: str, run: Callable[[config_mod.Experiment, Path, int], None]) -> NoReturn:
    """A service's process: ``run(exp, run_dir, instance)``, then exit at once.

    The exit skips the interpreter's teardown of its modules (torch's alone takes up to a
    second, which every `rlpipe stop` would wait for): by then ``run``'s finally blocks have
    closed its sockets, and the segments it still owns are unlinked here. A SIGTERM
    (SystemExit) exits with its code; a ConfigError is one ``config error: ...`` line and
    exits 2; any other exception is logged and exits 1.
    """
    code = 0
    try:
        run(*start_service(service))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except config_mod.ConfigError as e:  # one line the launcher shows as it is (launch.wait_until_built)
        print(f"{CONFIG_ERROR}{e}", file=sys.stderr)
        code = 2
    except BaseException:  # noqa: BLE001 - reported, then the process ends as it would have
        traceback.print_exc()
        code = 1
    finally:
        shm.unlink_all_owned()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=os.environ.get("RLPIPE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def install_signal_handlers() -> None:
    """SIGTERM/SIGINT raise SystemExit so that finally blocks and atexit unlink segments."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def torch_device(name: str, threads: int = 1):
    """Import torch, set its and numpy's BLAS intra-op threads and resolve ``run.device``
    (auto: cuda if present).

    One thread by default: the pipeline already runs one process per core's worth of work, and
    a second thread spinning for a core that another process holds slows a step down 20-100x
    (measured here: a 256x256 numpy acting step took 7.8 ms with OpenBLAS's 2 threads, 0.09 ms
    with one; a DQN update 58-113 ms with 2 torch threads, 3 ms with one).
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


def run_id_of(run_dir: Path) -> str:
    """The run id is the run directory's name (letters, digits, '_' and '.')."""
    return Path(run_dir).resolve().name


def append_csv(path: Path, fields: list[str], row: dict) -> None:
    """Append ``row`` to the CSV file ``path`` (columns ``fields``), header first if the file is new.

    One process appends to each of a run's CSV files (progress.csv: the learner; eval.csv: the
    evaluator), so rows never interleave."""
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fields)
        if new:
            writer.writeheader()
        writer.writerow(row)
