"""The action-server: batched inference for many samplers' step slots.

Samplers say hello over ZeroMQ with the descriptors of their step slots (shared memory);
the server attaches them and opens the sampler's doorbell (``shared.transport.doorbell``). From then
on every step goes through the doorbell: the sampler rings "slot s holds step n"; the
server gathers the requests that are waiting (up to ``max_batch``, waiting at most
``max_wait_ms`` for more), runs the agent once on their concatenated observations,
writes actions and agent info back into each slot and rings back "slot s, step n, version
v". It follows the learner's parameter versions (PUB/SUB + shared memory).

A sampler whose doorbell closes (its process exited or was killed) is detached at once; one
that stays silent for ``peer_timeout_s`` is detached too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zmq

from shared.transport import shm
from shared.agents.actor import Actor
from shared.transport.auth import check_secret
from shared.config.schema import ActionServerConfig
from shared.transport.doorbell import PeerGone, ServerBell
from shared.data.namedarraytuple import drop_leading_dims, leading_len, map_leaves, zip_map
from shared.transport.params import ParamAnnouncements, ParamStream
from shared.transport.sockets import Endpoint, Rejected
from shared.runtime import heartbeat

log = logging.getLogger(__name__)
POLL_MS = 100


def _join(*parts: np.ndarray) -> np.ndarray:
    """The requests' rows as one array; one request's slot is read in place, not copied."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


@dataclass
class Peer:
    instance: int
    incarnation: int
    segments: list
    slots: list
    bell: ServerBell
    last_seen: float
    env_index: list  # per slot: the global index of each of its envs (for per-env exploration)


@dataclass
class Request:
    peer: bytes
    slot: int
    step: int
    t_arrival: float


