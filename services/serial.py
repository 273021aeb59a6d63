"""Serial mode: the services' own loops in one process, over in-process ports.

The learner runs its loop (``services.learner.learner.run_loop``) as in the pipeline; only
its two ports are in-process stand-ins (as Sample Factory's serial runner runs the parallel
components over in-process queues):

- ``SerialBatches`` is its BatchSource: ``next()`` drives the samplers in turn
  (``Sampler.collect_segment``, actions straight from the agent, each finished segment
  straight into the table) until the table can serve the batch asked for, through the
  same ``ReplayCore`` (services/replay/core.py) the replay service keeps its table and books in;
- ``SerialParams`` is its ParamSink, and the samplers' ParamSource: the agent they act
  with is the learner's own, so a published version is in force at once.

Given a run directory the learner writes what it writes in the pipeline (progress.csv,
tb/, checkpoints/, result.json) and resumes from the checkpoint there. This is the
debugging mode (a breakpoint in a loss works) and the reference the pipeline must agree
with. Nothing goes to shared memory: samplers and table live on the heap.
"""

from __future__ import annotations

import collections
import copy
import itertools
import time
from pathlib import Path

from services.build import (agent_info, batch_items, batch_spec, env_probe, example_step, make_agent, make_algo,
                            on_policy)
from services.learner.learner import Learner, run_loop
from services.replay.core import ReplayCore
from services.replay.tables import make_table
from services.sampler.local import LocalActions
from services.sampler.opponent import Opponent, sampler_opponent
from services.sampler.sampler import Sampler
from shared.agents.actor import Actor
from shared.agents.stacked import stacked_actor
from shared.config.schema import ConfigError, Experiment
from shared.data.layout import segment_spec
from shared.data.namedarraytuple import from_spec
from shared.runtime.process import lock_service, torch_device
from shared.config.topology import topology
from shared.transport.params import ModuleState


class SerialParams:
    """ParamSink of the learner and ParamSource of the samplers' local actions."""

    def __init__(self, version: int, env_steps: int):
        self.version, self.env_steps = version, env_steps

    def publish(self, version: int, env_steps: int) -> None:
        self.version, self.env_steps = version, env_steps

    def poll(self) -> bool:
        return False  # the agent is the learner's: nothing to load

    def close(self) -> None:
        pass


class LocalSink:
    """SegmentSink: inserts a finished segment into the replay core at once."""

    def __init__(self, core: ReplayCore, instance: int, ring):
        self.core, self.instance, self.ring = core, instance, ring

    def announce(self, index: int, meta: dict) -> None:
        self.core.insert(self.instance, self.ring[index], meta["steps"], meta["episodes"])

    def acquire(self, index: int) -> None:
        """Slots are released as soon as they are announced: nothing to wait for."""


class SerialBatches:
    """BatchSource over the in-process replay core. Requests are served in order; ``next``
    fills the oldest one, collecting a segment from each sampler in turn while the table
    cannot serve it, for at most ``timeout_ms`` (then None, as a socket's poll would say).

    The lag bound of a request is the newest one the learner asked with: in one process a
    batch is filled when the learner waits for it, after its last update, so it is held to
    the bound of that version (in the pipeline replay may fill it earlier, at the bound of
    the version that asked)."""

    def __init__(self, core: ReplayCore, slots: list, items: int, lag_bound: bool, samplers: list):
        self.core, self.slots, self.items, self.lag_bound = core, slots, items, lag_bound
        self.turns = itertools.cycle(samplers)  # (sampler, actions, sink)
        self.requests: collections.deque[int] = collections.deque()
        self.min_version = 0

    def request(self, slot: int, min_version: int) -> None:
        self.requests.append(slot)
        self.min_version = max(self.min_version, min_version)

    def next(self, timeout_ms: int) -> tuple[int, dict] | None:
        deadline = time.monotonic() + timeout_ms / 1000.0
        slot = self.requests[0]
        while True:
            info, _ = self.core.sample(self.slots[slot], self.items, self.min_version, self.lag_bound)
            if info is not None:
                break
            if time.monotonic() > deadline:
                return None
            sampler, actions, sink = next(self.turns)
            sampler.collect_segment(actions, sink)
        self.requests.popleft()
        return slot, {**self.core.report(), **self.core.priority_keys(info)}

    def update_priorities(self, meta: dict, priorities) -> None:
        self.core.table.update_priorities(meta["keys"], meta["generations"], priorities)


