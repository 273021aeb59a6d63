"""Where an evaluation's result goes: eval.csv and eval.json (shared/runtime/evaluation.py), TensorBoard
event files in <run>/tb, and the evaluator's Prometheus gauges."""

from __future__ import annotations

import time
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from shared.runtime import evaluation
from shared.runtime.files import WriteErrors
from shared.runtime.runfiles import TB_DIR


class Reports:
    def __init__(self, run_dir: Path, metrics):
        self.run_dir, self.m = Path(run_dir), metrics
        self.errors = WriteErrors(lambda what: metrics.write_errors.inc())
        # Its own event file beside the learner's (a restart adds one more); TensorBoard merges them.
        self.tb = SummaryWriter(str(self.run_dir / TB_DIR), filename_suffix=".evaluator")

    def write(self, result: dict, seconds: float, games: list[dict]) -> None:
        """Report one evaluation's ``summary`` that took ``seconds`` in all, and its ``games``
        against opponents (``episodes.match`` rows, each with its own ``eval_s``): eval.csv rows
        before the summary's, which stays the latest result (eval.json, the learner's rows)."""
        step = result["env_steps"]
        wall_time = round(time.time(), 3)
        try:  # a full disk: this evaluation's rows are lost (logged, counted), the next one's are written
            for row in games:
                evaluation.append(self.run_dir, {**row, "wall_time": wall_time})
                for field in evaluation.MATCH_FIELDS:
                    self.tb.add_scalar(f"eval/{row['opponent']}/{field}", row[field], step)
            evaluation.record(self.run_dir, {**result, "wall_time": wall_time, "eval_s": round(seconds, 3)})
            self.tb.add_scalar("eval/mean_return", result["mean_return"], step)
            self.tb.add_scalar("eval/std_return", result["std_return"], step)
            self.tb.add_scalar("eval/policy_version", result["policy_version"], step)
            self.tb.flush()
        except OSError as e:
            self.errors.failed("evaluation's row", e)
        else:
            self.errors.ok("evaluation's row")
        for row in games:
            for field in evaluation.MATCH_FIELDS:
                outcome, seat = field.split("_")
                self.m.outcome.labels(opponent=row["opponent"], seat=seat, outcome=outcome).set(row[field])
        self.m.mean_return.set(result["mean_return"])
        self.m.std_return.set(result["std_return"])
        self.m.policy_version.set(result["policy_version"])
        self.m.env_steps.set(step)
        self.m.evaluations.inc()
        self.m.eval_time.inc(seconds)

    def close(self) -> None:
        self.tb.close()
