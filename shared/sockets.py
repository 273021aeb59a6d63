"""ZeroMQ socket helpers: bounded waits, explicit linger, reconnect, bad-input tolerance.

Every receive goes through ``poll`` with a timeout (ARCHITECTURE rule 4). A message that
fails ``wire.unpack`` is logged with its reason, counted, and dropped; the caller keeps
serving. DEALER clients follow the "Lazy Pirate" habit of jupyter_client: on a timeout
they close the socket (linger 0) and open a fresh one, so a restarted peer is found again.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import zmq

from shared import wire

LINGER_MS = 0  # nothing queued for a dead peer is worth blocking shutdown for
log = logging.getLogger(__name__)


def open_socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # drop replies to vanished peers silently
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer with the same name takes over
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


class Endpoint:
    """One socket speaking the wire protocol: sequence numbers out, validation in.

    ``on_bad(reason)`` is called for every rejected message (for a metric); the message is
    dropped and the endpoint keeps working.
    """

    def __init__(self, ctx: zmq.Context, kind: int, address: str, bind: bool, name: str,
                 on_bad: Callable[[str], None] | None = None):
        self.ctx, self.kind, self.address, self.bind, self.name = ctx, kind, address, bind, name
        self.on_bad = on_bad or (lambda reason: None)
        self.seq = 0
        self.sock = open_socket(ctx, kind, address, bind, identity=name.encode() if kind == zmq.DEALER else None)

    def send(self, mtype: str, body: dict, arrays: list | None = None, to: bytes | None = None) -> None:
        self.seq += 1
        frames = wire.pack(mtype, body, self.name, self.seq, arrays)
        if to is not None:
            frames = [to] + frames
        try:
            self.sock.send_multipart(frames, copy=len(frames) < 3, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("%s: send of %s dropped (peer queue full or gone)", self.name, mtype)

    def recv(self, timeout_ms: float) -> tuple[bytes | None, wire.Message] | None:
        """Wait at most ``timeout_ms`` for one valid message: (peer identity or None, msg)."""
        deadline = time.monotonic() + timeout_ms / 1000.0
        while True:
            remaining = max(0, int((deadline - time.monotonic()) * 1000))
            if not self.sock.poll(remaining, zmq.POLLIN):
                return None
            frames = self.sock.recv_multipart(copy=False)
            peer = None
            if self.kind == zmq.ROUTER:
                peer, frames = frames[0].bytes, frames[1:]
            try:
                return peer, wire.unpack(frames)
            except wire.WireError as e:
                who = peer.decode(errors="replace") if peer else "peer"
                log.warning("%s: rejected a message from %s: %s", self.name, who, e)
                self.on_bad(str(e))
                if time.monotonic() >= deadline:
                    return None

    def drain(self) -> list[tuple[bytes | None, wire.Message]]:
        """Every valid message already waiting, without blocking."""
        out = []
        while True:
            item = self.recv(0)
            if item is None:
                return out
            out.append(item)

    def reconnect(self) -> None:
        """Lazy Pirate: drop the socket and whatever it had queued; open a fresh one."""
        self.sock.close(linger=0)
        self.sock = open_socket(self.ctx, self.kind, self.address, self.bind,
                                identity=self.name.encode() if self.kind == zmq.DEALER else None)

    def close(self) -> None:
        self.sock.close(linger=LINGER_MS)
