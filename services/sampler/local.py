"""Local inference (rlpyt's parallel-CPU sampler): the sampler runs its own copy of the agent.

No action-server and no per-step message: ``request`` runs the agent on the group's step
slot at once. Parameters come from ``params``: in the pipeline a ``shared.params.ParamFollower``
on the learner's segment (checked before every step), in serial mode the learner itself.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from shared.acting import Actor, acting_seed


class ParamSource(Protocol):
    version: int
    """The policy version the agent holds now (stamped on every step it acts)."""
    env_steps: int
    """The run's env steps at that version (epsilon schedules follow them)."""

    def poll(self) -> bool:
        """Take a newer version if there is one."""

    def close(self) -> None: ...


class LocalActions:
    """ActionSource that runs ``agent`` on a sampler's step slots right away."""

    def __init__(self, agent, sampler, params: ParamSource, envs_total: int, run_seed: int):
        self.act = Actor(agent, acting_seed(run_seed, "sampler", sampler.instance))
        self.slots, self.params, self.envs_total = sampler.slots, params, envs_total
        base = sampler.instance * sampler.cfg.envs
        self.env_index = [np.arange(g.start, g.stop) + base for g in sampler.groups]
        self.versions = [0] * len(sampler.groups)

    def request(self, group: int) -> None:
        self.params.poll()
        slot = self.slots[group]
        action, info = self.act(slot.observation, self.env_index[group], slot.first, slot.reward,
                                self.params.env_steps, self.envs_total)
        slot.action[:] = action
        slot.agent_info[:] = info
        self.versions[group] = max(self.params.version, 0)

    def wait(self, group: int) -> int:
        return self.versions[group]

    def close(self) -> None:
        self.params.close()
