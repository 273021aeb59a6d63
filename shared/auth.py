"""Who belongs to a run: the per-run secret that every hello carries.

``rlpipe launch`` writes ``<run dir>/secret`` (32 random bytes as hex, mode 0600) before
any service starts; every service reads it at start and every hello carries it. A hello
without the run's secret is rejected, so a process of another run, or another user's
process that can reach a TCP port, cannot attach descriptors, replace the learner or take
a sampler's role. Only a process that can read the run directory as the run's user can
say hello (ARCHITECTURE rule 5; docs/architecture.md, threat model).
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

from shared.sockets import Rejected

SECRET_FILE = "secret"


def write_secret(run_dir: Path) -> None:
    """Create the run's secret file (once; mode 0600, never through a symlink)."""
    fd = os.open(Path(run_dir) / SECRET_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def read_secret(run_dir: Path) -> str:
    """The run's secret; PermissionError naming the fix if the file is not private to us."""
    path = Path(run_dir) / SECRET_FILE
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
