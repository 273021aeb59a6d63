"""Who belongs to a run: the per-run secret that every hello carries, and over TCP the
run's CURVE key pair.

``rlpipe launch`` writes ``<run dir>/secret`` (32 random bytes as hex, mode 0600) before
any service starts; every service reads it at start and every hello carries it. A hello
without the run's secret is rejected, so a process of another run, or another user's
process that can reach a TCP port, cannot attach descriptors, replace the learner or take
a sampler's role. Only a process that can read the run directory as the run's user can
say hello (ARCHITECTURE rule 5; docs/architecture.md, threat model).

Over TCP (``network.transport = "tcp"``) every socket also speaks ZeroMQ CURVE: launch
writes the run's server key pair into ``<run dir>/curve/`` and its client key pair into
``<run dir>/curve/clients/`` (directories 0700, secret keys 0600). Bound sockets are CURVE
servers with the server's secret key, and their context's ZAP handler (pyzmq's
``ThreadAuthenticator``, ``sockets.open_socket``) admits only the public keys in
``curve/clients/``; connecting sockets are CURVE clients with the run's client key pair and
the server's *public* key. Only services that bind (``CURVE_SERVERS``) load the server's
secret key. The server's public key is not a password: a client that holds it but not the
run's client secret key completes no handshake, so it sends and receives nothing, and
nothing travels in clear text.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

import zmq
import zmq.auth

from shared.runtime import runfiles
from shared.transport.sockets import CurveKeys, Rejected

CURVE_SERVERS = ("replay", "learner", "action_server")  # the services that bind a socket, so hold the server secret


def write_secret(run_dir: Path) -> None:
    """Create the run's secret file (once; mode 0600, never through a symlink)."""
    fd = os.open(Path(run_dir) / runfiles.SECRET_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def read_secret(run_dir: Path) -> str:
    """The run's secret; PermissionError naming the fix if the file is not private to us."""
    path = Path(run_dir) / runfiles.SECRET_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: start runs with `rlpipe launch` (or `rlpipe prepare`)") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(f"{path} must be a regular file of uid {os.getuid()} with mode 0600 "
                                  f"(is {stat.filemode(st.st_mode)}, uid {st.st_uid}); recreate the run")
        return f.read().strip()


def check_secret(body: dict, secret: str) -> None:
    """Raise Rejected("auth") unless the hello ``body`` carries the run's secret."""
    if not hmac.compare_digest(body["secret"].encode(), secret.encode()):
        raise Rejected("auth", "wrong run secret: this peer is not part of the run (another run's process, or one "
                       "started by hand without the run directory's secret file)")


def write_curve_keys(run_dir: Path) -> None:
    """Create the run's CURVE server and client key pairs in ``<run dir>/curve/`` and
    ``curve/clients/`` (directories 0700, secret key files 0600)."""
    keys = Path(run_dir) / runfiles.CURVE_DIR
    keys.mkdir(mode=0o700)
    (keys / runfiles.CLIENTS_DIR).mkdir(mode=0o700)
    for directory, name in ((keys, "server"), (keys / runfiles.CLIENTS_DIR, "client")):
        _, secret_file = zmq.auth.create_certificates(directory, name)
        os.chmod(secret_file, 0o600)


def read_curve_keys(run_dir: Path, server: bool) -> CurveKeys:
    """The keys a process of the run holds: the server's public key and the run's client key
    pair, and with ``server`` (a service that binds: ``CURVE_SERVERS``) the server's secret key
    and the directory of client keys its ZAP handler admits."""
    keys = Path(run_dir) / runfiles.CURVE_DIR
    server_public, server_secret = _load(keys / ("server.key_secret" if server else "server.key"))
    client_public, client_secret = _load(keys / runfiles.CLIENTS_DIR / "client.key_secret")
    return CurveKeys(server_public=server_public, client_public=client_public, client_secret=client_secret,
                     server_secret=server_secret if server else None, clients_dir=keys / runfiles.CLIENTS_DIR if server else None)


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"{path}: no CURVE keys for this TCP run ({e}); start runs with `rlpipe launch`") from None
