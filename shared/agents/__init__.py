"""The agents, one module per family, all with the same acting interface.

- ``shared.agents.pg``: ``PgAgent``, actor-critic for A2C and PPO;
- ``shared.agents.q``: ``QAgent``, Q-networks for the DQN family (C51, dueling);
- ``shared.agents.qpg``: ``DeterministicAgent`` (DDPG, TD3) and ``SacAgent`` (SAC), an
  actor and Q-critics for Box actions.

Every agent acts with ``agent.step(obs, ctx) -> (action, agent_info)`` on a batch of
observations, and ``ctx`` (a ``StepContext``) says which envs the rows belong to, which of
them start an episode, what reward led to each observation, how far the run is and whether to act for evaluation. Exploration is
the agent's business: epsilon per env (Q), per-env noise processes and random warm-up
(Q-policy-gradient), sampling (policy gradient), and so is a recurrent agent's state per env. The same call runs in the action-server,
in local-inference samplers, in serial mode and in ``rlpipe evaluate``.

This module is torch-free (samplers in server mode import nothing from the agents).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
"""log sqrt(2 pi): the constant of a Gaussian's log-density."""


@dataclass(frozen=True)
class StepContext:
    """Who is asking for actions, and what for."""

    env_index: np.ndarray | None = None
    """Global index in [0, envs_total) of each row's env; None = rows 0..B-1 of B envs."""
    first: np.ndarray | None = None
    """bool [B]: the row's observation is the first of an episode (per-env state resets); None = none is."""
    reward: np.ndarray | None = None
    """float32 [B]: the reward of the step that led to each row's observation (recurrent agents' input); None = zeros."""
    env_steps: int = 0
    """The run's env steps as the learner last announced them (exploration schedules)."""
    envs_total: int = 0
    """Envs of the whole run (0 = as many as rows)."""
    greedy: bool = False
    """Act for evaluation: no exploration."""

    def rows(self, n: int) -> tuple[np.ndarray, int]:
        """(env_index [n] int64, envs_total) with the defaults filled in for a batch of n rows."""
        index = np.arange(n) if self.env_index is None else np.asarray(self.env_index, dtype=np.int64)
        return index, (self.envs_total or n)


EXPLORE = StepContext()
"""Explore as envs 0..B-1 at env step 0 (tests, one-off calls)."""
EVALUATE = StepContext(greedy=True)
"""Act for evaluation (the policy's mode, the Q agent's eps_eval)."""
