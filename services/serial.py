"""Serial mode: the pipeline's parts in one process, joined by direct calls.

The same Sampler, agent, replay table and Learner as the services, with in-process
stand-ins for the sockets: actions come straight from the agent, segments go straight
into the table, batches straight to the learner. This is the debugging mode (a breakpoint
in a loss works) and the reference the pipeline must agree with.
"""

from __future__ import annotations

import logging

import torch

from services.learner.learner import Learner
from services.replay.tables import make_table
from services.sampler.sampler import Sampler
from shared.config import Experiment
from shared.factory import env_probe, make_agent, make_algo
from shared.layout import segment_spec, step_example
from shared.namedarraytuple import from_spec, numpify, torchify
from shared.runtime import resolve_device

log = logging.getLogger(__name__)


class LocalActions:
    """ActionSource: runs the agent on a sampler's step slots right away."""

    def __init__(self, agent, slots: list, learner: Learner):
        self.agent, self.slots, self.learner = agent, slots, learner

    def request(self, group: int) -> None:
        slot = self.slots[group]
        with torch.no_grad():
            action, info = self.agent.step(torchify(slot.observation))
        slot.action[:] = numpify(action)
        slot.agent_info[:] = numpify(info)

    def wait(self, group: int) -> int:
        return self.learner.version


class LocalSink:
    """SegmentSink: copies a finished segment into the table at once."""

    def __init__(self, table, instance: int, ring, counters: dict):
        self.table, self.instance, self.ring, self.counters = table, instance, ring, counters

    def announce(self, index: int, meta: dict) -> None:
        segment = self.ring[index]
        self.table.insert(self.instance, segment.samples, segment.bootstrap_value)
        self.counters["env_steps"] += meta["steps"]
        self.counters["episodes"].extend(meta["episodes"])

    def acquire(self, index: int) -> None:
        """Slots are released as soon as they are announced: nothing to wait for."""


def train_serial(exp: Experiment) -> dict:
    torch.set_num_threads(1)
    device = resolve_device(exp.run.device)
    probe = env_probe(exp)
    agent = make_agent(exp, probe).to(device)
    learner = Learner(exp, agent, make_algo(exp, agent), device, run_dir=None)
    example = step_example(probe.example_observation(), probe.example_action(), agent.example_info())
    probe.close()
    table = make_table(exp.replay, {i: exp.sampler.envs for i in range(exp.sampler.count)},
                       segment_spec(example, exp.sampler.horizon, exp.sampler.envs))
    batch = from_spec(segment_spec(example, exp.sampler.horizon, exp.sampler.envs * exp.learner.batch_segments))
    counters = {"env_steps": 0, "episodes": []}
    samplers, parts = [], []
    for i in range(exp.sampler.count):
        s = Sampler(exp, i, run_id="serial", agent_info_example=agent.example_info(), shared_memory=False)
        actions, sink = LocalActions(agent, s.slots, learner), LocalSink(table, i, s.ring, counters)
        s.start(actions)
        samplers.append(s)
        parts.append((actions, sink))
    try:
        while learner.finished() is None:
            for s, (actions, sink) in zip(samplers, parts):
                s.collect_segment(actions, sink)
                n = exp.learner.batch_segments
                while True:
                    dropped = table.drop_older_than(max(0, learner.version - exp.replay.max_policy_lag))
                    if not table.can_sample(n):
                        break
                    table.sample_into(batch, n)
                    meta = {"env_steps": counters["env_steps"], "episodes": counters["episodes"], "dropped": dropped}
                    counters["env_steps"], counters["episodes"] = 0, []
                    learner.train(batch, meta)
                    learner.maybe_report()
        learner.maybe_report(force=True)
        return learner.write_result(learner.finished())
    finally:
        for s in samplers:
            s.close()

