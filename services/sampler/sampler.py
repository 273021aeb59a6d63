"""The sampler: steps its environments, asks for actions, fills segments for replay.

Per env group g (two groups in alternating mode, rlpyt's alternating sampler), a *step
slot* in shared memory holds the group's current observations; the action-server writes
actions and agent info back into it. While one group waits for its actions the other
steps its environments, so env stepping overlaps inference. Where the envs step in threads
of their own (EnvPool, ``env.split_step``), each group's step is split in two: every group is
sent before any is received, so group g also steps while the sampler serves group g + 1.

A *segment* (``OnPolicyBatch``: samples [T, B] + bootstrap_value [B]) is filled in a ring
of ``ring`` segments in shared memory. Segment k is handed to replay once the value of the
observation after its last step is known — which arrives for free with the actions for
the first step of segment k + 1. Replay releases a segment when it has copied it; with
every ring slot unreleased the sampler waits (back-pressure).
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from shared.transport import shm
from shared.config.schema import SamplerConfig
from shared.envs.backends import AnyEnvGroup, make_env_group, split_steps
from shared.envs.group import EnvConfig, EnvError
from shared.transport.wire import MAX_RETURN
from shared.data.layout import segment_spec, slot_spec, step_example
from shared.data.namedarraytuple import from_spec, with_leading_dims
from shared.runtime import heartbeat
from shared.runtime.metrics import NoPhases
from shared.runtime.retry import worth_logging

from shared.config.topology import Topology

log = logging.getLogger(__name__)


class ActionSource(Protocol):
    """Fills a step slot's action and agent_info for its observations."""

    def request(self, group: int) -> None: ...

    def wait(self, group: int) -> int:
        """Block until the actions of ``group`` are in its slot; return the policy version."""


class SegmentSink(Protocol):
    """Takes finished segments from the ring and gives ring slots back."""

    def announce(self, index: int, meta: dict) -> None: ...

    def acquire(self, index: int) -> None:
        """Block until ring slot ``index`` is free to write."""


def group_slices(envs: int, alternating: bool) -> list[slice]:
    if not alternating:
        return [slice(0, envs)]
    half = envs // 2
    return [slice(0, half), slice(half, envs)]


def segment_specs(cfg: SamplerConfig, example) -> dict[str, dict]:
    """The layouts of one sampler's segments by purpose: a step slot per env group
    (``slot<g>``), then the segment ring (``ring``: ``cfg.ring`` segments [T, B]);
    ``example``: one step (``services.build.example_step``)."""
    groups = group_slices(cfg.envs, cfg.alternating and cfg.inference == "server")
    specs = {f"slot{i}": slot_spec(example, g.stop - g.start) for i, g in enumerate(groups)}
    specs["ring"] = with_leading_dims(segment_spec(example, cfg.horizon, cfg.envs), [cfg.ring])
    return specs


