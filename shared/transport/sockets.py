"""ZeroMQ socket helpers: bounded waits, explicit linger, reconnect, bad-input tolerance.

Every receive goes through ``poll`` with a timeout (ARCHITECTURE rule 4). A message that
fails ``wire.unpack`` is logged with its reason, counted, and dropped; the caller keeps
serving. ``Endpoint.serve`` does the same for whatever a handler raises on one message
(ARCHITECTURE rule 5). DEALER clients follow the "Lazy Pirate" habit of jupyter_client: on
a timeout they close the socket (linger 0) and open a fresh one, so a restarted peer is
found again.

Routing ids: a DEALER's ZeroMQ identity is its name plus a random token chosen once per
process and kept across reconnects. A ROUTER with ``ROUTER_HANDOVER`` hands a route to
whoever connects with a known identity; with a guessable identity (``sampler0``) any
local process could take a sampler's route, with an unguessable one only the sampler can.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator

from shared.transport import shm, wire

LINGER_MS = 0  # nothing queued for a dead peer is worth blocking shutdown for
# A TCP peer that has not finished its handshake within this is dropped (libzmq's default is
# 30 s): idle or keyless connections hold a file descriptor of the binding service only so long.
HANDSHAKE_IVL_MS = 5000
ERROR_REPLY_CHARS = 400
DRAIN_MOST = 1000
"""The most messages one ``drain`` takes: ZeroMQ's default receive high-water mark, what one peer
can have queued. Peers that send as fast as they are served cannot keep a service's loop (its
heartbeat, its other work) from turning."""
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CurveKeys:
    """The CURVE keys one process of a run holds (z85 bytes); see shared/transport/auth.py.
    ``server_secret`` and ``clients_dir`` (the public keys the ZAP handler admits) only in
    processes that bind."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes
    server_secret: bytes | None = None
    clients_dir: Path | None = None


_curve: CurveKeys | None = None


def use_curve(keys: CurveKeys | None) -> None:
    """Make every tcp:// socket this process opens from now on speak CURVE with ``keys``
    (called once at service start for TCP runs); None turns it off."""
    global _curve
    _curve = keys


class Rejected(ValueError):
    """A message a handler will not act on. ``reason`` is the metric label (auth, descriptor,
    value, state); str() says what was wrong and, where there is one, the fix."""

    def __init__(self, reason: str, text: str):
        super().__init__(text)
        self.reason = reason


def open_socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool, identity: bytes | None = None,
                subscribe: bytes = b"") -> zmq.Socket:
    """``subscribe``: a SUB socket's topic (``wire.topic``; everything by default)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    # ZeroMQ checks this per frame as it decodes, and drops a peer that sends more than wire accepts.
    sock.setsockopt(zmq.MAXMSGSIZE, max(wire.MAX_HEADER_BYTES, wire.MAX_FRAME_BYTES))
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # drop replies to vanished peers silently
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a peer reconnecting with its (unguessable) identity gets its route back
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, subscribe)
    if endpoint.startswith("tcp://"):
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    if _curve is not None and endpoint.startswith("tcp://"):
        if bind:
            if id(ctx) not in _zap:
                sock.close(linger=0)
                raise RuntimeError(f"{endpoint}: a CURVE server socket needs its context's ZAP handler (Endpoint starts it)")
            sock.curve_server = True
            sock.curve_secretkey = _curve.server_secret
        else:
            sock.curve_serverkey = _curve.server_public
            sock.curve_publickey, sock.curve_secretkey = _curve.client_public, _curve.client_secret
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


# The ZAP handler of each context that has bound CURVE sockets: id(ctx) -> [authenticator, users].
_zap: dict[int, list] = {}
_zap_lock = threading.Lock()


def _zap_acquire(ctx: zmq.Context) -> None:
    """Start ``ctx``'s ZAP handler (once a context), admitting only the run's client keys.

    It must answer before the first server socket binds: with no handler bound, libzmq lets
    every CURVE client that knows the server's public key in."""
    if _curve.clients_dir is None:
        raise RuntimeError("this process holds no CURVE server key, so binds no TCP socket "
                           "(shared.transport.auth.CURVE_SERVERS)")
    with _zap_lock:
        entry = _zap.get(id(ctx))
        if entry is None:
            auth = ThreadAuthenticator(ctx, log=logging.getLogger("rlpipe.zap"))
            auth.start()
            auth.configure_curve(domain="*", location=str(_curve.clients_dir))
            if not auth.certs.get("*"):
                auth.stop()
                raise RuntimeError(f"{_curve.clients_dir}: no client public key (*.key) to admit; recreate the run")
            entry = _zap[id(ctx)] = [auth, 0]
        entry[1] += 1


