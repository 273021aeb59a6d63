"""What the run has done, as the learner counts it, and the progress rows it reports.

The counters (env steps, updates, episodes and their returns, dropped items, wall time of
earlier incarnations) come from replay's batch metadata and the learner's updates; they are
checkpointed with the model. A progress row goes to progress.csv, to TensorBoard (with the
means of the algorithm's diagnostics since the last row), to W&B when configured (the same
scalars: ``services/learner/wandb_run.py``) and to the log; with a self-play pool, each pool
version's Elo goes to pool_elo.csv and TensorBoard beside it.
"""

from __future__ import annotations

import collections
import logging
import time
from pathlib import Path

import numpy as np

from shared.config.schema import RunConfig
from shared.runtime import evaluation
from shared.runtime.files import WriteErrors, append_csv
from shared.runtime.metrics import Phases
from shared.runtime.runfiles import POOL_ELO, PROGRESS, TB_DIR
from shared.transport.pool import OUTCOMES, Scores
from services.learner.wandb_run import WandbRun

log = logging.getLogger("services.learner.learner")
PROGRESS_FIELDS = ["wall_s", "env_steps", "env_steps_per_s", "updates", "updates_per_s", "policy_version",
                   "episodes", "mean_return", "mean_length", "policy_lag", "dropped", "replay_size", "eta_s",
                   "skipped_updates",
                   *evaluation.PROGRESS_COLUMNS]
ETA_ROWS = 10
"""Progress rows the ETA's env-step rate is measured over (the rows before it, this incarnation's)."""
POOL_FIELDS = ["pool_win", "pool_draw", "pool_loss", "pool_elo", "pool_best_version", "pool_best_elo"]
"""Columns of a run that plays against a self-play pool: the learner seat's win / draw / loss rates
over its last ``run.return_window`` games against the pool, its Elo (``shared.transport.pool``), and
the pool's version of the highest Elo and that Elo (NaN before the pool holds one): how far the
learner is ahead of the strongest past version it still meets."""
POOL_ELO_FIELDS = ["wall_s", "env_steps", "version", "elo", "games", "score"]
"""pool_elo.csv's columns, in long format because the pool's versions change: at each progress row a
row per version the pool holds, with its Elo, the learner's games against it and its score against
the learner ((the learner's losses + draws / 2) / games; NaN before the first game)."""
COUNTERS = ("env_steps", "updates", "episodes_seen", "dropped")
"""The counters a checkpoint keeps (with the returns, lengths and wall time)."""


MAX_UNWRITTEN = 10_000
"""Rows kept while progress.csv cannot be written (a full disk), oldest dropped first; as many
of pool_elo.csv's."""


