"""Replay tables, numpy only: ``Table(storage, selector, rate_limiter)`` (after Reverb).

Modules: ``sumtree`` (sums/min/max over priorities), ``selectors`` (Fifo, Uniform,
Prioritized), ``rate_limiter`` (samples-per-insert band), ``nstep`` (n-step targets),
``tables`` (storages and the Table), ``sequences`` (the R2D1 sequence storage). This file declares the batch types the tables write
into a caller's destination (the learner's shared-memory batch slot); allocate one with
``from_spec(storage.batch_spec(n), buffer)``.
"""

from shared.namedarraytuple import namedarraytuple

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
    ],
)
"""One n-step transition per row: target = return_ + bootstrap_discount * V(bootstrap_observation)."""

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
        "prev_action",  # [L, n, ...] the recurrent agent's previous-action input (Memory.prev_action)
        "prev_reward",  # [L, n] f32 its previous-reward input (Memory.prev_reward)
        "start_state",  # RnnState [n, H]: the LSTM state the actor started step 0 from
        "is_weight",  # [n] f32: importance-sampling weight in (0, 1]
        "policy_version",  # [n]: version of the policy that chose action 0 (the oldest)
    ],
)
"""n sequences side by side (R2D1, shared/replay/sequences.py); the learner computes the
n-step targets inside each sequence from reward, terminated and truncated."""
