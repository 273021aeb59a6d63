"""Local inference (rlpyt's parallel-CPU sampler): the sampler runs its own copy of the agent.

No action-server and no per-step message: ``request`` runs the agent on the group's step
slot at once. Parameters come from ``params``: in the pipeline a ``shared.transport.params.ParamFollower``
on the learner's segment (checked before every step), in serial mode the learner itself.
The acting step is a ``shared.agents.acting.NumpyActor`` on the sampler's own copy of the state
(no torch in the process) where the learner published an acting plan, else a
``shared.agents.actor.Actor`` around a torch copy of the agent.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class ParamSource(Protocol):
    version: int
    """The policy version the agent holds now (stamped on every step it acts)."""
    env_steps: int
    """The run's env steps at that version (epsilon schedules follow them)."""

    def poll(self) -> bool:
        """Take a newer version if there is one."""

    def close(self) -> None: ...


class LocalActions:
    """ActionSource that runs ``act`` (an ``Actor`` or ``NumpyActor``) on a sampler's step slots right away."""

    def __init__(self, act, sampler, params: ParamSource, envs_total: int, opponent=None):
        """``opponent``: the self-play pool's opponent seat (``services.sampler.opponent.Opponent``),
        which replaces its columns' actions, or None."""
        self.act, self.opponent = act, opponent
        self.slots, self.groups, self.params, self.envs_total = sampler.slots, sampler.groups, params, envs_total
        self.env_index = [np.arange(g.start, g.stop) + sampler.env_base for g in sampler.groups]
        self.versions = [0] * len(sampler.groups)

    def request(self, group: int) -> None:
        self.params.poll()
        slot = self.slots[group]
        action, info = self.act(slot.observation, self.env_index[group], slot.first, slot.reward,
                                self.params.env_steps, self.envs_total)
        slot.action[:] = action
        slot.agent_info[:] = info
        if self.opponent is not None:
            self.opponent.act(slot, self.groups[group], self.env_index[group], self.params.env_steps, self.envs_total)
        self.versions[group] = max(self.params.version, 0)

    def wait(self, group: int) -> int:
        return self.versions[group]

    def close(self) -> None:
        self.params.close()
