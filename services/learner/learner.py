"""The learner: batches in, updates, parameter versions out; progress, checkpoints, the end.

It owns ``prefetch`` batch slots (shared memory in the pipeline). Replay fills a slot on
request; the learner trains on one slot while the next fills (double buffering), then asks
for that slot again. After each update it publishes a new parameter version. It keeps the
run's counters (env steps, episodes, versions) and checkpoints them with the model and
optimizer, so a learner killed and restarted resumes where its last checkpoint stood. The
checkpoint before that is kept beside it: a latest one that cannot be loaded (truncated by
a full disk, say) is reported and the previous one is used. A lock file in the run
directory keeps a second learner of the same run and rank from starting (it would take over
the first one's segments).

Data-parallel ranks (``learner.count`` > 1, ``shared.transport.ranks``): each rank trains on its share
of every batch, and their gradient steps average the gradients, so all hold the same
parameters; every ``CHECK_EVERY`` updates they compare checksums and stop on a difference.
Rank 0 alone publishes versions and writes progress, checkpoints and the result; whether
the run is over is its decision, sent to the others after each update. All ranks resume
from the same checkpoint.
"""

from __future__ import annotations

import collections
import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from shared.runtime import evaluation
from shared.config.schema import Experiment
from shared.data.namedarraytuple import torchify
from shared.transport.ranks import Group
from shared.runtime.process import TB_DIR, append_csv

log = logging.getLogger(__name__)
CHECKPOINT = "checkpoints/latest.pt"
PREVIOUS_CHECKPOINT = "checkpoints/previous.pt"
LOCK = "learner{rank}.lock"
PROGRESS = "progress.csv"
RESULT = "result.json"
# While no batch comes, the current version is re-announced this often: a PUB message sent
# before an action-server's SUB finished connecting is lost, and with stale parameters
# its samplers' segments would only be dropped for policy lag.
REANNOUNCE_MS = 500
PROGRESS_FIELDS = ["wall_s", "env_steps", "env_steps_per_s", "updates", "updates_per_s", "policy_version",
                   "episodes", "mean_return", "mean_length", "policy_lag", "dropped", "replay_size",
                   *evaluation.PROGRESS_COLUMNS]
REASONS = (None, "target", "budget", "wall")
CHECK_EVERY = 100
"""Updates between two comparisons of the ranks' parameter checksums."""


class BatchSource(Protocol):
    def request(self, slot: int, min_version: int) -> None:
        """Ask for batch slot ``slot`` to be filled with data no older than ``min_version``."""

    def next(self, timeout_ms: int) -> tuple[int, dict] | None:
        """Wait for a requested slot to be filled: (slot, meta with env_steps, episodes, dropped), or None."""

    def update_priorities(self, meta: dict, priorities) -> None:
        """Send new priorities [n] for the items of the batch ``meta`` describes (one-way)."""


class ParamSink(Protocol):
    def publish(self, version: int, env_steps: int) -> None: ...


