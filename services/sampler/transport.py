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

from shared.transport import wire
from shared.transport.doorbell import STEP_MOD, PeerGone, SamplerBell
from shared.runtime.metrics import bad_message_counter
from shared.data.namedarraytuple import leaves
from shared.transport.sockets import Endpoint
from shared.runtime import heartbeat
from shared.runtime.retry import Backoff, worth_logging

log = logging.getLogger(__name__)
HELLO_BACKOFF_S = 1.0
HELLO_GIVE_UP_S = 300.0
"""Seconds a sampler says hello to its action-server without a welcome before it gives up
with an error (an action-server's start-up, torch and CUDA included, is far shorter)."""
RELEASE_GIVE_UP_S = 300.0
BEAT_MS = 1000  # the longest piece of a wait for replay's releases between two heartbeats
"""Seconds a sampler waits for replay to release anything (reconnecting meanwhile) before it
gives up with an error; generous: a learner restarting after a kill holds releases back too."""


class RemoteActions:
    """ActionSource served by one action-server: hello over a DEALER socket, then the doorbell.

    Each step rings the action-server's doorbell (``shared.transport.doorbell``) and waits for its
    answer there: no socket round trip per step. A doorbell that closes (the action-server
    died) or stays silent for ``timeout_ms`` makes the sampler say hello again on a fresh
    socket and ring again for what was outstanding.
    """

    def __init__(self, ctx: zmq.Context, address: str, name: str, instance: int, slot_descriptors: list,
                 bell_dir, timeout_ms: int, metrics, incarnation: int, secret: str,
                 give_up_s: float = HELLO_GIVE_UP_S):
        self.ep = Endpoint(ctx, zmq.DEALER, address, bind=False, name=name, on_bad=bad_message_counter(metrics))
        self.bell = SamplerBell(bell_dir, name)
        self.give_up_s = give_up_s
        self.hello = {"instance": instance, "slots": slot_descriptors, "incarnation": incarnation, "secret": secret}
        self.timeout_ms, self.metrics = timeout_ms, metrics
        self.step = [0] * len(slot_descriptors)
        self.outstanding: set[int] = set()
        self.ready: dict[int, int] = {}  # group -> version of a reply not yet waited for
        self._hello()

    def _hello(self) -> None:
        """Say hello until an action-server welcomes us and its end of the doorbell is open.
        A refusal is retried after ``HELLO_BACKOFF_S``, doubling up to 8 times that; after
        ``give_up_s`` without a welcome, RuntimeError (supervisord restarts the sampler)."""
        refusals = Backoff(HELLO_BACKOFF_S, 8 * HELLO_BACKOFF_S, give_up_s=self.give_up_s)
        while True:
            heartbeat.beat()
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
                time.sleep(refusals.fail())  # a refusal comes at once: do not spin on it
            else:
                log.warning("action-server at %s did not welcome us within %d ms; retrying", self.ep.address,
                            self.timeout_ms)
            if refusals.spent():
                raise RuntimeError(f"action-server at {self.ep.address} did not welcome us in {refusals.elapsed_s:.0f} s "
                                   f"({refusals.failures} refusal(s)); giving up (is it running? its log says why it "
                                   "refuses)")
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
        """Wait for the actions of ``group``; an action-server that welcomes our hellos but
        answers no ring for ``give_up_s`` is a RuntimeError (as one that never welcomes)."""
        t0 = time.perf_counter()
        silent_since = None  # monotonic time of the first ring left unanswered (not read per step: the hot path)
        while group not in self.ready:
            heartbeat.beat()
            try:
                replies = self.bell.wait(self.timeout_ms)
            except PeerGone as e:
                log.warning("action-server gone (%s); saying hello again", e)
                self._recover()
                continue
            if not replies:
                now = time.monotonic()
                silent_since = silent_since or now - self.timeout_ms / 1000.0
                if now - silent_since >= self.give_up_s:
                    raise RuntimeError(f"action-server at {self.ep.address} sent no actions in {now - silent_since:.0f}"
                                       " s though it welcomed our hellos; giving up (its log says why)")
                log.warning("no actions from %s within %d ms; saying hello again", self.ep.address, self.timeout_ms)
                self._recover()
            else:
                silent_since = None
            for slot, step, version in replies:
                if slot in self.outstanding and step == self.step[slot] % STEP_MOD:
                    self.outstanding.discard(slot)
                    self.ready[slot] = version
        self.metrics.wait.labels(on="actions").inc(time.perf_counter() - t0)
        return self.ready.pop(group)

    def _recover(self) -> None:
        """New socket, hello, and ring again for every outstanding group (the slots still hold their
        observations), each under a new step number. A doorbell that is gone again each time after
        the welcome is retried after a pause that doubles, and given up on after ``give_up_s``
        (RuntimeError).

        Why a new number: the ring we gave up on may still be answered. An action-server that was
        slow, not dead, writes that ring's actions into the slot and replies after our time-out;
        it welcomes our new hello only once it has detached our old peer (dropping what that one
        had pending: its doorbell end closed when we reconnected), and it serves the
        ring made here afterwards, writing the slot again. Under the old number the first reply
        would be taken, and the second write would land after it, over whatever the caller put
        into the slot since (the self-play opponent's actions; the actions the sampler already
        copied into its segment). Under the new one ``wait`` takes only the reply to this ring,
        and no write into the slot comes after it."""
        tries = Backoff(HELLO_BACKOFF_S, 8 * HELLO_BACKOFF_S, give_up_s=self.give_up_s)
        while True:
            self._reconnect()
            self._hello()
            try:
                for g in sorted(self.outstanding):
                    self.step[g] += 1
                    self.bell.ring(g, self.step[g])
                return
            except PeerGone as e:
                if tries.spent():
                    raise RuntimeError(f"action-server at {self.ep.address} welcomed us {tries.failures + 1} times in "
                                       f"{tries.elapsed_s:.0f} s but its doorbell was gone each time ({e}); giving "
                                       "up") from None
                log.warning("action-server gone again (%s)", e)
                time.sleep(tries.fail())

    def close(self) -> None:
        self.ep.close()
        self.bell.close()


