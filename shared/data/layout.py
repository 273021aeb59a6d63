"""Layouts of the buffers that cross process boundaries, built from one example step.

Sampler, action-server, replay and learner all derive their shared-memory layouts from
these functions, so a layout is declared once (ARCHITECTURE rule 2).
"""

from __future__ import annotations

import numpy as np

from shared.data.batches import OnPolicyBatch, Samples
from shared.data.namedarraytuple import namedarraytuple, spec_of, with_leading_dims

StepSlot = namedarraytuple("StepSlot", ["observation", "action", "agent_info", "first", "reward"])
"""What a sampler and whoever acts for it share per env group: the observations [B, ...],
``first`` [B] (bool: the observation starts an episode; per-env exploration and recurrent
state resets), ``reward`` [B] (float32: the reward of the step that led to the observation,
a recurrent agent's input), and the actions and agent info written back."""


def step_example(obs_example, action_example, agent_info_example) -> Samples:
    """One step of samples (no leading dims)."""
    return Samples(
        observation=obs_example,
        action=action_example,
        reward=np.float32(0),
        terminated=np.bool_(False),
        truncated=np.bool_(False),
        final_observation=obs_example,
        agent_info=agent_info_example,
        policy_version=np.int64(0),
        failed=np.bool_(False),
    )


def slot_spec(example: Samples, envs: int):
    """A step slot for ``envs`` environments: observation, action, agent_info, first, reward, each [B, ...]."""
    return with_leading_dims(spec_of(StepSlot(example.observation, example.action, example.agent_info,
                                              np.bool_(False), np.float32(0))), [envs])


def segment_spec(example: Samples, horizon: int, envs: int):
    """OnPolicyBatch with samples [T, B], bootstrap_value [B] and bootstrap_observation [B, ...]:
    one segment, or one batch."""
    spec = spec_of(OnPolicyBatch(samples=example, bootstrap_value=np.float32(0),
                                 bootstrap_observation=example.observation))
    spec["fields"][0][1] = with_leading_dims(spec["fields"][0][1], [horizon, envs])
    for field in spec["fields"][1:]:
        field[1] = with_leading_dims(field[1], [envs])
    return spec
