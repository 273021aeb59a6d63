"""Serial mode: the pipeline's parts in one process, joined by direct calls.

The same Sampler, agent, replay table and Learner as the services, with in-process
stand-ins for the sockets: actions come straight from the agent, segments go straight
into the table, batches straight to the learner. This is the debugging mode (a breakpoint
in a loss works) and the reference the pipeline must agree with.
"""

from __future__ import annotations

import itertools
import logging


from services.learner.learner import Learner
from services.replay.tables import make_table, sample_batch
from services.sampler.local import LocalActions
from services.sampler.sampler import Sampler
from shared.agents.acting import acting_seed
from shared.agents.actor import Actor
from shared.config.schema import Experiment
from services.build import batch_items, batch_spec, env_probe, example_step, make_agent, make_algo, on_policy
from shared.data.layout import segment_spec
from shared.data.namedarraytuple import from_spec
from shared.data.obs_stats import NO_MOMENTS, Moments
from shared.runtime.process import torch_device

log = logging.getLogger(__name__)


class LearnerParams:
    """ParamSource for serial mode: the agent is the learner's own, always at its version."""

    def __init__(self, learner: Learner):
        self.learner = learner

    @property
    def version(self) -> int:
        return self.learner.version

    @property
    def env_steps(self) -> int:
        return self.learner.env_steps

    def poll(self) -> bool:
        return False

    def close(self) -> None:
        pass


class LocalSink:
    """SegmentSink: copies a finished segment into the table at once."""

    def __init__(self, table, instance: int, ring, counters: dict, moments: Moments | None):
        self.table, self.instance, self.ring, self.counters, self.moments = table, instance, ring, counters, moments

    def announce(self, index: int, meta: dict) -> None:
        segment = self.ring[index]
        self.table.insert(self.instance, segment.samples, segment.bootstrap_value, segment.bootstrap_observation)
        self.counters["env_steps"] += meta["steps"]
        self.counters["episodes"].extend(meta["episodes"])
        if self.moments is not None:
            self.moments.add(segment.samples.observation)

    def acquire(self, index: int) -> None:
        """Slots are released as soon as they are announced: nothing to wait for."""


def train_serial(exp: Experiment) -> dict:
    device = torch_device(exp.run.device)
    probe = env_probe(exp)
    agent = make_agent(exp, probe).to(device)
    learner = Learner(exp, agent, make_algo(exp, agent), device, run_dir=None)
    example = example_step(exp, probe)
    probe.close()
    n = batch_items(exp)
    table = make_table(exp.replay, {i: exp.sampler.envs for i in range(exp.sampler.count)},
                       segment_spec(example, exp.sampler.horizon, exp.sampler.envs), n, exp.run.seed)
    batch = from_spec(batch_spec(exp, example))
    counters = {"env_steps": 0, "episodes": []}
    moments = Moments(example.observation.shape) if exp.model.normalize_observations else None
    samplers, parts = [], []
    for i in range(exp.sampler.count):
        s = Sampler(exp, i, run_id="serial", shared_memory=False)
        act = Actor(agent, acting_seed(exp.run.seed, "sampler", i))
        actions = LocalActions(act, s, LearnerParams(learner), exp.sampler.count * exp.sampler.envs)
        sink = LocalSink(table, i, s.ring, counters, moments)
        s.start(actions)
        samplers.append(s)
        parts.append((actions, sink))
    try:
        for s, (actions, sink) in itertools.cycle(zip(samplers, parts)):
            if learner.finished() is not None:
                break
            s.collect_segment(actions, sink)
            while learner.finished() is None:
                info, dropped = sample_batch(table, batch, n, learner.min_version(), lag_bound=on_policy(exp))
                if info is None:
                    break
                meta = {"env_steps": counters["env_steps"], "episodes": counters["episodes"], "dropped": len(dropped),
                        "replay_size": table.size, **(NO_MOMENTS if moments is None else moments.take())}
                counters["env_steps"], counters["episodes"] = 0, []
                priorities = learner.train(batch, meta)
                if priorities is not None:
                    table.update_priorities(info["keys"], info["generations"], priorities)
                learner.maybe_report()
        learner.maybe_report(force=True)
        return learner.write_result(learner.finished())
    finally:
        for s in samplers:
            s.close()