class Progress:
    def __init__(self, return_window: int, run_dir: Path | None, wandb: WandbRun | None = None,
                 errors: WriteErrors | None = None, clock: Phases | None = None, budget: RunConfig | None = None,
                 scores: Scores | None = None):
        """``wandb``: where the scalars also go (None: TensorBoard only); ``errors``: how a file
        that cannot be written (a full disk) is reported; its rows and scalars are written at
        the next row that can be; ``clock``: the learner's time split, whose shares since the
        last row go to TensorBoard as ``time/<phase>``; ``budget``: the run's env-step and wall
        budgets the ETA aims at (None: no ETA); ``scores``: the learner's games against a self-play
        pool, which the episodes tagged with an opponent version go to (None: no pool)."""
        self.run_dir, self.wandb, self.clock, self.budget = run_dir, wandb, clock, budget
        self.errors = WriteErrors() if errors is None else errors
        self.unwritten: list[dict] = []  # progress rows not in progress.csv yet, oldest first
        self.unwritten_pool: list[dict] = []  # pool_elo.csv's rows not written yet, oldest first, kept apart:
        # a row a pool version at each progress row would otherwise crowd the progress rows out
        self.recent: collections.deque = collections.deque(maxlen=ETA_ROWS + 1)  # (wall_s, env_steps) of rows
        self.time_at_row = clock.totals() if clock is not None else {}
        self.env_steps = 0
        self.updates = 0
        self.episodes_seen = 0
        self.dropped = 0
        self.skipped_updates = 0  # updates whose every gradient step was skipped (a non-finite loss)
        self.skipped_in_a_row = 0  # such updates since the last one that learned (not checkpointed)
        self.replay_size = 0  # items in replay's table at the last batch
        self.returns: collections.deque = collections.deque(maxlen=return_window)
        self.lengths: collections.deque = collections.deque(maxlen=return_window)
        self.scores = scores
        self.pool_outcomes: collections.deque = collections.deque(maxlen=return_window)
        self.fields = PROGRESS_FIELDS + (POOL_FIELDS if scores is not None else [])
        self.wall_before = 0.0  # wall seconds of earlier incarnations (from the checkpoint)
        self.t_start = time.monotonic()
        self.last_lag = 0.0
        self.diag_sums: collections.Counter = collections.Counter()  # per term, over the updates since the last row
        self.diag_updates = 0
        self.steps_at_row = 0
        self.updates_at_row = 0
        self.wall_at_row = 0.0
        self.tb = None  # made at the first row: its import stays off the way to version 0 (docs/benchmarks.md, "Start-up and stop")

    def record_batch(self, meta: dict) -> None:
        """Replay's counts for one batch: env steps and episodes inserted since the last one."""
        self.env_steps += meta["env_steps"]
        self.dropped += meta.get("dropped", 0)
        self.replay_size = meta.get("replay_size", self.replay_size)
        for ret, length, *opponent in meta["episodes"]:
            self.returns.append(ret)
            self.lengths.append(length)
            if opponent and self.scores is not None:
                outcome = self.scores.record(opponent[0], ret)
                if outcome is not None:
                    self.pool_outcomes.append(outcome)
        self.episodes_seen += len(meta["episodes"])

    def record_update(self, stats: dict[str, float], lag: float, skipped: bool = False) -> None:
        """One update's diagnostics and policy lag; ``skipped``: every gradient step of it was
        skipped (a non-finite loss or gradient norm), so it learned nothing."""
        self.skipped_updates += skipped
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        self.diag_sums.update({term: float(value) for term, value in stats.items()})
        self.diag_updates += 1
        self.updates += 1
        self.last_lag = lag

    def mean_return(self) -> float:
        return float(np.mean(self.returns)) if self.returns else float("nan")

    def wall_s(self) -> float:
        return self.wall_before + time.monotonic() - self.t_start

    def row(self, version: int) -> dict:
        """The progress row now; rates since the last row."""
        now = self.wall_s()
        elapsed = max(now - self.wall_at_row, 1e-9)
        rate = (self.env_steps - self.steps_at_row) / elapsed
        update_rate = (self.updates - self.updates_at_row) / elapsed
        self.steps_at_row, self.updates_at_row, self.wall_at_row = self.env_steps, self.updates, now
        mean_length = float(np.mean(self.lengths)) if self.lengths else float("nan")
        return {"wall_s": round(now, 2), "env_steps": self.env_steps, "env_steps_per_s": round(rate, 1),
                "updates": self.updates, "updates_per_s": round(update_rate, 2), "policy_version": version,
                "episodes": self.episodes_seen, "mean_return": round(self.mean_return(), 2),
                "mean_length": round(mean_length, 1), "policy_lag": round(self.last_lag, 2), "dropped": self.dropped,
                "replay_size": self.replay_size, "eta_s": round(self.eta_s(now), 1),
                "skipped_updates": self.skipped_updates, **self.pool_columns()}

    def pool_columns(self) -> dict:
        """POOL_FIELDS now (none without a pool; NaN rates before its first game)."""
        if self.scores is None:
            return {}
        games = len(self.pool_outcomes)
        row = {f"pool_{o}": round(sum(x == o for x in self.pool_outcomes) / games, 3) if games else float("nan")
               for o in OUTCOMES}
        row["pool_elo"] = round(self.scores.learner_elo, 1)
        best = max(self.scores.versions.items(), key=lambda vs: vs[1]["elo"], default=None)
        row["pool_best_version"] = best[0] if best else float("nan")
        row["pool_best_elo"] = round(best[1]["elo"], 1) if best else float("nan")
        return row

    def pool_elo_rows(self, row: dict) -> list[dict]:
        """POOL_ELO_FIELDS of each version the pool holds, at progress row ``row`` (none without a pool)."""
        if self.scores is None:
            return []
        rows = []
        for version, s in sorted(self.scores.versions.items()):
            games = s["win"] + s["draw"] + s["loss"]
            score = (s["loss"] + s["draw"] / 2) / games if games else float("nan")
            rows.append({"wall_s": row["wall_s"], "env_steps": row["env_steps"], "version": version,
                         "elo": round(s["elo"], 1), "games": int(games), "score": round(score, 3)})
        return rows

    def row_is_current(self) -> bool:
        """Whether this incarnation has written a row and nothing was counted since."""
        return bool(self.recent) and (self.env_steps, self.updates) == (self.steps_at_row, self.updates_at_row)

    def eta_s(self, now: float) -> float:
        """Seconds until the env-step budget at the env-step rate since the last ETA_ROWS rows of this
        incarnation, or until the wall budget if that comes first; NaN at its first row (the
        rate from the start would count the start-up) and while no env step comes."""
        self.recent.append((now, self.env_steps))
        (wall0, steps0), (wall1, steps1) = self.recent[0], self.recent[-1]
        if self.budget is None or steps1 <= steps0 or wall1 <= wall0:  # also at the first row: one entry
            return float("nan")
        to_budget = max(0, self.budget.max_env_steps - steps1) * (wall1 - wall0) / (steps1 - steps0)
        return min(to_budget, max(0.0, self.budget.max_wall_s - now))

    def time_shares(self) -> dict[str, float]:
        """The learner's phases' shares of its wall time since the last call (start-up, which only the first
        row's interval holds, is not shown)."""
        if self.clock is None:
            return {}
        now = self.clock.totals()
        spent = {phase: now[phase] - self.time_at_row.get(phase, 0.0) for phase in now}
        self.time_at_row = now
        total = sum(spent.values())
        return {phase: t / total for phase, t in spent.items() if phase != "startup"} if total > 0 else {}

    def write(self, row: dict) -> list[dict]:
        """``row`` to TensorBoard and W&B (``progress/<field>``, ``algo/<term>``: the means of the
        algorithm's diagnostics since the last row, and ``pool/elo/v<version>``: each pool
        version's Elo, at the run's env steps), progress.csv (with the evaluator's latest result),
        pool_elo.csv and the log. Returns the pool's rows written (``pool_elo_rows``)."""
        pool_rows = self.pool_elo_rows(row)
        scalars = {f"progress/{field}": value for field, value in row.items() if field != "env_steps"}
        scalars.update({f"algo/{term}": total / self.diag_updates for term, total in self.diag_sums.items()})
        scalars.update({f"time/learner_{phase}": share for phase, share in self.time_shares().items()})
        scalars.update({f"pool/elo/v{r['version']}": r["elo"] for r in pool_rows})
        self.diag_sums.clear()
        self.diag_updates = 0
        # No mean return before the first episode ends.
        scalars = {tag: value for tag, value in scalars.items() if np.isfinite(value)}
        if self.run_dir is not None:
            self._tensorboard(scalars)
            if self.wandb is not None:
                self.wandb.log(scalars, self.env_steps)
            row.update(evaluation.progress_columns(self.run_dir))  # the evaluator's latest result, if any
            self.unwritten = self.unwritten[-MAX_UNWRITTEN + 1:] + [row]
            self.unwritten_pool = (self.unwritten_pool + pool_rows)[-MAX_UNWRITTEN:]
            self.write_rows()
        log.info("steps %d (%.0f/s) updates %d version %d mean return %.1f over %d episodes, lag %.2f, eta %.0f s",
                 row["env_steps"], row["env_steps_per_s"], row["updates"], row["policy_version"], row["mean_return"],
                 len(self.returns), row["policy_lag"], row["eta_s"])
        if self.scores is not None and self.pool_outcomes:
            log.info("against the self-play pool: wins %.0f%% draws %.0f%% losses %.0f%% over %d games, Elo %.0f "
                     "(versions: %s)", 100 * row["pool_win"], 100 * row["pool_draw"], 100 * row["pool_loss"],
                     len(self.pool_outcomes), row["pool_elo"],
                     ", ".join(f"v{r['version']} {r['elo']:.0f}" for r in pool_rows))
        return pool_rows

    def _tensorboard(self, scalars: dict) -> None:
        """The scalars to TensorBoard; a writer that failed (a full disk) is dropped and the
        next row starts a new event file."""
        try:
            if self.tb is None:
                from torch.utils.tensorboard import SummaryWriter

                # Events are flushed at each progress row, not per update.
                self.tb = SummaryWriter(str(self.run_dir / TB_DIR), max_queue=10_000, flush_secs=3600)
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, self.env_steps)
            self.tb.flush()
        except OSError as e:
            self.errors.failed("tensorboard", e)
            tb, self.tb = self.tb, None
            try:
                if tb is not None:
                    tb.close()
            except OSError:
                pass
            return
        self.errors.ok("tensorboard")

    def write_rows(self) -> None:
        """The rows not yet in progress.csv and pool_elo.csv, oldest first, each whole or not at all."""
        for name, fields, rows in ((PROGRESS, self.fields, self.unwritten),
                                   (POOL_ELO, POOL_ELO_FIELDS, self.unwritten_pool)):
            while rows:
                try:
                    append_csv(self.run_dir / name, fields, rows[0])
                except OSError as e:
                    self.errors.failed(name, e)
                    break
                del rows[0]
            else:
                self.errors.ok(name)

    def state(self) -> dict:
        """What a checkpoint keeps."""
        return {**{name: getattr(self, name) for name in COUNTERS}, "returns": list(self.returns),
                "lengths": list(self.lengths), "wall_s": self.wall_s(), "skipped_updates": self.skipped_updates}

    def load_state(self, state: dict) -> None:
        for name in COUNTERS:
            setattr(self, name, state[name])
        self.returns.extend(state["returns"])
        self.lengths.extend(state.get("lengths", ()))
        self.skipped_updates = state.get("skipped_updates", 0)  # checkpoints made before it was counted have none
        self.wall_before = state["wall_s"]
        self.steps_at_row, self.updates_at_row, self.wall_at_row = self.env_steps, self.updates, self.wall_before

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.close()
