"""One agent step for a batch of observations: the same in the action-server, in
local-inference samplers and in serial mode."""

from __future__ import annotations

import numpy as np
import torch

from shared.namedarraytuple import numpify, torchify


def act(agent, obs, env_index: np.ndarray, env_steps: int, envs_total: int):
    """Actions and agent info (numpy) for observations [N, ...] of the envs ``env_index``.

    Agents that explore per env (``agent.epsilon``, the DQN family) get each row's epsilon
    for the run's current env step; policy-gradient agents sample from their policy.
    """
    with torch.inference_mode():  # cheaper than no_grad; nothing here is ever differentiated
        if hasattr(agent, "epsilon"):
            epsilon = torch.as_tensor(agent.epsilon(env_steps, env_index, envs_total), dtype=torch.float32)
            action, info = agent.step(torchify(obs), epsilon)
        else:
            action, info = agent.step(torchify(obs))
    return numpify(action), numpify(info)
