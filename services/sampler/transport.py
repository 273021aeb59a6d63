"""The sampler's sockets: to its action-server (DEALER) and to replay (DEALER).

Both follow the Lazy Pirate habit: a reply that does not come within ``timeout_ms`` makes
the sampler drop the socket, open a new one, say hello again (the peer may have restarted
and forgotten it) and resend whatever was outstanding. Replay deduplicates resent
segments by their serial number.
"""

from __future__ import annotations

import logging
import time

import zmq

from shared.metrics import bad_message_counter
from shared.sockets import Endpoint

log = logging.getLogger(__name__)


class RemoteActions:
    """ActionSource over a DEALER socket to one action-server."""

    def __init__(self, ctx: zmq.Context, address: str, name: str, instance: int, slot_descriptors: list,
                 timeout_ms: int, metrics, incarnation: int, secret: str):
        self.ep = Endpoint(ctx, zmq.DEALER, address, bind=False, name=name, on_bad=bad_message_counter(metrics))
        self.hello = {"instance": instance, "slots": slot_descriptors, "incarnation": incarnation, "secret": secret}
        self.timeout_ms, self.metrics = timeout_ms, metrics
        self.step = [0] * len(slot_descriptors)
        self.outstanding: set[int] = set()
        self.ready: dict[int, int] = {}  # group -> version of a reply not yet waited for
        self._hello()

    def _hello(self) -> None:
        while True:
            self.ep.send("hello_actor", self.hello)
            reply = self.ep.recv(self.timeout_ms)
            if reply is not None and reply[1].type == "welcome":
                return
            log.warning("action-server at %s did not welcome us within %d ms; retrying", self.ep.address, self.timeout_ms)
            self._reconnect()

    def _reconnect(self) -> None:
        self.metrics.reconnects.labels(peer="action_server").inc()
        self.ep.reconnect()

    def request(self, group: int) -> None:
        self.step[group] += 1
        self.outstanding.add(group)
        self.ep.send("obs", {"slot": group, "step": self.step[group]})

    def wait(self, group: int) -> int:
        t0 = time.perf_counter()
        while group not in self.ready:
            reply = self.ep.recv(self.timeout_ms)
            if reply is None:
                log.warning("no actions from %s within %d ms; reconnecting", self.ep.address, self.timeout_ms)
                self._recover()
                continue
            msg = reply[1]
            if msg.type == "act" and msg.body["slot"] in self.outstanding and msg.body["step"] == self.step[msg.body["slot"]]:
                self.outstanding.discard(msg.body["slot"])
                self.ready[msg.body["slot"]] = msg.body["version"]
            elif msg.type == "error":
                log.warning("action-server says: %s", msg.body["reason"])
                self._recover()
        self.metrics.wait.labels(on="actions").inc(time.perf_counter() - t0)
        return self.ready.pop(group)

    def _recover(self) -> None:
        self._reconnect()
        self._hello()
        for g in sorted(self.outstanding):
            self.ep.send("obs", {"slot": g, "step": self.step[g]})

    def close(self) -> None:
        self.ep.close()


class RemoteSink:
    """SegmentSink over a DEALER socket to replay."""

    def __init__(self, ctx: zmq.Context, address: str, name: str, instance: int, ring_descriptor: dict,
                 incarnation: int, ring: int, timeout_ms: int, metrics, secret: str):
        self.ep = Endpoint(ctx, zmq.DEALER, address, bind=False, name=name, on_bad=bad_message_counter(metrics))
        self.hello = {"instance": instance, "ring": ring_descriptor, "incarnation": incarnation, "secret": secret}
        self.timeout_ms, self.metrics = timeout_ms, metrics
        self.in_flight: dict[int, dict] = {}  # ring index -> announcement not yet released
        self.ep.send("hello_writer", self.hello)

    def announce(self, index: int, meta: dict) -> None:
        body = {"index": index, **meta}
        self.in_flight[index] = body
        self.ep.send("segment", body)
        self._take_releases(0)

    def acquire(self, index: int) -> None:
        t0 = time.perf_counter()
        while index in self.in_flight:
            if not self._take_releases(self.timeout_ms):
                log.warning("replay at %s released nothing within %d ms; reconnecting", self.ep.address, self.timeout_ms)
                self.metrics.reconnects.labels(peer="replay").inc()
                self.ep.reconnect()
                self.ep.send("hello_writer", self.hello)
                for body in sorted(self.in_flight.values(), key=lambda b: b["serial"]):
                    self.ep.send("segment", body)
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