class Learner:
    def __init__(self, exp: Experiment, agent: torch.nn.Module, algo, device: torch.device, run_dir: Path | None,
                 metrics=None, group: Group | None = None):
        """``group``: this learner's place among data-parallel ranks (None: the only learner)."""
        self.exp, self.agent, self.algo, self.device, self.run_dir, self.m = exp, agent, algo, device, run_dir, metrics
        self.group = group
        self.leads = group is None or group.rank == 0  # publishes, reports, checkpoints
        self.decided: str | None = None  # a group's end of the run, as rank 0 decided it at the last update
        self.identical_at: tuple[int, int] | None = None  # (update, checksum) of the ranks' last comparison
        self.version = 0
        self.env_steps = 0
        self.updates = 0
        self.episodes_seen = 0
        self.dropped = 0
        self.replay_size = 0  # items in replay's table at the last batch
        self.returns: collections.deque = collections.deque(maxlen=exp.run.return_window)
        self.lengths: collections.deque = collections.deque(maxlen=exp.run.return_window)
        self.wall_before = 0.0  # wall seconds of earlier incarnations (from the checkpoint)
        self.t_start = time.monotonic()
        self.t_first_batch: float | None = None
        self.t_progress = 0.0
        self.t_checkpoint = time.monotonic()
        self.last_lag = 0.0
        self.last_diag: dict = {}
        self.diag_sums: collections.Counter = collections.Counter()  # per term, over the updates since the last report
        self.diag_updates = 0
        self.steps_at_progress = 0
        self.updates_at_progress = 0
        self.wall_at_progress = 0.0
        self.tb = None  # made at the first progress row: its import (~0.3 s) is not on the way to version 0

    # ------------------------------------------------------------ training

    def train(self, slot, meta: dict):
        """One update on a filled batch slot (numpy views); counters from replay's ``meta``.

        Returns the algorithm's new priorities for the batch's items, or None.
        """
        if self.t_first_batch is None:
            self.t_first_batch = time.monotonic()
        self.env_steps += meta["env_steps"]
        self.dropped += meta.get("dropped", 0)
        self.replay_size = meta.get("replay_size", self.replay_size)
        for ret, length in meta["episodes"]:
            self.returns.append(ret)
            self.lengths.append(length)
        self.episodes_seen += len(meta["episodes"])
        if meta.get("obs_count") and self.agent.obs_norm is not None:
            self.agent.obs_norm.update(meta["obs_count"], meta["obs_sum"], meta["obs_sumsq"])
        batch = torchify(slot, self.device)
        versions = slot.samples.policy_version if "samples" in slot else slot.policy_version
        self.last_lag = float(self.version - versions.mean())
        progress = min(1.0, self.env_steps / self.exp.run.max_env_steps)
        t0 = time.perf_counter()
        self.last_diag = self.algo.update(batch, progress)
        priorities = self.last_diag.pop("priorities", None)
        self.diag_sums.update({term: float(value) for term, value in self.last_diag.items()})
        self.diag_updates += 1
        self.updates += 1
        self.version += 1
        if self.group is not None:
            if self.updates % CHECK_EVERY == 0:
                self.identical_at = (self.updates, self.group.check_identical(self.agent, f"after update {self.updates}"))
            self.decide()
        if self.m is not None:
            self.m.update_time.inc(time.perf_counter() - t0)
            self.m.updates.inc()
            self.m.env_steps.set(self.env_steps)
            self.m.policy_version.set(self.version)
            self.m.policy_lag.set(self.last_lag)
            if self.returns:
                self.m.mean_return.set(self.mean_return())
            for term, value in self.last_diag.items():
                self.m.loss.labels(term=term).set(float(value))
        return priorities

    def min_version(self) -> int:
        """Oldest policy version a batch may hold (the on-policy lag bound; replay drops older)."""
        return max(0, self.version - self.exp.replay.max_policy_lag)

    def mean_return(self) -> float:
        return float(np.mean(self.returns)) if self.returns else float("nan")

    def wall_s(self) -> float:
        return self.wall_before + time.monotonic() - self.t_start

    def finished(self) -> str | None:
        """Why the run is over (target, budget, wall), or None. In a group: rank 0's answer
        at the last update (``decide``)."""
        return self.decided if self.group is not None else self.reason()

    def decide(self) -> None:
        """In a group, at the same point on every rank: rank 0's ``reason()`` for all."""
        self.decided = REASONS[self.group.broadcast(REASONS.index(self.reason()))]

    def reason(self) -> str | None:
        run = self.exp.run
        if len(self.returns) >= run.return_window and self.mean_return() >= run.target_return:
            return "target"
        if self.env_steps >= run.max_env_steps:
            return "budget"
        if self.wall_s() >= run.max_wall_s:
            return "wall"
        return None

    # ------------------------------------------------------------ bookkeeping

    def progress_row(self) -> dict:
        now = self.wall_s()
        elapsed = max(now - self.wall_at_progress, 1e-9)
        rate = (self.env_steps - self.steps_at_progress) / elapsed
        update_rate = (self.updates - self.updates_at_progress) / elapsed
        self.steps_at_progress, self.updates_at_progress, self.wall_at_progress = self.env_steps, self.updates, now
        mean_length = float(np.mean(self.lengths)) if self.lengths else float("nan")
        return {"wall_s": round(now, 2), "env_steps": self.env_steps, "env_steps_per_s": round(rate, 1),
                "updates": self.updates, "updates_per_s": round(update_rate, 2), "policy_version": self.version,
                "episodes": self.episodes_seen, "mean_return": round(self.mean_return(), 2),
                "mean_length": round(mean_length, 1), "policy_lag": round(self.last_lag, 2), "dropped": self.dropped,
                "replay_size": self.replay_size}

    def write_scalars(self, row: dict) -> None:
        """The progress row (``progress/<field>``) and the means of the algorithm's diagnostics
        over the updates since the last row (``algo/<term>``) as TensorBoard scalars at the
        run's env steps, then one flush."""
        scalars = {f"progress/{field}": value for field, value in row.items() if field != "env_steps"}
        scalars.update({f"algo/{term}": total / self.diag_updates for term, total in self.diag_sums.items()})
        self.diag_sums.clear()
        self.diag_updates = 0
        if self.run_dir is None:
            return
        if self.tb is None:
            from torch.utils.tensorboard import SummaryWriter

            # Events are flushed at each progress row, not per update.
            self.tb = SummaryWriter(str(self.run_dir / TB_DIR), max_queue=10_000, flush_secs=3600)
        for tag, value in scalars.items():
            if np.isfinite(value):  # no mean return before the first episode ends
                self.tb.add_scalar(tag, value, self.env_steps)
        self.tb.flush()

    def maybe_report(self, force: bool = False) -> dict | None:
        if not force and time.monotonic() - self.t_progress < self.exp.run.log_interval_s:
            return None
        self.t_progress = time.monotonic()
        row = self.progress_row()
        if not self.leads:
            return row
        self.write_scalars(row)  # the evaluator writes its own scalars
        if self.run_dir is not None:
            row.update(evaluation.progress_columns(self.run_dir))  # the evaluator's latest result, if any
            append_csv(self.run_dir / PROGRESS, PROGRESS_FIELDS, row)
        log.info("steps %d (%.0f/s) updates %d version %d mean return %.1f over %d episodes, lag %.2f",
                 row["env_steps"], row["env_steps_per_s"], row["updates"], row["policy_version"], row["mean_return"],
                 len(self.returns), row["policy_lag"])
        if self.identical_at is not None:
            log.info("parameters identical on %d ranks at update %d (crc32 %08x)", self.group.world, *self.identical_at)
            self.identical_at = None
        return row

    def maybe_checkpoint(self, force: bool = False) -> None:
        if self.run_dir is None or not self.leads:
            return
        if not force and time.monotonic() - self.t_checkpoint < self.exp.learner.checkpoint_interval_s:
            return
        self.t_checkpoint = time.monotonic()
        path = self.run_dir / CHECKPOINT
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"agent": self.agent.state_dict(), "algo": self.algo.state_dict(), "version": self.version,
                    "env_steps": self.env_steps, "updates": self.updates, "episodes_seen": self.episodes_seen,
                    "returns": list(self.returns), "lengths": list(self.lengths), "wall_s": self.wall_s(),
                    "dropped": self.dropped}, tmp)
        if path.exists():
            os.replace(path, self.run_dir / PREVIOUS_CHECKPOINT)
        os.replace(tmp, path)  # atomic: a kill mid-write leaves the previous checkpoints intact

    def resume(self) -> bool:
        """Load the latest checkpoint of this run, or the previous one if the latest cannot be
        loaded; False if there is none. RuntimeError naming both files if neither loads."""
        if self.run_dir is None:
            return False
        paths = [p for p in (self.run_dir / CHECKPOINT, self.run_dir / PREVIOUS_CHECKPOINT) if p.exists()]
        errors = []
        for path in paths:
            try:
                ck = torch.load(path, map_location=self.device, weights_only=True)
                self.agent.load_state_dict(ck["agent"])
                self.algo.load_state_dict(ck["algo"])
                counters = (ck["version"], ck["env_steps"], ck["updates"], ck["episodes_seen"], ck["dropped"],
                            ck["wall_s"], list(ck["returns"]), list(ck.get("lengths", ())))
            except Exception as e:  # truncated zip, unpickling error, missing key, shape mismatch...
                errors.append(f"{path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                log.warning("cannot resume from %s (%s); trying the previous checkpoint", path, errors[-1])
                continue
            (self.version, self.env_steps, self.updates, self.episodes_seen, self.dropped, self.wall_before,
             returns, lengths) = counters
            self.returns.extend(returns)
            self.lengths.extend(lengths)
            self.steps_at_progress, self.updates_at_progress = self.env_steps, self.updates
            self.wall_at_progress = self.wall_before
            log.info("resumed from %s: version %d, %d env steps, %d updates", path, self.version, self.env_steps,
                     self.updates)
            return True
        if errors:
            raise RuntimeError("no checkpoint of this run can be loaded (" + "; ".join(errors) +
                               "); move them away to start the learner afresh")
        return False

    def write_result(self, reason: str) -> dict:
        to_target = None if self.t_first_batch is None else time.monotonic() - self.t_first_batch
        result = {"reason": reason, "env_steps": self.env_steps, "updates": self.updates,
                  "policy_version": self.version, "mean_return": self.mean_return(), "episodes": self.episodes_seen,
                  "wall_s": round(self.wall_s(), 2), "first_batch_to_end_s": to_target}
        if self.run_dir is not None and self.leads:
            (self.run_dir / RESULT).write_text(json.dumps(result, indent=1))
        if self.tb is not None:
            self.tb.close()
        return result


def lock_run(run_dir: Path, rank: int = 0):
    """Hold ``<run_dir>/learner<rank>.lock`` for this process's life; RuntimeError if another
    learner of the run holds it. Returns the open lock file (keep a reference)."""
    f = open(run_dir / LOCK.format(rank=rank), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise RuntimeError(f"another learner (pid {holder}) runs for {run_dir}: one learner per run; "
                           "stop it first (rlpipe stop)") from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


def run_loop(learner: Learner, slots: list, source: BatchSource, params: ParamSink) -> dict:
    """Train until the run is finished; returns the result. ``params``: a sink that publishes
    nothing on ranks other than 0."""
    if learner.group is not None:
        learner.decide()
    params.publish(learner.version, learner.env_steps)
    for i in range(len(slots)):
        source.request(i, learner.min_version())
    try:
        while True:
            reason = learner.finished()
            if reason is not None:
                break
            t0 = time.perf_counter()
            item = source.next(REANNOUNCE_MS)
            if learner.m is not None:
                learner.m.batch_wait.inc(time.perf_counter() - t0)
            if item is None:
                params.publish(learner.version, learner.env_steps)  # re-announce for action-servers that (re)started meanwhile
                if learner.group is not None:
                    learner.group.check_peers()  # a rank waiting for its share of a batch a lost peer never asks for
                continue
            i, meta = item
            priorities = learner.train(slots[i], meta)
            if priorities is not None and "keys" in meta:
                source.update_priorities(meta, priorities)
            source.request(i, learner.min_version())  # first: replay fills the slot while we publish
            params.publish(learner.version, learner.env_steps)
            learner.maybe_report()
            learner.maybe_checkpoint()
    except SystemExit:  # SIGTERM (rlpipe stop): keep what was learned for `launch --resume`
        learner.maybe_checkpoint(force=True)
        raise
    learner.maybe_report(force=True)
    learner.maybe_checkpoint(force=True)
    return learner.write_result(reason)
