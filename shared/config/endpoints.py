"""Where a run's sockets are: ipc paths in a private directory, or tcp ports from a base.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from shared.config.schema import Experiment, most_count


def port_free(host: str, port: int) -> bool:
    """Whether our services could bind ``host:port``. With SO_REUSEADDR, as they bind (the metrics
    endpoint's HTTPServer, ZeroMQ): a port that a stopped run's connections hold in TIME_WAIT
    (a scrape of its metrics, say) is free to them, one a process listens on is not."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def tcp_offsets(exp: Experiment) -> dict[str, int]:
    """Port offsets from base_port of every bound socket."""
    offsets = {"replay": 0, "params": 1}
    for i in range(most_count(exp.action_server)):
        offsets[f"action_server{i}"] = 2 + i
    return offsets


def endpoint(exp: Experiment, run_dir: Path, name: str) -> str:
    """The address of bound socket ``name`` (replay, params, action_server<i>)."""
    if exp.network.transport == "tcp":
        return f"tcp://{exp.network.host}:{exp.network.base_port + tcp_offsets(exp)[name]}"
    return f"ipc://{socket_dir(run_dir) / name}"


def socket_base() -> Path:
    """The per-user parent of the runs' socket directories: $XDG_RUNTIME_DIR/rlpipe (a
    directory only the user can enter, per the XDG spec) or else <tmp>/rlpipe-<uid>;
    ``launch.make_private_dir`` makes it 0700 and refuses one another user owns."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "rlpipe"
    return Path(tempfile.gettempdir()) / f"rlpipe-{os.getuid()}"


def socket_dir(run_dir: Path) -> Path:
    """Where a run's unix sockets live: <socket_base()>/<run id>.

    Not inside the run directory: unix socket paths are limited to 107 bytes, which a run
    directory deep in a project tree exceeds.
    """
    return socket_base() / Path(run_dir).resolve().name
