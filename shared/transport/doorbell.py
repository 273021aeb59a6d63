"""The per-step handshake between a sampler and its action-server, without a socket round trip.

The observations and actions already live in the sampler's step slots (shared memory);
what remains per step is "slot s holds step n, act on it" and "the actions of slot s,
step n, are in, from policy version v". Each sampler owns two FIFOs (named pipes) in
the run's private socket directory:

- ``<name>.req``: the sampler rings with ``REQUEST`` records (slot, step);
- ``<name>.rep``: the action-server answers with ``REPLY`` records (slot, step, version)
  once it has written that slot's actions.

A record is one ``write(2)`` of at most PIPE_BUF bytes, which POSIX makes atomic, and the
kernel wakes the peer blocked in ``poll`` directly: one syscall to ring, one to read, no
I/O thread, no framing. ZeroMQ keeps the control plane (hello/welcome, errors, reconnect).

A dead peer is seen by the kernel, not by a timer: when the last writer of a FIFO is gone
its reader polls readable and reads end-of-file, and a writer whose reader is gone gets
EPIPE. So a sampler killed with ``kill -9`` is noticed at the action-server's next poll,
and a dead action-server at the sampler's next ring or wait (``PeerGone``). A peer that
hangs without dying is still caught by the timeouts of the callers.
"""

from __future__ import annotations

import errno
import os
import select
import stat
import struct
import time
from pathlib import Path

REQUEST = struct.Struct("<II")  # slot, step (mod 2**32)
REPLY = struct.Struct("<IIq")  # slot, step (mod 2**32), policy version
STEP_MOD = 1 << 32
_READ_BYTES = 1 << 16


class PeerGone(ConnectionError):
    """The other end of a doorbell closed (its process exited or was killed)."""


def paths(directory: Path, name: str) -> tuple[Path, Path]:
    """The request and reply FIFOs of sampler ``name`` in ``directory``."""
    return Path(directory) / f"{name}.req", Path(directory) / f"{name}.rep"


def _open_fifo(path: Path, flags: int) -> int:
    """Open a FIFO we own, not following links; PeerGone if it is absent or has no reader."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PeerGone(f"doorbell {path} does not exist") from None
    except OSError as e:
        if e.errno == errno.ENXIO:  # O_WRONLY and nobody reads it (yet, or any more)
            raise PeerGone(f"nobody listens on doorbell {path}") from None
        if e.errno == errno.ELOOP:
            raise PeerGone(f"doorbell {path} is a symbolic link: refused") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise PeerGone(f"doorbell {path} is not a FIFO of this user: refused")
    return fd


class _Records:
    """Fixed-size records read from a non-blocking FIFO (atomic writes keep them whole)."""

    def __init__(self, fd: int, record: struct.Struct):
        self.fd, self.record, self.rest = fd, record, b""

    def read(self) -> list[tuple]:
        """Every record waiting now ([] if none); PeerGone at end-of-file (no writer left)."""
        try:
            data = os.read(self.fd, _READ_BYTES)
        except BlockingIOError:
            return []
        if not data:
            raise PeerGone("the other end of the doorbell closed")
        data = self.rest + data
        cut = len(data) - len(data) % self.record.size
        self.rest = data[cut:]
        return [self.record.unpack_from(data, i) for i in range(0, cut, self.record.size)]


def _write(fd: int, payload: bytes) -> None:
    try:
        os.write(fd, payload)
    except BrokenPipeError:
        raise PeerGone("the other end of the doorbell closed") from None
    except BlockingIOError:  # a full pipe: the peer stopped reading long ago
        raise PeerGone("the doorbell's pipe is full: the peer stopped reading") from None


class SamplerBell:
    """The sampler's end: owns (creates and removes) both FIFOs.

    Call ``connect()`` after the action-server welcomed us (it has opened its ends by then).
    """

    def __init__(self, directory: Path, name: str):
        self.req_path, self.rep_path = paths(directory, name)
        for path in (self.req_path, self.rep_path):
            if path.is_symlink() or path.exists():
                path.unlink()  # left by a crashed predecessor of ours
            os.mkfifo(path, 0o600)
        self.rep_fd = _open_fifo(self.rep_path, os.O_RDONLY)
        self.replies = _Records(self.rep_fd, REPLY)
        self.req_fd: int | None = None
        self.poller = select.poll()
        self.poller.register(self.rep_fd, select.POLLIN)

    def connect(self) -> None:
        self.disconnect()
        self.req_fd = _open_fifo(self.req_path, os.O_WRONLY)

    def disconnect(self) -> None:
        if self.req_fd is not None:
            os.close(self.req_fd)
            self.req_fd = None

    def ring(self, slot: int, step: int) -> None:
        if self.req_fd is None:
            raise PeerGone("not connected")
        _write(self.req_fd, REQUEST.pack(slot, step % STEP_MOD))

    def wait(self, timeout_ms: float) -> list[tuple[int, int, int]]:
        """Replies (slot, step mod 2**32, version) that arrive within ``timeout_ms`` ([] on timeout)."""
        deadline = time.monotonic() + timeout_ms / 1000.0
        while self.poller.poll(max(0.0, (deadline - time.monotonic()) * 1000.0)):
            got = self.replies.read()
            if got or time.monotonic() >= deadline:  # [] after a wake-up without a whole record: wait on
                return got
        return []

    def close(self) -> None:
        self.disconnect()
        os.close(self.rep_fd)
        for path in (self.req_path, self.rep_path):
            try:
                path.unlink()
            except FileNotFoundError:
                pass


class ServerBell:
    """The action-server's end for one attached sampler; ``fileno()`` is what to poll for requests."""

    def __init__(self, directory: Path, name: str):
        req_path, rep_path = paths(directory, name)
        self.req_fd = _open_fifo(req_path, os.O_RDONLY)
        try:
            self.rep_fd = _open_fifo(rep_path, os.O_WRONLY)
        except BaseException:
            os.close(self.req_fd)
            raise
        self.requests = _Records(self.req_fd, REQUEST)

    def fileno(self) -> int:
        return self.req_fd

    def read(self) -> list[tuple[int, int]]:
        """Requests (slot, step mod 2**32) waiting now; PeerGone once the sampler is gone."""
        return self.requests.read()

    def reply(self, slot: int, step: int, version: int) -> None:
        _write(self.rep_fd, REPLY.pack(slot, step % STEP_MOD, version))

    def close(self) -> None:
        for fd in (self.req_fd, self.rep_fd):
            os.close(fd)
