"""What every service process does first: arguments, logging, signals, config, device."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

import torch

from shared import config as config_mod

RUN_CONFIG = "config.toml"


def service_args(service: str, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m services.{service}", description=f"rlpipe {service} service")
    p.add_argument("--run-dir", required=True, help="the run directory made by `rlpipe launch`")
    p.add_argument("--instance", type=int, default=0, help="index of this process among its service's processes")
    return p.parse_args(argv)


def start_service(service: str, argv=None) -> tuple[config_mod.Experiment, Path, int]:
    """Parse args, set up logging and signals, read the run's resolved config."""
    args = service_args(service, argv)
    setup_logging(f"{service}{args.instance}")
    install_signal_handlers()
    # One thread per process: the pipeline already runs one process per core's worth of work.
    torch.set_num_threads(1)
    run_dir = Path(args.run_dir)
    exp = config_mod.load(run_dir / RUN_CONFIG)
    if exp.network.transport == "tcp":
        from shared import auth, sockets

        sockets.use_curve(auth.read_curve_keys(run_dir))  # every tcp socket of this process speaks CURVE
    return exp, run_dir, args.instance


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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def run_id_of(run_dir: Path) -> str:
    """The run id is the run directory's name (letters, digits, '_' and '.')."""
    return Path(run_dir).resolve().name
