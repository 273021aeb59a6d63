"""The sampler's links: to its action-server (DEALER + doorbell) and to replay (DEALER).

Both follow the Lazy Pirate habit: a reply that does not come within ``timeout_ms`` makes
the sampler drop the socket, open a new one, say hello again (the peer may have restarted
and forgotten it) and resend whatever was outstanding. Replay deduplicates resent
segments by their serial number.
"""

from __future__ import annotations

import logging
import time

import zmq

from shared.transport.doorbell import STEP_MOD, PeerGone, SamplerBell
from shared.runtime.metrics import bad_message_counter
from shared.data.namedarraytuple import leaves
from shared.transport.sockets import Endpoint

log = logging.getLogger(__name__)
HELLO_BACKOFF_S = 1.0


class RemoteActions:
    """ActionSource served by one action-server: hello over a DEALER socket, then the doorbell.

    Each step rings the action-server's doorbell (``shared.transport.doorbell``) and waits for its
    answer there: no socket round trip per step. A doorbell that closes (the action-server
    died) or stays silent for ``timeout_ms`` makes the sampler say hello again on a fresh
    socket and ring again for what was outstanding.
    """

    def __init__(self, ctx: zmq.Context, address: str, name: str, instance: int, slot_descriptors: list,
                 bell_dir, timeout_ms: int, metrics, incarnation: int, secret: str):
        self.ep = Endpoint(ctx, zmq.DEALER, address, bind=False, name=name, on_bad=bad_message_counter(metrics))
        self.bell = SamplerBell(bell_dir, name)
        self.hello = {"instance": instance, "slots": slot_descriptors, "incarnation": incarnation, "secret": secret}
        self.timeout_ms, self.metrics = timeout_ms, metrics
        self.step = [0] * len(slot_descriptors)
        self.outstanding: set[int] = set()
        self.ready: dict[int, int] = {}  # group -> version of a reply not yet waited for
        self._hello()

    def _hello(self) -> None:
        """Say hello until an action-server welcomes us and its end of the doorbell is open."""
        while True:
            self.ep.send("hello_actor", self.hello)
            reply = self.ep.recv(self.timeout_ms)
            if reply is not None and reply[1].type == "welcome":
                try:
                    self.bell.connect()
                    return
                except PeerGone as e:
                    log.warning("action-server at %s welcomed us but %s", self.ep.address, e)
            elif reply is not None and reply[1].type == "error":
                log.warning("action-server at %s refused our hello: %s", self.ep.address, reply[1].body["reason"])
                time.sleep(HELLO_BACKOFF_S)  # a refusal comes at once: do not spin on it
            else:
                log.warning("action-server at %s did not welcome us within %d ms; retrying", self.ep.address,
                            self.timeout_ms)
            self._reconnect()

    def _reconnect(self) -> None:
        self.metrics.reconnects.labels(peer="action_server").inc()
        self.bell.disconnect()
        self.ep.reconnect()

    def request(self, group: int) -> None:
        self.step[group] += 1
        self.outstanding.add(group)
        try:
            self.bell.ring(group, self.step[group])
        except PeerGone as e:
            log.warning("action-server gone (%s); saying hello again", e)
            self._recover()

    def wait(self, group: int) -> int:
        t0 = time.perf_counter()
        while group not in self.ready:
            try:
                replies = self.bell.wait(self.timeout_ms)
            except PeerGone as e:
                log.warning("action-server gone (%s); saying hello again", e)
                self._recover()
                continue
            if not replies:
                log.warning("no actions from %s within %d ms; saying hello again", self.ep.address, self.timeout_ms)
                self._recover()
            for slot, step, version in replies:
                if slot in self.outstanding and step == self.step[slot] % STEP_MOD:
                    self.outstanding.discard(slot)
                    self.ready[slot] = version
        self.metrics.wait.labels(on="actions").inc(time.perf_counter() - t0)
        return self.ready.pop(group)

    def _recover(self) -> None:
        """New socket, hello, and ring again for every outstanding group (the slots still hold their observations)."""
        while True:
            self._reconnect()
            self._hello()
            try:
                for g in sorted(self.outstanding):
                    self.bell.ring(g, self.step[g])
                return
            except PeerGone as e:
                log.warning("action-server gone again (%s)", e)

    def close(self) -> None:
        self.ep.close()
        self.bell.close()


class RemoteSink:
    """SegmentSink over a DEALER socket to replay. With ``frames`` (the sampler's segment ring;
    replay runs on another node) each announcement carries the segment's arrays as zero-copy
    frames; the ring slot stays untouched until replay releases it, as on one node."""

    def __init__(self, ctx: zmq.Context, address: str, name: str, instance: int, ring_descriptor: dict,
                 incarnation: int, ring: int, timeout_ms: int, metrics, secret: str, frames=None):
        self.ep = Endpoint(ctx, zmq.DEALER, address, bind=False, name=name, on_bad=bad_message_counter(metrics))
        self.frames = frames
        self.hello = {"instance": instance, "ring": ring_descriptor, "incarnation": incarnation, "secret": secret}
        self.timeout_ms, self.metrics = timeout_ms, metrics
        self.in_flight: dict[int, dict] = {}  # ring index -> announcement not yet released
        self.ep.send("hello_writer", self.hello)

    def announce(self, index: int, meta: dict) -> None:
        body = {"index": index, **meta}
        self.in_flight[index] = body
        self._send(body)
        self._take_releases(0)

    def _send(self, body: dict) -> None:
        arrays = None if self.frames is None else [leaf for _, leaf in leaves(self.frames[body["index"]])]
        self.ep.send("segment", body, arrays=arrays)

    def acquire(self, index: int) -> None:
        t0 = time.perf_counter()
        while index in self.in_flight:
            if not self._take_releases(self.timeout_ms):
                log.warning("replay at %s released nothing within %d ms; reconnecting", self.ep.address, self.timeout_ms)
                self.metrics.reconnects.labels(peer="replay").inc()
                self.ep.reconnect()
                self.ep.send("hello_writer", self.hello)
                for body in sorted(self.in_flight.values(), key=lambda b: b["serial"]):
                    self._send(body)
        self.metrics.wait.labels(on="replay").inc(time.perf_counter() - t0)

    def _take_releases(self, timeout_ms: float) -> bool:
        """Apply every release that arrives within ``timeout_ms``; True if any did."""
        got = False
        reply = self.ep.recv(timeout_ms)
        while reply is not None:
            msg = reply[1]
            if msg.type == "release":
                self.in_flight.pop(msg.body["index"], None)
                got = True
            reply = self.ep.recv(0)
        return got

    def close(self) -> None:
        self.ep.close()