class RemoteSink:
    """SegmentSink over a DEALER socket to replay. With ``frames`` (the sampler's segment ring;
    replay runs on another node) each announcement carries the segment's arrays as zero-copy
    frames; the ring slot stays untouched until replay releases it, as on one node.

    A segment replay refuses (its ``error`` reply names the announcement's sequence number) is
    dropped: its ring slot is free again, its steps are counted as dropped, and the sampler goes
    on. An announcement that would fail replay's wire check is dropped before it is sent. While
    nothing is released the sampler reconnects and resends, waiting ``timeout_ms`` the first
    time and twice as long each time after (up to ``MAX_BACKOFF`` times as long), and gives up with a
    RuntimeError once ``give_up_s`` passed without a release (supervisord then restarts it)."""

    MAX_BACKOFF = 8

    def __init__(self, ctx: zmq.Context, address: str, name: str, instance: int, ring_descriptor: dict,
                 incarnation: int, ring: int, timeout_ms: int, metrics, secret: str, frames=None,
                 give_up_s: float = RELEASE_GIVE_UP_S):
        self.ep = Endpoint(ctx, zmq.DEALER, address, bind=False, name=name, on_bad=bad_message_counter(metrics))
        self.frames = frames
        self.hello = {"instance": instance, "ring": ring_descriptor, "incarnation": incarnation, "secret": secret}
        self.timeout_ms, self.metrics, self.give_up_s = timeout_ms, metrics, give_up_s
        self.in_flight: dict[int, dict] = {}  # ring index -> announcement not yet released
        self.sent_seq: dict[int, int] = {}  # ring index -> sequence number of its latest send
        self.refused = 0
        self.ep.send("hello_writer", self.hello)

    def announce(self, index: int, meta: dict) -> None:
        body = {"index": index, **meta}
        try:
            wire.check("segment", body)
        except wire.WireError as e:
            self._drop(index, body, f"not sent: {e}")
        else:
            self.in_flight[index] = body
            self._send(body)
        self._take_releases(0)

    def _send(self, body: dict) -> None:
        arrays = None if self.frames is None else [leaf for _, leaf in leaves(self.frames[body["index"]])]
        self.ep.send("segment", body, arrays=arrays)
        self.sent_seq[body["index"]] = self.ep.seq

    def _drop(self, index: int, body: dict, why: str) -> None:
        self.in_flight.pop(index, None)
        self.sent_seq.pop(index, None)
        self.refused += 1
        self.metrics.refused_segments.inc()
        self.metrics.dropped_steps.inc(body["steps"])
        if worth_logging(self.refused):
            log.error("segment %d (ring slot %d, %d env steps) dropped, %d so far: %s", body["serial"], index,
                      body["steps"], self.refused, why)

    def acquire(self, index: int) -> None:
        t0 = time.perf_counter()
        last_release, attempt = time.monotonic(), 0
        while index in self.in_flight:
            heartbeat.beat()
            wait_ms = self.timeout_ms * min(2 ** attempt, self.MAX_BACKOFF)
            if self._take_releases(wait_ms):
                last_release, attempt = time.monotonic(), 0
                continue
            if index not in self.in_flight:  # refused and dropped
                break
            silent = time.monotonic() - last_release
            if silent >= self.give_up_s:
                raise RuntimeError(f"replay at {self.ep.address} released nothing for {silent:.0f} s over {attempt} "
                                   f"reconnect(s) ({len(self.in_flight)} segment(s) in flight); giving up "
                                   "(is replay running? its log says why it refuses)")
            attempt += 1
            log.warning("replay at %s released nothing within %d ms; reconnecting (attempt %d)", self.ep.address,
                        wait_ms, attempt)
            self.metrics.reconnects.labels(peer="replay").inc()
            self.ep.reconnect()
            self.ep.send("hello_writer", self.hello)
            for body in sorted(self.in_flight.values(), key=lambda b: b["serial"]):
                self._send(body)
        self.metrics.wait.labels(on="replay").inc(time.perf_counter() - t0)

    def _take_releases(self, timeout_ms: float) -> bool:
        """Apply every release (and refusal) that arrives within ``timeout_ms``; True as soon as
        a release or a refusal came (and what else is waiting then is applied too). An error
        that is not about a segment in flight does not end the wait: a refusal comes at once,
        and ending the wait on it would resend at once, forever."""
        deadline = time.monotonic() + timeout_ms / 1000.0
        got = False
        while True:
            heartbeat.beat()  # waiting on a live replay (back-pressure) is not a hang: beat a second at least
            remaining = 0 if got else max(0.0, (deadline - time.monotonic()) * 1000.0)
            reply = self.ep.recv(min(remaining, BEAT_MS))
            if reply is None:
                if got or remaining <= BEAT_MS:
                    return got
                continue
            msg = reply[1]
            if msg.type == "release":
                self.in_flight.pop(msg.body["index"], None)
                got = True
            elif msg.type == "error":
                got = self._refused(msg.body) or got

    def _refused(self, body: dict) -> bool:
        """Drop the segment an error reply names as wrong in itself ("value"; "internal": replay
        failed on it, and would again); False if it names none of ours in flight. A "state" refusal
        (replay restarted and does not know us) is not the segment's fault: it waits for the
        reconnect, which says hello again and resends."""
        seq = body.get("seq")
        for index, sent in list(self.sent_seq.items()) if body.get("why") in ("value", "internal") else ():
            if sent == seq and index in self.in_flight:
                self._drop(index, self.in_flight[index], f"replay refused it: {body['reason']}")
                return True
        log.warning("replay at %s: %s", self.ep.address, body["reason"])
        return False

    def close(self) -> None:
        self.ep.close()
