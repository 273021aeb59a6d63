"""Every batch type that crosses a process boundary, declared once (ARCHITECTURE rule 2).

``Samples`` is one env step as samplers record it; ``OnPolicyBatch`` is whole segments (the
on-policy queue's items and A2C/PPO's batch); ``Transition`` and ``SequenceBatch`` are what the
off-policy tables write into a learner's batch slot.

Every leaf of ``Samples`` carries leading dims [T, B] (B = all env columns) in a segment:

- ``observation``: the observation each action was taken in (tree like the env's).
- ``action``, ``reward`` (float32), ``terminated`` / ``truncated`` (bool).
- ``final_observation``: same structure as ``observation``; valid only where
  ``terminated | truncated`` (the observation the env returned before its autoreset),
  garbage elsewhere. After a done step, ``observation[t + 1]`` starts the next episode.
- ``agent_info``: ``shared.agents.config.AgentInfo`` of the behaviour policy at sampling time.
- ``policy_version`` (int64): the parameter version that chose the action.
- ``failed`` (bool): the env failed at this step (raised, or returned a bad value:
  ``shared.envs.group.EnvError.failed_steps``), so the step is no real transition: no loss
  trains on it and no n-step target crosses it. It is also marked truncated (reward 0,
  final_observation = observation), so no return crosses it either; observation[t + 1] is
  the recreated env's first.

``OnPolicyBatch.bootstrap_observation`` ([B, ...]) is the observation that follows step
T-1 and ``bootstrap_value`` (float32 [B]) its behaviour value; with recomputed values the
learner evaluates the observation itself, so every value in GAE comes from one network.
"""

from shared.data.namedarraytuple import namedarraytuple

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
        "failed",
    ],
)

Transition = namedarraytuple(
    "Transition",
    [
        "observation",  # [n, ...] observation at t (same structure as Samples.observation)
        "action",  # [n, ...] action at t
        "return_",  # [n] f32: sum_{k<m} gamma^k r_{t+k}
        "bootstrap_observation",  # [n, ...] observation to bootstrap from (see nstep.py)
        "bootstrap_discount",  # [n] f32: gamma^m, 0 after a termination
        "is_weight",  # [n] f32: importance-sampling weight in (0, 1]
        "policy_version",  # [n]: version of the policy that chose action t
        "steps",  # WindowSteps [n, n_step] with replay.store_steps, else None
    ],
)
"""One n-step transition per row: target = return_ + bootstrap_discount * V(bootstrap_observation)."""

WindowSteps = namedarraytuple(
    "WindowSteps",
    [
        "observation",  # [n, n_step, ...] observation at t + k
        "action",  # [n, n_step, ...] action at t + k
        "reward",  # [n, n_step] f32: r_{t+k}
        "discount",  # [n, n_step] f32: gamma^k for k < m, 0 past the window's m steps
    ],
)
"""Each step k of an n-step window (``replay.store_steps``), so that corrections for every step
(not only the first) can be written: for k < m (the steps ``return_`` sums) the step as the env
produced it; for k >= m everything is 0, so that return_ = sum_k discount[k] * reward[k]."""

OnPolicyBatch = namedarraytuple("OnPolicyBatch", ["samples", "bootstrap_value", "bootstrap_observation"])
"""n whole segments side by side: samples [T, n * B] (the Samples structure); the observation
after each column's last step, bootstrap_observation [n * B, ...], and its behaviour value
bootstrap_value [n * B] f32."""


def column_share(batch, rank: int, ranks: int):
    """Rank ``rank``'s share of an OnPolicyBatch among ``ranks`` data-parallel learners: views
    of its env columns ``rank * B / ranks`` up to the next rank's (whole env sequences, so
    recurrent agents replay them as they would the whole batch)."""
    width = batch.bootstrap_value.shape[0] // ranks
    cols = slice(rank * width, (rank + 1) * width)
    return OnPolicyBatch(batch.samples[:, cols], batch.bootstrap_value[cols], batch.bootstrap_observation[cols])

SequenceBatch = namedarraytuple(
    "SequenceBatch",
    [
        "observation",  # [L, n, ...] observations of L consecutive steps of one env (Samples.observation)
        "action",  # [L, n, ...] actions taken
        "reward",  # [L, n] f32
        "terminated",  # [L, n] bool
        "truncated",  # [L, n] bool
        "failed",  # [L, n] bool: a failed env step (Samples.failed), no transition
        "prev_action",  # [L, n, ...] the recurrent agent's previous-action input (Memory.prev_action)
        "prev_reward",  # [L, n] f32 its previous-reward input (Memory.prev_reward)
        "start_state",  # RnnState [n, H]: the LSTM state the actor started step 0 from
        "is_weight",  # [n] f32: importance-sampling weight in (0, 1]
        "policy_version",  # [n]: version of the policy that chose action 0 (the oldest)
    ],
)
"""n sequences side by side (R2D1, shared/replay/sequences.py); the learner computes the
n-step targets inside each sequence from reward, terminated and truncated."""
