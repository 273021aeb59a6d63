"""One agent step for a batch of observations: the same in the action-server, in
local-inference samplers and in serial mode."""

from __future__ import annotations

import numpy as np
import torch

from shared.agents import StepContext
from shared.agents.numpy_acting import numpy_actor
from shared.namedarraytuple import numpify, torchify


def acting_seed(run_seed: int, service: str, instance: int) -> np.random.SeedSequence:
    """The seed of one acting process's exploration noise (a local-inference sampler, an
    action-server): distinct for every process, and apart from the envs' seeds."""
    return np.random.SeedSequence([run_seed, ("sampler", "action_server").index(service), instance])


def seed_torch(seed: np.random.SeedSequence) -> None:
    """Seed the process's torch generator, which the torch acting path draws from."""
    torch.manual_seed(int(seed.generate_state(1)[0]))


class Actor:
    """``agent``'s acting step on numpy observations: in numpy for the feed-forward MLP agents
    that ``numpy_actor`` covers (on the CPU), drawing from a generator seeded with ``seed``,
    else in torch (from torch's generator)."""

    def __init__(self, agent, seed: np.random.SeedSequence) -> None:
        self.agent = agent
        self.fast = numpy_actor(agent, np.random.default_rng(seed))

    def __call__(self, obs, env_index: np.ndarray, first: np.ndarray, reward: np.ndarray, env_steps: int,
                 envs_total: int):
        """Actions and agent info (numpy) for observations [N, ...] of the envs ``env_index``
        (global indices), ``first`` [N] marking the rows whose observation starts an episode,
        ``reward`` [N] the reward that led to each observation; ``env_steps`` is the run's count
        at the parameters' version (exploration schedules)."""
        ctx = StepContext(env_index=env_index, first=first, reward=reward, env_steps=env_steps, envs_total=envs_total)
        if self.fast is not None:
            return self.fast.step(obs, ctx)
        with torch.inference_mode():  # cheaper than no_grad; nothing here is ever differentiated
            action, info = self.agent.step(torchify(obs), ctx)
        return numpify(action), numpify(info)
