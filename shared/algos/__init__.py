"""Algorithms: pure functions of a batch of tensors (no env, no sockets, no replay).

The on-policy batch layout is declared here once; the sampler fills it and A2C/PPO read
it. Every leaf is a torch tensor with leading dims [T, B] (B = all env columns):

- ``observation``: the observation each action was taken in (tree like the env's).
- ``action``, ``reward`` (float32), ``terminated`` / ``truncated`` (bool).
- ``final_observation``: same structure as ``observation``; valid only where
  ``terminated | truncated`` (the observation the env returned before its autoreset),
  garbage elsewhere. After a done step, ``observation[t + 1]`` starts the next episode.
- ``agent_info``: ``shared.agent_config.AgentInfo`` of the behaviour policy at sampling time.
- ``policy_version`` (int64): the parameter version that chose the action.

``OnPolicyBatch.bootstrap_observation`` ([B, ...]) is the observation that follows step
T-1 and ``bootstrap_value`` (float32 [B]) its behaviour value; with recomputed values the
learner evaluates the observation itself, so every value in GAE comes from one network.
"""

from shared.namedarraytuple import namedarraytuple
from shared.replay import OnPolicyBatch  # noqa: F401  (declared once, beside the tables that store it)

Samples = namedarraytuple(
    "Samples",
    [
        "observation",
        "action",
        "reward",
        "terminated",
        "truncated",
        "final_observation",
        "agent_info",
        "policy_version",
    ],
)

