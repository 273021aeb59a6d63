"""When the run is over: the return target, the env-step budget, the wall-clock budget, or
failed: ``run.max_skipped_updates`` updates in a row learned nothing (every gradient step skipped
for a non-finite loss or gradient norm).

With data-parallel ranks, rank 0 decides for all: its reason goes to the others after each
update, at the same point on every rank, so that all stop after the same update.
"""

from __future__ import annotations

from shared.config.schema import RunConfig
from shared.transport.ranks import Group

from services.learner.progress import Progress

REASONS = (None, "target", "budget", "wall", "failed")


class Stopping:
    def __init__(self, run: RunConfig, progress: Progress, group: Group | None = None):
        self.run, self.progress, self.group = run, progress, group
        self.decided: str | None = None  # a group's end of the run, as rank 0 decided it at the last update

    def reason(self) -> str | None:
        """This rank's reason to stop now (target, budget, wall, failed), or None."""
        run, p = self.run, self.progress
        if p.skipped_in_a_row >= run.max_skipped_updates:
            return "failed"
        if len(p.returns) >= run.return_window and p.mean_return() >= run.target_return:
            return "target"
        if p.env_steps >= run.max_env_steps:
            return "budget"
        if p.wall_s() >= run.max_wall_s:
            return "wall"
        return None

    def finished(self) -> str | None:
        """Why the run is over, or None; in a group, rank 0's answer at the last update (``decide``)."""
        return self.decided if self.group is not None else self.reason()

    def decide(self) -> None:
        """In a group, at the same point on every rank: rank 0's ``reason()`` for all."""
        self.decided = REASONS[self.group.broadcast(REASONS.index(self.reason()))]
