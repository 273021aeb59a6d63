"""The run's topology: how many envs there are, where each sampler's sit among them, how each
is seeded, which action-server serves which sampler. Computed once from the config
(``topology(exp)``) and handed to every part that needs it: samplers, action-servers, replay,
serial mode, the evaluator, and the config checks that bound it. Every seed of a run derives
from ``run.seed`` here.

Every per-env layout is sized for the most samplers the run may have (``sampler.max_count``,
at least ``sampler.count``): replay's table columns, the acting side's per-env state and the
global env indices (the Ape-X epsilon spread), so that ``rlpipe scale`` adds samplers into
room already there, and serial mode lays its table and epsilons out as the pipeline does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.agents.acting import acting_seed
from shared.config.schema import Experiment, most_count

SAMPLER_SEED_STRIDE = 10_007
"""Sampler i seeds its envs from run.seed + SAMPLER_SEED_STRIDE * i (``Topology.env_seed``)."""


@dataclass(frozen=True)
class Topology:
    envs_per_sampler: int
    """B: environments of one sampler (``sampler.envs``)."""
    samplers: int
    """The most samplers the run may have (``sampler.max_count``, at least ``sampler.count``)."""
    action_servers: int
    """Action-servers the run starts with (``action_server.count``)."""
    seed: int
    """``run.seed``: every seed below derives from it (and the agent's initial weights)."""
    eval_seed_offset: int
    """``eval.seed_offset``: where the held-out evaluation seeds start, past every sampler's."""

    @property
    def total_envs(self) -> int:
        """N: envs of all the samplers the run may have; global env indices are 0..N-1."""
        return self.samplers * self.envs_per_sampler

    def env_base(self, sampler: int) -> int:
        """The global index of sampler ``sampler``'s first env."""
        return sampler * self.envs_per_sampler

    def env_seed(self, sampler: int) -> int:
        """The seed of sampler ``sampler``'s first env (env j of it: + j)."""
        return self.seed + SAMPLER_SEED_STRIDE * sampler

    @property
    def sampler_seed_span(self) -> int:
        """How many seeds from ``run.seed`` the envs of all the samplers may take."""
        return SAMPLER_SEED_STRIDE * self.samplers

    @property
    def eval_seed(self) -> int:
        """The seed of the first held-out evaluation env (env j of an evaluation: + j)."""
        return self.seed + self.eval_seed_offset

    def columns(self) -> dict[int, int]:
        """Replay's table layout: sampler -> its env columns, for every sampler the run may have."""
        return {i: self.envs_per_sampler for i in range(self.samplers)}

    def action_server_of(self, sampler: int) -> int:
        """The action-server sampler ``sampler`` asks (round-robin when it starts)."""
        return sampler % self.action_servers

    def acting_seed(self, service: str, instance: int) -> np.random.SeedSequence:
        """The seed of the exploration draws of ``service`` ``instance`` (sampler, action_server, or
        opponent: a sampler's self-play opponent seat, whose version draws it also seeds)."""
        return acting_seed(self.seed, service, instance)


def topology(exp: Experiment) -> Topology:
    return Topology(envs_per_sampler=exp.sampler.envs, samplers=most_count(exp.sampler),
                    action_servers=exp.action_server.count, seed=exp.run.seed,
                    eval_seed_offset=exp.eval.seed_offset)