class ActionServer:
    def __init__(self, cfg: ActionServerConfig, agent: torch.nn.Module, router: Endpoint, params: Endpoint,
                 metrics, bell_dir: Path, run_id: str, secret: str, slot_item_spec, envs_per_sampler: int = 1,
                 envs_total: int = 1, seed: np.random.SeedSequence | None = None, frames: bool = False):
        """``bell_dir`` holds the samplers' doorbells; ``run_id``/``secret`` say who belongs to
        the run; ``slot_item_spec``: one env's StepSlot; ``envs_per_sampler``/``envs_total`` give
        every env a global index, for agents whose exploration depends on it
        (``cfg.epsilon(env_steps, env_index, envs_total)``); ``seed``: of the exploration noise
        (``shared.agents.acting.acting_seed``; None: fresh entropy); ``frames``: ``params`` brings the
        parameters as frames (the learner runs on another node), not shared-memory announcements."""
        self.cfg, self.agent, self.router, self.params, self.m = cfg, agent, router, params, metrics
        self.act = Actor(agent, seed)
        self.bell_dir, self.envs_per_sampler, self.envs_total = Path(bell_dir), envs_per_sampler, envs_total
        self.run_id, self.secret, self.slot_item_spec = run_id, secret, slot_item_spec
        self.reader = ParamStream(agent, params) if frames else \
            ParamAnnouncements(agent, params, shm.Owner(run_id, "learner"))
        self.peers: dict[bytes, Peer] = {}
        self.by_fd: dict[int, bytes] = {}
        self.pending: list[Request] = []
        self.poller = zmq.Poller()
        self.poller.register(router.sock, zmq.POLLIN)
        self.poller.register(params.sock, zmq.POLLIN)

    # ------------------------------------------------------------ control plane

    def handle(self, peer: bytes, msg) -> None:
        """One control message (through ``Endpoint.serve``: what it raises is answered and counted)."""
        if msg.type == "hello_actor":
            self._hello(peer, msg.body)
        else:
            raise Rejected("state", f"action-server does not take {msg.type!r} messages")

    def _hello(self, peer: bytes, body: dict) -> None:
        check_secret(body, self.secret)
        if any(p.instance == body["instance"] and p.incarnation >= body["incarnation"]
               for other, p in self.peers.items() if other != peer):
            raise Rejected("auth", f"sampler {body['instance']} is bound to another routing id; a restarted sampler "
                           "must say hello with a newer incarnation")
        if any(not isinstance(d.get("spec"), dict) or drop_leading_dims(d["spec"], 1) != self.slot_item_spec
               for d in body["slots"]):
            raise Rejected("descriptor", "bad slot descriptor: its layout is not this agent's StepSlot (same config?)")
        try:
            segments, slots = shm.attach_all(body["slots"], shm.Owner(self.run_id, "sampler", body["instance"]))
        except (ValueError, FileNotFoundError) as e:
            raise Rejected("descriptor", f"bad slot descriptor: {e}") from None
        envs = sum(leading_len(t) for t in slots)
        if (body["instance"] + 1) * self.envs_per_sampler > self.envs_total or envs != self.envs_per_sampler:
            for seg in segments:
                seg.close()
            raise Rejected("value", f"sampler {body['instance']} with {envs} envs is not one of this run's "
                           f"{self.envs_total // self.envs_per_sampler} samplers of {self.envs_per_sampler} envs")
        self._detach(peer)
        for other in [o for o, p in self.peers.items() if p.instance == body["instance"]]:
            self._detach(other)  # the sampler's previous incarnation
        try:
            bell = ServerBell(self.bell_dir, f"sampler{body['instance']}")
        except PeerGone as e:
            for seg in segments:
                seg.close()
            raise Rejected("descriptor", str(e)) from None
        first = body["instance"] * self.envs_per_sampler + np.cumsum([0] + [len(t.action) for t in slots[:-1]])
        self.peers[peer] = Peer(body["instance"], body["incarnation"], segments, slots, bell, time.monotonic(),
                                [f + np.arange(len(t.action)) for f, t in zip(first, slots)])
        self.by_fd[bell.fileno()] = peer
        self.poller.register(bell.fileno(), zmq.POLLIN)
        self.m.peers.set(len(self.peers))
        log.info("sampler %d attached (%d slots)", body["instance"], len(slots))
        self.router.send("welcome", {"peer": peer.decode(errors="replace")}, to=peer)

    def _detach(self, peer: bytes) -> None:
        old = self.peers.pop(peer, None)
        if old is None:
            return
        self.poller.unregister(old.bell.fileno())
        del self.by_fd[old.bell.fileno()]
        old.bell.close()
        for seg in old.segments:
            seg.close()
        self.pending = [r for r in self.pending if r.peer != peer]
        self.m.peers.set(len(self.peers))

    def _lost(self, peer: bytes, why: str) -> None:
        log.warning("sampler %d lost (%s): detaching its slots", self.peers[peer].instance, why)
        self.m.peers_lost.inc()
        self._detach(peer)

    def check_peers(self) -> None:
        now = time.monotonic()
        for peer, p in list(self.peers.items()):
            if now - p.last_seen > self.cfg.peer_timeout_s:
                self._lost(peer, f"silent for {now - p.last_seen:.1f} s")

    def follow_params(self) -> None:
        """Load the newest parameter version that came (older ones are skipped)."""
        was = self.m.time.to("params")
        if self.reader.poll():
            self.m.policy_version.set(self.reader.version)
        self.m.time.to(was)

    # ------------------------------------------------------------ the step path

    def _ring(self, peer: bytes) -> None:
        """Take the requests waiting on one sampler's doorbell."""
        p = self.peers[peer]
        try:
            requests = p.bell.read()
        except PeerGone as e:
            self._lost(peer, str(e))
            return
        now = time.monotonic()
        p.last_seen = now
        for slot, step in requests:
            if slot < len(p.slots):
                self.pending.append(Request(peer, slot, step, now))
            else:
                log.warning("sampler %d rang for slot %d of %d: ignored", p.instance, slot, len(p.slots))
                self.m.bad_messages.labels(reason="value").inc()

    def poll(self, timeout_ms: float) -> None:
        """Wait up to ``timeout_ms`` for anything (messages, parameters, doorbells) and take it."""
        for what, _ in self.poller.poll(timeout_ms):
            if what is self.router.sock:
                for peer, msg in self.router.drain():
                    self.router.serve(self.handle, peer, msg)
            elif what is self.params.sock:
                self.follow_params()
            elif what in self.by_fd:
                self._ring(self.by_fd[what])

    def serve_batch(self) -> None:
        """Answer up to max_batch pending requests with one forward pass."""
        self.m.time.to("forward")
        batch, self.pending = self.pending[: self.cfg.max_batch], self.pending[self.cfg.max_batch:]
        peers = [self.peers[r.peer] for r in batch]
        slots = [p.slots[r.slot] for p, r in zip(peers, batch)]
        sizes = [len(s.action) for s in slots]
        obs = zip_map(_join, *[s.observation for s in slots])
        env_index = _join(*[p.env_index[r.slot] for p, r in zip(peers, batch)])
        first = _join(*[s.first for s in slots])
        reward = _join(*[s.reward for s in slots])
        action, info = self.act(obs, env_index, first, reward, self.reader.env_steps, self.envs_total)
        self.m.time.to("reply")
        start = 0
        version = max(self.reader.version, 0)
        lost = []
        for r, p, slot, n in zip(batch, peers, slots, sizes):
            slot.action[:] = action[start:start + n]
            slot.agent_info[:] = map_leaves(lambda a: a[start:start + n], info)
            start += n
            try:
                p.bell.reply(r.slot, r.step, version)
            except PeerGone as e:
                lost.append((r.peer, str(e)))
        for peer, why in lost:
            if peer in self.peers:
                self._lost(peer, why)
        now = time.monotonic()
        for r in batch:
            self.m.latency.observe(now - r.t_arrival)
        self.m.requests.inc(len(batch))
        self.m.batch_size.observe(len(batch))
        self.m.batch_envs.observe(sum(sizes))

    def _gather(self) -> None:
        """With some requests in, wait up to max_wait_ms for the other samplers' to join the batch."""
        deadline = time.monotonic() + self.cfg.max_wait_ms / 1000.0
        expected = min(sum(len(p.slots) for p in self.peers.values()), self.cfg.max_batch)
        while len(self.pending) < expected:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.poll(left * 1000.0)

    def run(self, should_stop=lambda: False) -> None:
        last_check = time.monotonic()
        while not should_stop():
            heartbeat.beat()
            self.m.time.to("idle")
            self.poll(0 if self.pending else POLL_MS)
            if self.pending:
                self.m.time.to("gather")
                self._gather()
            if self.pending:  # a sampler lost while gathering takes its requests with it
                self.serve_batch()
            if time.monotonic() - last_check > 1.0:
                self.check_peers()
                last_check = time.monotonic()

    def close(self) -> None:
        for peer in list(self.peers):
            self._detach(peer)
        self.reader.close()
