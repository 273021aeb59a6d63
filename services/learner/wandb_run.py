"""The learner's Weights & Biases run (``[logging] wandb``): the progress scalars against env steps,
the evaluator's latest result (with its video, ``eval.video``) and the resolved config, with W&B's files in the run directory.

The W&B run id is kept in ``<run>/wandb_id``: a run started again (``rlpipe launch --resume``, a
supervisord restart of the learner) continues the same W&B run. ``wandb`` is imported at the
first progress row, as TensorBoard's writer is: its import (about a second) stays off the way to
version 0.
"""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

from shared.config.schema import LoggingConfig
from shared.runtime import evaluation
from shared.runtime.process import RUN_CONFIG

log = logging.getLogger("services.learner.learner")
WANDB_ID = "wandb_id"
"""File in the run directory holding the W&B run id."""
STEP = "env_steps"
"""The x axis of every progress scalar (W&B's own step counts ``log`` calls, which a restart repeats)."""
PROGRESS_PREFIXES = ("progress", "algo", "time")
"""The progress scalars' tag prefixes (``services/learner/progress.py``)."""
EVAL_STEP = "eval/env_steps"
"""The x axis of the ``eval/`` scalars: the env steps at the evaluated version, as in TensorBoard."""
EVAL_FIELDS = ("mean_return", "std_return", "policy_version")
"""The evaluation's fields logged as ``eval/<field>`` (TensorBoard's tags)."""
EVAL_VIDEO = "eval/video"
"""Where the evaluation's video goes (``eval.video``), with its scalars."""


class WandbRun:
    def __init__(self, cfg: LoggingConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.run = None  # started at the first row
        self.evaluated: int | None = None  # the policy version of the last evaluation logged
        self.failed = False  # wandb.init raised: not tried again by this process

    def log(self, scalars: dict[str, float], env_steps: int) -> None:
        """One progress row's ``scalars`` (TensorBoard's tags, finite values) at ``env_steps``,
        and the evaluator's latest result if it is new."""
        if self.run is None:
            if self.failed:
                return
            try:
                self.run = self._start()
            except Exception as e:  # W&B unreachable, not logged in...: training goes on without it
                self.failed = True
                log.error("learner: no W&B run (%s); progress goes on to progress.csv and TensorBoard", e)
                return
        self.run.log({STEP: env_steps, **scalars})
        latest = evaluation.latest(self.run_dir)
        if latest is not None and latest["policy_version"] != self.evaluated:
            self.evaluated = latest["policy_version"]
            logged = {EVAL_STEP: latest["env_steps"], **{f"eval/{f}": latest[f] for f in EVAL_FIELDS}}
            video = self.run_dir / latest["video"] if latest.get("video") else None
            if video is not None and video.is_file():  # eval.video: the episode recorded with this evaluation
                import wandb

                logged[EVAL_VIDEO] = wandb.Video(str(video), format="mp4")
            self.run.log(logged)

    def _start(self):
        import wandb

        id_file = self.run_dir / WANDB_ID
        c = self.cfg
        run = wandb.init(id=id_file.read_text().strip() if id_file.exists() else None, resume="allow",
                         dir=self.run_dir, name=self.run_dir.name, mode=c.mode, project=c.project,
                         entity=c.entity or None, group=c.group or None, tags=list(c.tags),
                         config=tomllib.loads((self.run_dir / RUN_CONFIG).read_text()),
                         # The learner's log already goes to <run>/logs; W&B leaves its stdout alone.
                         settings=wandb.Settings(console="off"))
        id_file.write_text(run.id)
        run.define_metric(STEP)
        run.define_metric(EVAL_STEP)
        run.define_metric("eval/*", step_metric=EVAL_STEP)
        for prefix in PROGRESS_PREFIXES:
            run.define_metric(f"{prefix}/*", step_metric=STEP)
        return run

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