class Sampler:
    """Owns the envs, the step slots and the segment ring of one sampler instance."""

    def __init__(self, cfg: SamplerConfig, env: EnvConfig, topo: Topology, instance: int, agent_info,
                 run_id: str, metrics=None, shared_memory: bool = True):
        """``agent_info(action_example)``: one env's agent info (``services.build.agent_info``),
        the layout of what the acting side writes back with each action."""
        self.cfg, self.instance, self.metrics = cfg, instance, metrics
        self.clock = NoPhases() if metrics is None else metrics.time  # where the time goes
        # Asking for actions is the forward pass itself with local inference, a wait otherwise.
        self.acting = "inference" if cfg.inference == "local" else "actions"
        self.env_base = topo.env_base(instance)
        # Alternating pays only while another process computes the actions.
        self.groups = group_slices(cfg.envs, cfg.alternating and cfg.inference == "server")
        seed = topo.env_seed(instance)
        self.envs = [make_env_group(env, g.stop - g.start, seed + g.start) for g in self.groups]
        # EnvPool steps a group in its own threads: start every group's step, then collect them,
        # so group g steps while the sampler waits for, copies and sends group g + 1.
        self.split = split_steps(env, len(self.groups))
        action = self.envs[0].example_action()
        self.example = step_example(self.envs[0].example_observation(), action, agent_info(action))
        self.segments: list[shm.Segment] = []
        *specs, rspec = segment_specs(cfg, self.example).values()
        if shared_memory:
            self.slots, self.slot_descriptors = [], []
            for i, spec in enumerate(specs):
                seg, tree, desc = shm.allocate(shm.segment_name(run_id, "sampler", instance, f"slot{i}"), spec)
                self.segments.append(seg)
                self.slots.append(tree)
                self.slot_descriptors.append(desc)
            seg, self.ring, self.ring_descriptor = shm.allocate(shm.segment_name(run_id, "sampler", instance, "ring"), rspec)
            self.segments.append(seg)
        else:
            self.slots = [from_spec(spec) for spec in specs]
            self.slot_descriptors = []
            self.ring, self.ring_descriptor = from_spec(rspec), None
        self.k = 0  # ring slot being filled
        self.serial = 0  # segments announced so far
        self.unannounced = 0  # env steps in the ring not handed over yet (dropped if the sampler stops)
        self.episodes: list[list[float]] = []  # [return, length] finished in the current segment
        self.pending: int | None = None  # segment waiting for its bootstrap values
        self.bad_returns = 0  # finished episodes whose return was not reported (not finite or huge)
        self.opponent = None
        """Self-play against a pool: the opponent seat (``services.sampler.opponent.Opponent``: its
        columns ``mask``, ``version_of`` a board's game, ``train_both``), set with the acting side."""

    # ------------------------------------------------------------ loop

    def start(self, actions: ActionSource) -> None:
        for g, env in enumerate(self.envs):
            env.reset(self.slots[g].observation)
            self.slots[g].first[:] = True
            self.slots[g].reward[:] = 0.0
            actions.request(g)

    def collect_segment(self, actions: ActionSource, sink: SegmentSink) -> None:
        """Hand the previous segment over, then fill ring slot k with T steps of every env group.

        The previous segment's bootstrap values come with the actions for this segment's
        first step (already requested), so it is announced before this one needs a ring
        slot: with a ring of one segment the sampler runs at most one segment ahead.
        """
        clock, acting = self.clock, self.acting  # one clock read a phase boundary, per group step (not per env)
        clock.to(acting)
        first = [actions.wait(g) for g in range(len(self.groups))]
        clock.to("write")
        if self.pending is not None:
            for cols, slot in zip(self.groups, self.slots):
                self._bootstrap(self.pending, cols, slot)
            self._announce(sink, self.pending)
            self.pending = None
        clock.to("ring")
        sink.acquire(self.k)
        seg = self.ring[self.k]
        versions = []
        groups = list(enumerate(zip(self.groups, self.envs)))
        for t in range(self.cfg.horizon):
            heartbeat.beat()  # a step, not a segment, is the grain of progress: a slow env's segment may take minutes
            sent = []
            for g, (cols, env) in groups:
                version = first[g] if t == 0 else actions.wait(g)  # in the acting phase since its request
                clock.to("write")
                slot = self.slots[g]
                step = seg.samples[t, cols]
                step.observation[:] = slot.observation
                step.action[:] = slot.action
                step.agent_info[:] = slot.agent_info
                step.policy_version[:] = version
                versions.append(version)
                clock.to("env")
                env.send(slot.action)
                if self.split:
                    sent.append((g, cols, env, slot, step))
                else:
                    self._finish_step(g, cols, env, slot, step, actions)
            for g, cols, env, slot, step in sent:
                clock.to("env")
                self._finish_step(g, cols, env, slot, step, actions)
        self.pending = (self.k, min(versions), max(versions), self.episodes)
        self.episodes = []
        self.k = (self.k + 1) % self.cfg.ring

    def _bootstrap(self, pending, cols: slice, slot) -> None:
        """The observation after the pending segment's last step (now in the slot) and its value."""
        info = slot.agent_info
        segment = self.ring[pending[0]]
        segment.bootstrap_value[cols] = info.value if "value" in info else 0.0
        segment.bootstrap_observation[cols] = slot.observation

    def _announce(self, sink: SegmentSink, pending) -> None:
        k, vmin, vmax, episodes = pending
        self.serial += 1
        self.unannounced -= self.cfg.horizon * self.cfg.envs
        if self.metrics is not None:  # before the announcement: replay's counts never run ahead of ours
            self.metrics.segments.inc()
            self.metrics.env_steps.inc(self.cfg.horizon * self.cfg.envs)
            if episodes:
                rets = np.array([e[:2] for e in episodes])  # without a self-play opponent's version
                self.metrics.episodes.inc(len(episodes))
                self.metrics.episode_return.set(float(rets[:, 0].mean()))
                self.metrics.episode_length.set(float(rets[:, 1].mean()))
        sink.announce(k, {"serial": self.serial, "steps": self.cfg.horizon * self.cfg.envs, "episodes": episodes,
                          "version_min": int(vmin), "version_max": int(vmax)})

    def _finish_step(self, g: int, cols: slice, env: AnyEnvGroup, slot, step, actions: ActionSource) -> None:
        """Receive group g's step (sent), then ask for its next actions."""
        self._step_envs(g, env, slot, step)
        self.unannounced += cols.stop - cols.start
        self.clock.to(self.acting)
        actions.request(g)

    def _step_envs(self, g: int, env: AnyEnvGroup, slot, step) -> None:
        """Receive group g's step (``env.send`` came first) into the slot and the segment's step."""
        step.failed[:] = False
        try:
            ended = env.recv(slot.observation, step.reward, step.terminated, step.truncated, step.final_observation)
        except EnvError as e:
            # The group marked the failed envs' transitions as truncations, so no return crosses them;
            # ``failed`` keeps them out of every loss (their outputs are no transition).
            step.failed[list(e.failed_steps)] = True
            log.error("sampler %d: %s; recreating %d environment(s)", self.instance, e, len(e.env_indices))
            for i in e.env_indices:
                if self.metrics is not None:
                    self.metrics.env_errors.inc()
                env.recreate(i, slot.observation)
            ended = e.finished
        # A multi-agent env's column whose agent left the episode is padding: no transition, as a failed step.
        np.logical_or(step.failed, env.padding, out=step.failed)
        opponent = self.opponent
        if opponent is not None and not opponent.train_both:  # the past version's moves train nothing
            np.logical_or(step.failed, opponent.mask[self.groups[g]], out=step.failed)
        # Envs reset themselves at an episode's end (and recreated ones count as truncated).
        np.logical_or(step.terminated, step.truncated, out=slot.first)
        slot.reward[:] = step.reward
        for i, ret, length in ended:
            if abs(ret) <= MAX_RETURN:  # False for NaN; replay's wire check would refuse the whole segment
                if opponent is None:
                    self.episodes.append([float(ret), int(length)])
                elif not opponent.mask[column := self.groups[g].start + i]:  # the learner seat's games, by opponent
                    version = opponent.version_of(column)
                    self.episodes.append([float(ret), int(length), *([version] if version >= 0 else [])])
                continue
            if self.metrics is not None:
                self.metrics.bad_returns.inc()
            self.bad_returns += 1
            if worth_logging(self.bad_returns):
                log.error("sampler %d: env %d finished an episode with return %r (not finite or beyond %g); "
                          "not reported (%d so far)", self.instance, self.env_base + self.groups[g].start + i,
                          ret, MAX_RETURN, self.bad_returns)

    def close(self) -> None:
        if self.unannounced:
            log.info("sampler %d stops: %d env steps collected and not handed over are dropped", self.instance,
                     self.unannounced)
            if self.metrics is not None:
                self.metrics.dropped_steps.inc(self.unannounced)
        for env in self.envs:
            env.close()
        for seg in self.segments:
            seg.unlink()
            seg.close()


def run_loop(sampler: Sampler, actions: ActionSource, sink: SegmentSink, should_stop=lambda: False) -> None:
    heartbeat.phase("sampling")
    sampler.start(actions)
    while not should_stop():
        heartbeat.beat()
        sampler.collect_segment(actions, sink)
