"""Layouts of the buffers that cross process boundaries, built from one example step.

Sampler, action-server, replay and learner all derive their shared-memory layouts from
these functions, so a layout is declared once (ARCHITECTURE rule 2).
"""

from __future__ import annotations

import numpy as np

from shared.data.batches import OnPolicyBatch, Samples
from shared.data.namedarraytuple import namedarraytuple, spec_field, spec_of, with_leading_dims

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
    return segments_spec(spec_of(example), horizon, envs)


def segments_spec(step_spec, horizon: int, envs: int):
    """``segment_spec`` of the step laid out as ``step_spec`` (Samples)."""
    return {"type": OnPolicyBatch.__name__, "fields": [
        ["samples", with_leading_dims(step_spec, [horizon, envs])],
        ["bootstrap_value", {"dtype": np.dtype(np.float32).str, "shape": [envs]}],
        ["bootstrap_observation", with_leading_dims(spec_field(step_spec, "observation"), [envs])],
    ]}
