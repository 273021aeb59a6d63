"""The learner's Weights & Biases run (``[logging] wandb``): the progress scalars against env steps,
the evaluator's latest result (with its video, ``eval.video``) and the resolved config, with W&B's files in the run directory.

W&B is a guest: it gets the rows from a thread of its own through a bounded queue (full: the row
is dropped for W&B and counted), so an update never waits for it; its start (``wandb.init``)
and finish are bounded by ``logging.timeout_s`` each, and a W&B that fails or hangs is logged
once and left behind while training goes on. ``logging.mode`` unset lets ``WANDB_MODE`` (and
W&B's other variables) decide.

The W&B run id is kept in ``<run>/wandb_id``: a run started again (``rlpipe launch --resume``, a
supervisord restart of the learner) continues the same W&B run. The env steps of the last row W&B
took are kept in ``<run>/wandb_step``: a learner restarted from a checkpoint older than that row
(a kill -9) does not log the rows up to it again, whose env steps would go back. ``wandb`` is
imported at the first progress row, as TensorBoard's writer is: its import (about a second) stays
off the way to version 0.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import tomllib
from pathlib import Path

from shared.config.schema import LoggingConfig
from shared.runtime import evaluation, heartbeat
from shared.runtime.runfiles import RUN_CONFIG, WANDB_ID, WANDB_STEP

log = logging.getLogger("services.learner.learner")
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
QUEUE_ROWS = 1000
"""Rows waiting for W&B at most; more are dropped for W&B (they are in progress.csv and TensorBoard)."""
DEFAULT_PROJECT = "rlpipe"
"""The W&B project when neither ``logging.project`` nor ``WANDB_PROJECT`` names one."""


def _often(count: int) -> bool:
    """At the 1st, 2nd, 4th, 8th... occurrence: a repeated failure is said without flooding the log."""
    return count & (count - 1) == 0


class WandbRun:
    def __init__(self, cfg: LoggingConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.run = None  # started at the first row, by the thread
        self.evaluated: int | None = None  # the policy version of the last evaluation logged
        self.failed = False  # wandb.init failed or timed out: not tried again by this process
        self.dropped = 0  # rows W&B did not get: its queue was full
        self.errors = 0  # rows whose wandb.log raised
        self.rows: queue.Queue = queue.Queue(QUEUE_ROWS)
        self.closing = threading.Event()
        self.thread: threading.Thread | None = None
        step_file = self.run_dir / WANDB_STEP
        self.logged_to = int(step_file.read_text()) if step_file.exists() else -1  # env steps W&B has rows up to

    def log(self, scalars: dict[str, float], env_steps: int) -> None:
        """Hand one progress row's ``scalars`` (TensorBoard's tags, finite values) at ``env_steps``
        to W&B's thread (with the evaluator's latest result if it is new); never waits."""
        if self.failed or self.closing.is_set():
            return
        if env_steps <= self.logged_to:  # W&B took it before this learner's checkpoint was resumed
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="wandb", daemon=True)
            self.thread.start()
        try:
            self.rows.put_nowait((scalars, env_steps))
        except queue.Full:
            self.dropped += 1
            if _often(self.dropped):
                log.error("learner: W&B is behind by %d rows: %d row(s) dropped for W&B so far (they are in "
                          "progress.csv and TensorBoard)", QUEUE_ROWS, self.dropped)

    def _work(self) -> None:
        """W&B's thread: start the run, log the rows as they come, finish at ``close``."""
        try:
            self.run = self._start()
        except Exception as e:  # W&B unreachable, not logged in, timed out...: training goes on without it
            self.failed = True
            log.error("learner: no W&B run (%s); progress goes on to progress.csv and TensorBoard",
                      str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        while not (self.closing.is_set() and self.rows.empty()):
            try:
                scalars, env_steps = self.rows.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._log(scalars, env_steps)
            except Exception as e:
                self.errors += 1
                if _often(self.errors):
                    log.error("learner: W&B did not take the row at %d env steps (%s); %d row(s) so far",
                              env_steps, e, self.errors)
        try:
            self.run.finish()
        except Exception as e:
            log.error("learner: W&B run did not finish cleanly (%s)", e)

    def _log(self, scalars: dict[str, float], env_steps: int) -> None:
        self.run.log({STEP: env_steps, **scalars})
        tmp = self.run_dir / (WANDB_STEP + ".tmp")
        tmp.write_text(str(env_steps))
        os.replace(tmp, self.run_dir / WANDB_STEP)
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
                         dir=self.run_dir, name=self.run_dir.name, mode=c.mode or None,
                         project=c.project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                         entity=c.entity or None, group=c.group or None, tags=list(c.tags),
                         config=tomllib.loads((self.run_dir / RUN_CONFIG).read_text()),
                         # The learner's log already goes to <run>/logs; W&B leaves its stdout alone.
                         settings=wandb.Settings(console="off", init_timeout=c.timeout_s, login_timeout=c.timeout_s,
                                                 finish_timeout=c.timeout_s))
        id_file.write_text(run.id)
        run.define_metric(STEP)
        run.define_metric(EVAL_STEP)
        run.define_metric("eval/*", step_metric=EVAL_STEP)
        for prefix in PROGRESS_PREFIXES:
            run.define_metric(f"{prefix}/*", step_metric=STEP)
        return run

    def close(self) -> None:
        """Let W&B's thread log the rows it has and finish the run, for at most its start and
        finish timeouts (the learner's heartbeat goes on meanwhile); a W&B still busy then is
        left behind, and said so."""
        if self.thread is None:
            return
        self.closing.set()
        deadline = time.monotonic() + 2 * self.cfg.timeout_s
        while self.thread.is_alive() and time.monotonic() < deadline:
            heartbeat.beat()
            self.thread.join(min(1.0, max(0.0, deadline - time.monotonic())))
        if self.thread.is_alive():
            log.error("learner: W&B did not finish within %.0f s (logging.timeout_s): left behind; `wandb sync "
                      "%s/wandb/<its run>` uploads what it wrote", 2 * self.cfg.timeout_s, self.run_dir)
        self.thread = None
