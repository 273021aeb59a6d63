"""One agent step for a batch of observations: the same in the action-server, in
local-inference samplers and in serial mode."""

from __future__ import annotations

import numpy as np
import torch

from shared.agents import StepContext
from shared.namedarraytuple import numpify, torchify


def act(agent, obs, env_index: np.ndarray, first: np.ndarray, reward: np.ndarray, env_steps: int, envs_total: int):
    """Actions and agent info (numpy) for observations [N, ...] of the envs ``env_index``
    (global indices), ``first`` [N] marking the rows whose observation starts an episode,
    ``reward`` [N] the reward that led to each observation; ``env_steps`` is the run's count
    at the parameters' version (exploration schedules)."""
    ctx = StepContext(env_index=env_index, first=first, reward=reward, env_steps=env_steps, envs_total=envs_total)
    with torch.inference_mode():  # cheaper than no_grad; nothing here is ever differentiated
        action, info = agent.step(torchify(obs), ctx)
    return numpify(action), numpify(info)
