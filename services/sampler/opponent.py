"""The opponent seat of self-play against a pool of past versions (``[selfplay]``,
``shared.transport.pool``), in a local-inference sampler or in serial mode.

Board b of the run (global columns 2b, 2b + 1) gives the learner seat ``b % 2`` and the
opponent the other, so the learner plays first on half the boards and second on the rest.
The opponent's columns act with a second copy of the agent that holds a version drawn from
the pool: drawn anew every ``horizon`` steps (a segment's worth), loaded from the run
directory's snapshot file only when the draw changes it. Until the pool holds a version (the
learner's first snapshot) the opponent's columns keep the current policy's actions, unscored.

What the sampler does with the columns (``Sampler.opponent``): it masks them out of every loss
(``Samples.failed``) unless ``selfplay.train_both_seats``, and reports the episodes of the
learner's columns only, each with the version the opponent held when it ended.
"""

from __future__ import annotations

import numpy as np

from shared.config.schema import SelfPlayConfig
from shared.transport.pool import PoolFiles, draw


def opponent_columns(env_base: int, envs: int) -> np.ndarray:
    """bool [envs]: which of a sampler's columns (global ``env_base ..``) the opponent holds."""
    cols = env_base + np.arange(envs)
    return cols % 2 != (cols // 2) % 2


class Opponent:
    """The opponent's columns of one sampler and the past version they act with."""

    def __init__(self, cfg: SelfPlayConfig, files: PoolFiles, act, target, mask: np.ndarray, horizon: int,
                 seed: np.random.SeedSequence):
        """``act``: an ``Actor`` or ``NumpyActor`` on the second copy of the agent, whose state
        ``target`` (``params.ModuleState`` or ``StateArrays``) the drawn versions load into;
        ``mask``: ``opponent_columns``."""
        self.cfg, self.files, self.act_fn, self.target, self.horizon = cfg, files, act, target, horizon
        self.mask = mask
        self.columns = np.flatnonzero(mask)
        self.train_both = cfg.train_both_seats
        self.rng = np.random.default_rng(seed)
        self.version = -1
        """The pool version the opponent holds (-1: none yet, it plays with the current policy)."""
        self.steps = 0

    def act(self, slot, env_index: np.ndarray, env_steps: int, envs_total: int) -> None:
        """Overwrite the opponent columns' actions and agent info in ``slot`` (the current policy
        acted for every column) with the held version's."""
        if self.steps % self.horizon == 0:
            self.redraw()
        self.steps += 1
        if self.version < 0:
            return
        c = self.columns
        action, info = self.act_fn(slot.observation[c], env_index[c], slot.first[c], slot.reward[c], env_steps,
                                   envs_total)
        slot.action[c] = action
        slot.agent_info[c] = info

    def redraw(self) -> None:
        versions = self.files.versions()
        if not versions:
            return
        scores = self.files.read_scores() if self.cfg.pool == "prioritised" else {}
        version = draw(self.cfg.pool, versions, scores, self.rng)
        if version != self.version and self.files.load(version, self.target):
            self.version = version
