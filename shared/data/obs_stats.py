"""Running observation statistics for ``model.normalize_observations``, numpy only.

Replay (and serial mode's sink) adds every inserted segment's observations to a
``Moments`` accumulator: each env step the samplers produced counts once, whatever the
replay ratio. The sums travel to the learner with the next batch (``sampled``: obs_count,
obs_sum, obs_sumsq), which merges them into the agent's ``ObsNorm`` buffers
(``shared.agents.models``) after that batch's update: the update normalises the batch's
observations as the behaviour policy did, and the next version carries the new statistics
with the parameters trained under the old ones. Those buffers are part of the agent's state,
so the action-servers, local samplers, checkpoints and ``rlpipe evaluate`` normalise with the
learner's statistics.
"""

from __future__ import annotations

import numpy as np


class Moments:
    """Count, sum and sum of squares of observations [..., *shape] since the last ``take``."""

    def __init__(self, shape: tuple[int, ...]):
        self.dim = int(np.prod(shape, dtype=np.int64))
        self.count, self.sum, self.sumsq = 0, np.zeros(self.dim), np.zeros(self.dim)

    def add(self, observation: np.ndarray) -> None:
        x = np.asarray(observation, dtype=np.float64).reshape(-1, self.dim)
        self.count += x.shape[0]
        self.sum += x.sum(0)
        self.sumsq += np.square(x).sum(0)

    def take(self) -> dict:
        """The wire fields (obs_count, obs_sum, obs_sumsq), and a fresh start."""
        out = {"obs_count": self.count, "obs_sum": self.sum.tolist(), "obs_sumsq": self.sumsq.tolist()}
        self.count, self.sum, self.sumsq = 0, np.zeros(self.dim), np.zeros(self.dim)
        return out


NO_MOMENTS = {"obs_count": 0, "obs_sum": [], "obs_sumsq": []}
"""What a replay without observation normalisation sends."""


def merge(count: float, mean: np.ndarray, var: np.ndarray, n: int, total: np.ndarray, total_sq: np.ndarray):
    """(count, mean, var) of all data from the running ones and a batch's n, sum, sum of squares
    (Chan et al.'s parallel update; population variance)."""
    if n == 0:
        return count, mean, var
    batch_mean = total / n
    batch_var = np.maximum(total_sq / n - np.square(batch_mean), 0.0)
    new_count = count + n
    delta = batch_mean - mean
    new_mean = mean + delta * n / new_count
    m2 = var * count + batch_var * n + np.square(delta) * count * n / new_count
    return new_count, new_mean, m2 / new_count