def _zap_release(ctx: zmq.Context) -> None:
    """Stop ``ctx``'s ZAP handler with its last server socket (``ctx.term()`` waits for its sockets)."""
    with _zap_lock:
        entry = _zap.get(id(ctx))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _zap[id(ctx)]
            entry[0].stop()


class Endpoint:
    """One socket speaking the wire protocol: sequence numbers out, validation in.

    ``on_bad(reason)`` is called for every rejected message with a short label (wire, auth,
    descriptor, value, state, internal) for a metric; the message is dropped and the
    endpoint keeps working.
    """

    def __init__(self, ctx: zmq.Context, kind: int, address: str, bind: bool, name: str,
                 on_bad: Callable[[str], None] | None = None, subscribe: bytes = b""):
        self.ctx, self.kind, self.address, self.bind, self.name = ctx, kind, address, bind, name
        self.subscribe = subscribe
        self.on_bad = on_bad or (lambda reason: None)
        self.seq = 0
        self.identity = f"{name}.{secrets.token_hex(8)}".encode() if kind == zmq.DEALER else None
        self._internal_seen: set[str] = set()
        self._zap = bind and _curve is not None and address.startswith("tcp://")
        if self._zap:
            _zap_acquire(ctx)
        try:
            self.sock = open_socket(ctx, kind, address, bind, identity=self.identity, subscribe=subscribe)
        except BaseException:
            self._release_zap()
            raise

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
                log.warning("%s: rejected a message from %s: %s", self.name, _who(peer), e)
                self.on_bad("wire")
                if peer is not None:
                    self.send("error", {"reason": f"bad message: {e}"[:ERROR_REPLY_CHARS]}, to=peer)
                if time.monotonic() >= deadline:
                    return None

    def serve(self, handler: Callable[[bytes | None, wire.Message], None], peer: bytes | None,
              msg: wire.Message) -> None:
        """Run ``handler(peer, msg)`` so that no single message can end the service.

        Whatever it raises is logged with the peer and the reason (with a traceback the first
        time an unexpected exception type appears), counted through ``on_bad``, and answered
        with an ``error`` where the peer can be replied to (ROUTER); but ``shm.NoSpace`` (a
        segment /dev/shm cannot hold) ends the service with its one line.
        """
        try:
            handler(peer, msg)
            return
        except Rejected as e:
            reason, text = e.reason, str(e)
            log.warning("%s: %s from %s rejected: %s", self.name, msg.type, _who(peer), text)
        except shm.NoSpace:  # no message can be served without the memory: the service ends, saying why
            raise
        except Exception as e:  # a bug or a value nobody foresaw: this message fails, the service goes on
            reason, text = "internal", f"{type(e).__name__}: {e}"
            first = type(e).__name__ not in self._internal_seen
            self._internal_seen.add(type(e).__name__)
            log.error("%s: %s from %s failed: %s", self.name, msg.type, _who(peer), text, exc_info=first)
        self.reject(peer, msg.type, reason, text, seq=msg.seq)

    def reject(self, peer: bytes | None, mtype: str, reason: str, text: str, seq: int | None = None) -> None:
        """Count a message that is not acted on (``on_bad(reason)``) and answer its peer with an
        error. The error carries ``why`` (``reason``: "value" means the message itself is wrong,
        "state" that the peer must say hello first...) and ``seq``, the refused message's
        sequence number: a peer with several messages out tells by it which one was refused."""
        self.on_bad(reason)
        if peer is not None:
            body = {"reason": f"{mtype}: {text}"[:ERROR_REPLY_CHARS], "why": reason}
            if seq is not None:
                body["seq"] = seq
            self.send("error", body, to=peer)

    def drain(self, most: int = DRAIN_MOST) -> list[tuple[bytes | None, wire.Message]]:
        """The valid messages already waiting, at most ``most``, without blocking (the rest stay
        queued for the next call)."""
        out = []
        while len(out) < most:
            item = self.recv(0)
            if item is None:
                break
            out.append(item)
        return out

    def reconnect(self) -> None:
        """Lazy Pirate: drop the socket and whatever it had queued; open a fresh one."""
        self.sock.close(linger=0)
        self.sock = open_socket(self.ctx, self.kind, self.address, self.bind, identity=self.identity,
                                subscribe=self.subscribe)

    def close(self) -> None:
        self.sock.close(linger=LINGER_MS)
        self._release_zap()

    def _release_zap(self) -> None:
        if self._zap:
            self._zap = False
            _zap_release(self.ctx)


def _who(peer: bytes | None) -> str:
    return peer.decode(errors="replace") if peer else "peer"
