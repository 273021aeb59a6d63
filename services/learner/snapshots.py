"""The learner's side of the self-play pool (``shared.transport.pool``): its policy enters the
pool every ``selfplay.snapshot_every`` updates (version 0, or the resumed version, at the start
where the pool is empty), and the scores of its games against the pool go to pool/scores.json
with each snapshot and checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path

from shared.config.schema import SelfPlayConfig
from shared.transport.params import field_name
from shared.transport.pool import PoolFiles, Scores

log = logging.getLogger("services.learner.learner")


class PoolSnapshots:
    def __init__(self, cfg: SelfPlayConfig, run_dir: Path, agent):
        self.cfg, self.agent = cfg, agent
        self.files = PoolFiles(run_dir, cfg.size)
        self.scores = Scores(self.files.read_scores())
        self.scores.keep(self.files.versions())

    def start(self, version: int) -> None:
        """At the start of the training loop: an empty pool gets the current policy, so the
        opponent always has a past version to act with."""
        self.files.drop_partial()
        held = self.files.versions()
        if held:
            log.info("self-play pool: %d version(s) held (%s), %s draws", len(held), ", ".join(map(str, held)),
                     self.cfg.pool)
            for v in held:
                self.scores.enter(v)  # a pool written before its scores (a kill in between)
        else:
            self.add(version)

    def after_update(self, version: int, updates: int) -> None:
        if updates % self.cfg.snapshot_every == 0:
            self.add(version)

    def add(self, version: int) -> None:
        arrays = {field_name(k): t.detach().cpu().numpy() for k, t in self.agent.state_dict().items()}
        try:
            self.files.add(version, arrays)
        except OSError as e:  # a full disk: the pool keeps the versions it has, the next snapshot tries again
            log.error("self-play pool: version %d not added (%s)", version, e)
            return
        self.scores.enter(version)
        self.scores.keep(self.files.versions())
        self.save_scores()

    def save_scores(self) -> None:
        try:
            self.files.write_scores(self.scores.state())
        except OSError as e:
            log.error("self-play pool: scores not written (%s)", e)
