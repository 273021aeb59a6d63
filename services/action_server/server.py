"""The action-server: batched inference for many samplers' step slots.

Samplers say hello with the descriptors of their step slots (shared memory), then send
"obs ready in slot s, step n". The server gathers the requests that are waiting (up to
``max_batch``, waiting at most ``max_wait_ms`` for more), runs the agent once on their
concatenated observations, writes actions and agent info back into each slot and replies
"act". It follows the learner's parameter versions (PUB/SUB + shared memory).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from shared import shm
from shared.auth import check_secret
from shared.config import ActionServerConfig
from shared.namedarraytuple import drop_leading_dims, leaves, map_leaves, numpify, torchify, zip_map
from shared.params import ParamReader
from shared.sockets import Endpoint, Rejected

log = logging.getLogger(__name__)
POLL_MS = 100


@dataclass
class Peer:
    instance: int
    incarnation: int
    segments: list
    slots: list
    last_seen: float
    first_env: list  # global index of each slot's first env (for per-env exploration)


@dataclass
class Request:
    peer: bytes
    slot: int
    step: int
    t_arrival: float


def act(agent, obs, env_index: np.ndarray, env_steps: int, envs_total: int):
    """Actions and agent info (numpy) for observations [N, ...] of the envs ``env_index``.

    Agents that explore per env (``agent.epsilon``, the DQN family) get each row's epsilon
    for the run's current env step; policy-gradient agents sample from their policy.
    """
    with torch.no_grad():
        if hasattr(agent, "epsilon"):
            epsilon = torch.as_tensor(agent.epsilon(env_steps, env_index, envs_total), dtype=torch.float32)
            action, info = agent.step(torchify(obs), epsilon)
        else:
            action, info = agent.step(torchify(obs))
    return numpify(action), numpify(info)


class ActionServer:
    def __init__(self, cfg: ActionServerConfig, agent: torch.nn.Module, router: Endpoint, params: Endpoint | None,
                 metrics, run_id: str, secret: str, slot_item_spec, envs_per_sampler: int = 1, envs_total: int = 1):
        """``envs_per_sampler``/``envs_total`` give every env a global index, for agents whose
        exploration depends on it (``agent.epsilon(env_steps, env_index, envs_total)``);
        ``run_id``/``secret`` say who belongs to the run; ``slot_item_spec``: one env's StepSlot."""
        self.cfg, self.agent, self.router, self.params, self.m = cfg, agent, router, params, metrics
        self.envs_per_sampler, self.envs_total = envs_per_sampler, envs_total
        self.run_id, self.secret, self.slot_item_spec = run_id, secret, slot_item_spec
        self.reader = ParamReader(agent, shm.Owner(run_id, "learner"))
        self.version = -1
        self.env_steps = 0
        self.peers: dict[bytes, Peer] = {}
        self.pending: list[Request] = []

    # ------------------------------------------------------------ messages

    def handle(self, peer: bytes, msg) -> None:
        now = time.monotonic()
        if msg.type == "hello_actor":
            self._hello(peer, msg.body, now)
        elif msg.type == "obs":
            known = self.peers.get(peer)
            if known is None or not msg.body["slot"] < len(known.slots):
                raise Rejected("state", "unknown sampler or slot: send hello_actor first")
            known.last_seen = now
            self.pending.append(Request(peer, msg.body["slot"], msg.body["step"], now))
        else:
            raise Rejected("state", f"action-server does not take {msg.type!r} messages")

    def _hello(self, peer: bytes, body: dict, now: float) -> None:
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
        envs = sum(len(next(leaves(t))[1]) for t in slots)
        if (body["instance"] + 1) * self.envs_per_sampler > self.envs_total or envs != self.envs_per_sampler:
            for seg in segments:
                seg.close()
            raise Rejected("value", f"sampler {body['instance']} with {envs} envs is not one of this run's "
                           f"{self.envs_total // self.envs_per_sampler} samplers of {self.envs_per_sampler} envs")
        self._detach(peer)
        for other in [o for o, p in self.peers.items() if p.instance == body["instance"]]:
            self._detach(other)  # the sampler's previous incarnation
        first = body["instance"] * self.envs_per_sampler + np.cumsum([0] + [len(t.action) for t in slots[:-1]])
        self.peers[peer] = Peer(body["instance"], body["incarnation"], segments, slots, now, [int(f) for f in first])
        self.pending = [r for r in self.pending if r.peer != peer]
        self.m.peers.set(len(self.peers))
        log.info("sampler %d attached (%d slots)", body["instance"], len(slots))
        self.router.send("welcome", {"peer": peer.decode(errors="replace")}, to=peer)

    def _detach(self, peer: bytes) -> None:
        old = self.peers.pop(peer, None)
        if old is not None:
            for seg in old.segments:
                seg.close()
            self.pending = [r for r in self.pending if r.peer != peer]
            self.m.peers.set(len(self.peers))

    def check_peers(self) -> None:
        now = time.monotonic()
        for peer, p in list(self.peers.items()):
            if now - p.last_seen > self.cfg.peer_timeout_s:
                log.warning("sampler %d silent for %.1f s: detaching its slots", p.instance, now - p.last_seen)
                self.m.peers_lost.inc()
                self._detach(peer)

    def follow_params(self) -> None:
        """Load the newest parameter version announced (older announcements are skipped)."""
        latest = None
        for _, msg in self.params.drain():
            # A restarted learner (new segment nonce) may number on from below what we hold.
            restarted = msg.type == "params" and msg.body["segment"].get("nonce") != self.reader.nonce
            if msg.type == "params" and (msg.body["version"] > self.version or restarted):
                latest = msg
        if latest is not None:
            try:
                if self.reader.read(latest.body["version"], latest.body["segment"]):
                    self.version = latest.body["version"]
                    self.env_steps = latest.body["env_steps"]
                    self.m.policy_version.set(self.version)
            except (ValueError, FileNotFoundError) as e:
                log.warning("cannot load parameters version %d: %s", latest.body["version"], e)

    # ------------------------------------------------------------ inference

    def serve_batch(self) -> None:
        """Answer up to max_batch pending requests with one forward pass."""
        batch, self.pending = self.pending[: self.cfg.max_batch], self.pending[self.cfg.max_batch:]
        peers = [self.peers[r.peer] for r in batch]
        slots = [p.slots[r.slot] for p, r in zip(peers, batch)]
        sizes = [len(s.action) for s in slots]
        obs = zip_map(lambda *xs: np.concatenate(xs), *[s.observation for s in slots])
        env_index = np.concatenate([np.arange(n) + p.first_env[r.slot] for p, r, n in zip(peers, batch, sizes)])
        action, info = act(self.agent, obs, env_index, self.env_steps, self.envs_total)
        start = 0
        for r, slot, n in zip(batch, slots, sizes):
            slot.action[:] = action[start:start + n]
            slot.agent_info[:] = map_leaves(lambda a: a[start:start + n], info)
            start += n
            self.router.send("act", {"slot": r.slot, "step": r.step, "version": max(self.version, 0)}, to=r.peer)
        now = time.monotonic()
        for r in batch:
            self.m.latency.observe(now - r.t_arrival)
        self.m.requests.inc(len(batch))
        self.m.batch_size.observe(len(batch))
        self.m.batch_envs.observe(sum(sizes))

    def run(self, should_stop=lambda: False) -> None:
        poller = zmq.Poller()
        poller.register(self.router.sock, zmq.POLLIN)
        poller.register(self.params.sock, zmq.POLLIN)
        last_check = time.monotonic()
        while not should_stop():
            events = dict(poller.poll(0 if self.pending else POLL_MS))
            if self.params.sock in events:
                self.follow_params()
            if self.router.sock in events:
                self._gather()
            if self.pending:
                self.serve_batch()
            if time.monotonic() - last_check > 1.0:
                self.check_peers()
                last_check = time.monotonic()

    def _gather(self) -> None:
        """Take every waiting request; then wait up to max_wait_ms while others may still come."""
        deadline = time.monotonic() + self.cfg.max_wait_ms / 1000.0
        expected = sum(len(p.slots) for p in self.peers.values())
        while True:
            for peer, msg in self.router.drain():
                self.router.serve(self.handle, peer, msg)
            left = deadline - time.monotonic()
            if len(self.pending) >= min(expected, self.cfg.max_batch) or left <= 0:
                return
            if not self.router.sock.poll(left * 1000.0, zmq.POLLIN):
                return

    def close(self) -> None:
        for peer in list(self.peers):
            self._detach(peer)