def train_serial(exp: Experiment, run_dir: Path | None = None) -> dict:
    """Train ``exp`` in this process until it ends; the learner's result.

    ``run_dir`` (made by ``shared.launch``): the learner writes its files there and resumes
    from its checkpoint, holding the run's learner lock meanwhile; None: nothing is written.
    An interrupt (Ctrl-C) writes a checkpoint first. ConfigError for ``learner.count`` > 1
    (one learner runs here) or an agent that cannot be built for the env.
    """
    if exp.learner.count > 1:
        raise ConfigError(f"learner.count = {exp.learner.count}: serial mode runs one learner in this process; "
                          "launch the run for data-parallel ranks")
    if exp.selfplay.on and run_dir is None:
        raise ConfigError(f"selfplay.pool = {exp.selfplay.pool!r}: the pool's versions live in the run directory; "
                          "train in one (rlpipe train --serial, shared.launch.api.train_serial)")
    lock = None if run_dir is None else lock_service(run_dir, "learner")
    try:
        return _train(exp, run_dir)
    finally:
        if lock is not None:
            lock.close()


def opponent(exp: Experiment, run_dir: Path, sampler: Sampler, agent) -> Opponent:
    """The self-play pool's opponent seat of ``sampler``: copies of ``agent`` that load past versions."""
    acting, drawing = topology(exp).acting_seed("opponent", sampler.instance).spawn(2)

    def make_copy():
        other = copy.deepcopy(agent)
        return Actor(other, acting.spawn(1)[0]), ModuleState(other)
    return sampler_opponent(exp, run_dir, sampler, make_copy, drawing, stacked_actor)


def _train(exp: Experiment, run_dir: Path | None) -> dict:
    device = torch_device(exp.run.device)
    probe = env_probe(exp)
    try:
        agent = make_agent(exp, probe).to(device)
        example = example_step(exp, probe)
    finally:
        probe.close()
    learner = Learner(exp, agent, make_algo(exp, agent), device, run_dir=run_dir)
    learner.resume()
    items = batch_items(exp)
    topo = topology(exp)
    table = make_table(exp.replay, topo.columns(), segment_spec(example, exp.sampler.horizon, exp.sampler.envs), items,
                       exp.run.seed)
    core = ReplayCore(table, exp.model.normalize_observations)
    # One batch slot: with nothing to overlap in one process, prefetching would only hold a second batch.
    slots = [from_spec(batch_spec(exp, example))]
    params = SerialParams(learner.version, learner.env_steps)
    samplers, parts = [], []
    try:
        for i in range(exp.sampler.count):
            s = Sampler(exp.sampler, exp.env, topo, i, agent_info(exp), run_id="serial" if run_dir is None else run_dir.name,
                        shared_memory=False)
            samplers.append(s)
            act = Actor(agent, topo.acting_seed("sampler", i))
            s.opponent = None if not exp.selfplay.on else opponent(exp, run_dir, s, agent)
            actions = LocalActions(act, s, params, topo.total_envs, s.opponent)
            s.start(actions)
            parts.append((s, actions, LocalSink(core, i, s.ring)))
        source = SerialBatches(core, slots, items, on_policy(exp), parts)
        try:
            return run_loop(learner, slots, source, params)
        except KeyboardInterrupt:  # keep what was learned for `rlpipe launch --resume`
            learner.maybe_checkpoint(force=True)
            raise
    finally:
        for s in samplers:
            s.close()
        learner.progress.close()
