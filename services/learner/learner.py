"""The learner: batches in, updates, parameter versions out; progress, checkpoints, the end.

It owns ``prefetch`` batch slots (shared memory in the pipeline). Replay fills a slot on
request; the learner trains on one slot while the next fills (double buffering), then asks
for that slot again. After each update it publishes a new parameter version. It keeps the
run's counters (env steps, episodes, versions) and checkpoints them with the model and
optimizer, so a learner killed and restarted resumes where its last checkpoint stood. The
checkpoint before that is kept beside it: a latest one that cannot be loaded (truncated by
a full disk, say) is reported and the previous one is used. A lock file in the run
directory (``runtime.process.lock_service``) keeps a second learner of the same run and rank
from starting (it would take over the first one's segments).

Data-parallel ranks (``learner.count`` > 1, ``shared.transport.ranks``): each rank trains on its share
of every batch, and their gradient steps average the gradients, so all hold the same
parameters; every ``CHECK_EVERY`` updates they compare checksums and stop on a difference.
Rank 0 alone publishes versions and writes progress, checkpoints and the result; whether
the run is over is its decision, sent to the others after each update. All ranks resume
from the same checkpoint.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from pathlib import Path
from typing import Protocol

import torch

from shared.config.schema import Experiment
from shared.data.namedarraytuple import torchify
from shared.transport.ranks import Group
from shared.algos import optim
from shared.algos.update import Update

from services.learner.checkpoints import Checkpoints
from services.learner.wandb_run import WandbRun
from services.learner.progress import COUNTERS, PROGRESS_FIELDS, Progress  # noqa: F401
from services.learner.snapshots import PoolSnapshots
from services.learner.stopping import Stopping
from shared.runtime.files import WriteErrors, publish
from shared.runtime import heartbeat
from shared.runtime.metrics import PHASES, Phases
from shared.runtime.runfiles import RESULT

log = logging.getLogger(__name__)


def cpu_emulates_bf16() -> bool:
    """Whether this x86 CPU lacks bf16 instructions, so that bf16 matrix products run emulated
    (docs/benchmarks.md, "Learner step"); False where torch cannot tell (an older torch without
    ``torch.cpu.get_capabilities``, or not x86)."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return caps.get("architecture") == "x86_64" and not (caps.get("avx512_bf16") or caps.get("amx_bf16"))


RESULT_TRIES = 120
"""Seconds the learner tries to write its result on a full disk before it gives up (exit 1)."""
# While no batch comes, the current version is re-announced this often: a PUB message sent
# before an action-server's SUB finished connecting is lost, and with stale parameters
# its samplers' segments would only be dropped for policy lag.
REANNOUNCE_MS = 500
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
    """Training: batches in, updates, parameter versions out. Its parts: ``progress`` (the
    run's counters and progress rows), ``stopping`` (when the run is over) and
    ``checkpoints`` (the model, the optimizer and the counters on disk; None without a run
    directory)."""

    def __init__(self, exp: Experiment, agent: torch.nn.Module, algo, device: torch.device, run_dir: Path | None,
                 metrics=None, group: Group | None = None):
        """``group``: this learner's place among data-parallel ranks (None: the only learner);
        ``algo``: None to ``attach`` it later (after ``resume``), once version 0 is out."""
        self.agent, self.algo, self.device, self.m, self.group = agent, algo, device, metrics, group
        self.bf16 = exp.learner.autocast == "bf16"
        if self.bf16 and device.type == "cpu" and cpu_emulates_bf16():
            log.warning("learner.autocast = bf16 on a CPU without bf16 instructions (no avx512_bf16 or amx_bf16): "
                        "torch emulates its bf16 products, many times slower than fp32 "
                        '(docs/benchmarks.md, "Learner step"); set learner.autocast = off here')
        self.pending_algo_state: dict | None = None  # a checkpoint's, for an algorithm attached later
        self.max_policy_lag, self.max_env_steps = exp.replay.max_policy_lag, exp.run.max_env_steps
        # The wall-clock the schedules anneal over (run.schedule_by): inf, so that it never leads, unless by budget.
        self.schedule_wall_s = exp.run.max_wall_s if exp.run.schedule_by == "budget" else math.inf
        self.log_interval_s, self.checkpoint_interval_s = exp.run.log_interval_s, exp.learner.checkpoint_interval_s
        self.run_dir = run_dir
        self.leads = group is None or group.rank == 0  # publishes, reports, checkpoints
        reports = run_dir if self.leads else None
        wandb = WandbRun(exp.logging, reports) if reports is not None and exp.logging.to_wandb else None
        count = (lambda what: None) if metrics is None else (lambda what: metrics.write_errors.labels(file=what).inc())
        self.errors = WriteErrors(count)  # files of the run directory it cannot write (a full disk)
        # Where the learner's time goes: Prometheus's counter where there are metrics, and the
        # progress rows' time/ scalars in any case (serial mode too).
        self.clock = Phases(PHASES["learner"]) if metrics is None else metrics.time
        # Self-play against a pool of past versions: rank 0 adds the snapshots and keeps the scores.
        self.pool = PoolSnapshots(exp.selfplay, run_dir, agent) if exp.selfplay.on and reports is not None else None
        self.progress = Progress(exp.run.return_window, reports, wandb, self.errors, self.clock, exp.run,
                                 None if self.pool is None else self.pool.scores)
        self.stopping = Stopping(exp.run, self.progress, group)
        self.checkpoints = None if run_dir is None else Checkpoints(run_dir)
        self.identical_at: tuple[int, int] | None = None  # (update, checksum) of the ranks' last comparison
        self.version = 0
        self.last_stats: dict[str, float] = {}
        self.skipped_steps = 0  # gradient steps skipped for a non-finite loss or gradient norm
        self._tensors: list[torch.Tensor] | None = None  # the agent's floating-point parameters and buffers
        self.t_first_batch: float | None = None
        self.t_progress = 0.0
        self.t_checkpoint = time.monotonic()

    @property
    def env_steps(self) -> int:
        return self.progress.env_steps

    @env_steps.setter
    def env_steps(self, value: int) -> None:
        self.progress.env_steps = value

    def fraction_done(self) -> float:
        """The run's fraction done that the algorithm's schedules follow (``run.schedule_by``): env
        steps of the budget, or the nearer of that and the wall-clock's."""
        return min(1.0, max(self.env_steps / self.max_env_steps, self.progress.wall_s() / self.schedule_wall_s))

    # ------------------------------------------------------------ training

    def train(self, slot, meta: dict):
        """One update on a filled batch slot (numpy views); counters from replay's ``meta``.

        Returns the algorithm's new priorities for the batch's items, or None.
        """
        if self.t_first_batch is None:
            self.t_first_batch = time.monotonic()
        self.progress.record_batch(meta)
        batch = torchify(slot, self.device)
        versions = slot.samples.policy_version if "samples" in slot else slot.policy_version
        lag = float(self.version - versions.mean())
        t0 = time.perf_counter()
        skipped, taken = optim.skipped_steps(), optim.taken_steps()
        # Autocast casts only the ops on its lists (matmuls, convolutions) to bf16: the fp32
        # parameters get fp32 gradients through the casts, and the optimizer's step is no such op.
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            update: Update = self.algo.update(batch, self.fraction_done())
        skipped, taken = optim.skipped_steps() - skipped, optim.taken_steps() - taken
        if skipped:
            self._count_skipped(skipped)
        # The observations the batch's statistics came from were acted on with the normaliser as
        # it was: the update sees them so too, and the next version carries both.
        if meta.get("obs_count") and self.agent.obs_norm is not None:
            self.agent.obs_norm.update(meta["obs_count"], meta["obs_sum"], meta["obs_sumsq"])
        if self._tensors is None:  # updated in place ever after (optimizers, load_state_dict)
            self._tensors = [t for t in itertools.chain(self.agent.parameters(), self.agent.buffers())
                             if t.is_floating_point()]
        if self._tensors and not self._finite():
            bad = non_finite(self.agent.state_dict())
            # Raised before publish and checkpoint: the restarted learner resumes from the last good checkpoint.
            raise RuntimeError(f"learner: {', '.join(bad[:3])} not finite after update {self.progress.updates + 1}; "
                               "these parameters are neither published nor checkpointed")
        self.last_stats = update.stats
        self.progress.record_update(update.stats, lag, skipped=bool(skipped) and not taken)
        self.version += 1
        if self.pool is not None:
            self.pool.after_update(self.version, self.progress.updates)
        if self.group is not None:
            updates = self.progress.updates
            if updates % CHECK_EVERY == 0:
                self.identical_at = (updates, self.group.check_identical(self.agent, f"after update {updates}"))
            self.stopping.decide()
        if self.m is not None:
            self.m.update_time.inc(time.perf_counter() - t0)
            self.m.updates.inc()
            self.m.env_steps.set(self.env_steps)
            self.m.policy_version.set(self.version)
            self.m.policy_lag.set(lag)
            if self.progress.returns:
                self.m.mean_return.set(self.progress.mean_return())
            for term, value in update.stats.items():
                self.m.loss.labels(term=term).set(float(value))
        return update.priorities

    def _finite(self) -> bool:
        """Whether the agent's parameters and buffers are all finite: their sum is (a NaN or an
        infinity makes it NaN or infinite). One concatenation, one sum and one read back an
        update: cheaper than a foreach max-norm (docs/benchmarks.md, "Finiteness checks")."""
        with torch.no_grad():
            return math.isfinite(torch.cat([t.reshape(-1) for t in self._tensors]).sum().item())

    def _count_skipped(self, n: int) -> None:
        self.skipped_steps += n
        if self.m is not None:
            self.m.skipped_steps.inc(n)
        if self.skipped_steps.bit_length() > (self.skipped_steps - n).bit_length():  # at 1, 2, 4, 8...: cannot flood
            log.error("learner: %d gradient step(s) skipped in update %d, %d so far: loss or gradient norm not "
                      "finite (a non-finite value in the batch?)", n, self.progress.updates + 1, self.skipped_steps)

    def min_version(self) -> int:
        """Oldest policy version a batch may hold (the on-policy lag bound; replay drops older)."""
        return max(0, self.version - self.max_policy_lag)

    def finished(self) -> str | None:
        return self.stopping.finished()

    # ------------------------------------------------------------ reporting and checkpoints

    def maybe_report(self, force: bool = False) -> dict | None:
        """A progress row every ``log_interval_s``; ``force`` (the run's end): now, unless this
        incarnation's last row already holds every env step and update (the periodic row can fall
        on the run's last update: a second row would repeat it)."""
        if not force and time.monotonic() - self.t_progress < self.log_interval_s:
            return None
        if force and self.progress.row_is_current():
            return None
        was = self.clock.to("report")
        try:
            return self._report()
        finally:
            self.clock.to(was)

    def _report(self) -> dict:
        self.t_progress = time.monotonic()
        row = self.progress.row(self.version)
        if not self.leads:
            self.progress.diag_sums.clear()
            self.progress.diag_updates = 0
            return row
        pool_rows = self.progress.write(row)  # the evaluator writes its own scalars
        if self.m is not None and self.pool is not None and self.progress.pool_outcomes:
            for outcome in ("win", "draw", "loss"):
                self.m.pool_outcome.labels(outcome=outcome).set(row[f"pool_{outcome}"])
            self.m.pool_elo.set(row["pool_elo"])
            self.m.pool_best_elo.set(row["pool_best_elo"])
            self.m.pool_best_version.set(row["pool_best_version"])
        if self.m is not None and self.pool is not None:  # a version is rated from its entry on, before its games
            self.m.pool_version_elo.replace({str(r["version"]): r["elo"] for r in pool_rows})
        if self.identical_at is not None:
            log.info("parameters identical on %d ranks at update %d (crc32 %08x)", self.group.world, *self.identical_at)
            self.identical_at = None
        return row

    def maybe_checkpoint(self, force: bool = False) -> None:
        if self.checkpoints is None or not self.leads:
            return
        if not force and time.monotonic() - self.t_checkpoint < self.checkpoint_interval_s:
            return
        was = self.clock.to("checkpoint")
        try:
            self._checkpoint()
        finally:
            self.clock.to(was)

    def _checkpoint(self) -> None:
        self.t_checkpoint = time.monotonic()
        state = {"agent": self.agent.state_dict(), "algo": self.algo.state_dict()}
        bad = non_finite(state)
        if bad:
            log.error("learner: not checkpointing version %d: %s not finite; the last checkpoint stays",
                      self.version, ", ".join(bad[:3]))
            return
        heartbeat.phase("writing a checkpoint")
        if self.pool is not None:
            self.pool.save_scores()
        try:
            self.checkpoints.save({**state, "version": self.version, **self.progress.state()})
        except OSError as e:  # a full disk: the checkpoints so far stay, the next interval tries again
            self.errors.failed("checkpoint", e)
            return
        finally:
            heartbeat.phase("training")
        self.errors.ok("checkpoint")

    def resume(self) -> bool:
        """Load the latest checkpoint of this run, or the previous one if the latest cannot be
        loaded; False if there is none. RuntimeError naming both files if neither loads."""
        if self.checkpoints is None:
            return False

        def apply(ck: dict) -> None:
            counters = {name: ck[name] for name in (*COUNTERS, "returns", "wall_s")}  # all there, or none is taken
            counters["lengths"] = ck.get("lengths", ())
            counters["skipped_updates"] = ck.get("skipped_updates", 0)
            self.agent.load_state_dict(ck["agent"])
            if self.algo is None:
                self.pending_algo_state = ck["algo"]
            else:
                self.algo.load_state_dict(ck["algo"])
            self.version = ck["version"]
            self.progress.load_state(counters)

        path = self.checkpoints.load(self.device, apply)
        if path is None:
            return False
        log.info("resumed from %s: version %d, %d env steps, %d updates", path, self.version, self.env_steps,
                 self.progress.updates)
        return True

    def attach(self, algo) -> None:
        """The algorithm, built after ``resume`` (its optimizer's first use imports torch._dynamo:
        ~1.4 s of CPU the samplers need not wait for); it takes the resumed checkpoint's state."""
        self.algo = algo
        if self.pending_algo_state is not None:
            algo.load_state_dict(self.pending_algo_state)
            self.pending_algo_state = None

    def write_result(self, reason: str) -> dict:
        p = self.progress
        # wall_s is the last progress row's (run_loop reports one just before): one clock for the
        # row, result.json and the command's last line.
        to_target = None if self.t_first_batch is None else time.monotonic() - self.t_first_batch
        result = {"reason": reason, "env_steps": p.env_steps, "updates": p.updates, "policy_version": self.version,
                  "mean_return": p.mean_return(), "episodes": p.episodes_seen, "wall_s": round(p.wall_at_row, 2),
                  "first_batch_to_end_s": to_target, "skipped_updates": p.skipped_updates}
        if reason == "failed":
            result["error"] = (f"the last {p.skipped_in_a_row} updates (run.max_skipped_updates) learned nothing: "
                               "every gradient step was skipped for a non-finite loss or gradient norm (a NaN or "
                               "an infinity in the batch, the loss or the config?)")
            log.error("learner: run failed: %s", result["error"])
        p.close()  # first: with result.json there, TensorBoard's and W&B's files are complete
        if self.run_dir is not None and self.leads:
            self._write_result(result)
        return result

    def _write_result(self, result: dict, tries: int = RESULT_TRIES) -> None:
        """result.json, published whole (the follower ends at it); on a full disk tried once a
        second (the other files written first, so freed space goes here), then OSError."""
        tmp = self.run_dir / (RESULT + ".tmp")
        for attempt in range(tries):
            try:
                self.progress.write_rows()
                tmp.write_text(json.dumps(result, indent=1))
                publish(tmp, self.run_dir / RESULT)
                return
            except OSError as e:
                tmp.unlink(missing_ok=True)
                self.errors.failed(RESULT, e)
                if attempt == tries - 1:
                    raise
                heartbeat.beat()
                time.sleep(1.0)


def non_finite(state, prefix: str = "") -> list[str]:
    """The names of the floating-point tensors in ``state`` (a state dict, nested dicts and
    lists of them) that hold a NaN or an infinity."""
    if isinstance(state, torch.Tensor):
        return [prefix or "tensor"] if state.is_floating_point() and not bool(torch.isfinite(state).all()) else []
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return []
    return [name for key, value in items for name in non_finite(value, f"{prefix}.{key}" if prefix else str(key))]


def run_loop(learner: Learner, slots: list, source: BatchSource, params: ParamSink) -> dict:
    """Train until the run is finished; returns the result. ``params``: a sink that publishes
    nothing on ranks other than 0."""
    heartbeat.phase("training")
    if learner.group is not None:
        learner.stopping.decide()
    if learner.pool is not None:
        learner.pool.start(learner.version)
    params.publish(learner.version, learner.env_steps)
    for i in range(len(slots)):
        source.request(i, learner.min_version())
    try:
        while True:
            heartbeat.beat()
            reason = learner.finished()
            if reason is not None:
                break
            learner.clock.to("batch")
            t0 = time.perf_counter()
            item = source.next(REANNOUNCE_MS)
            if learner.m is not None:
                learner.m.batch_wait.inc(time.perf_counter() - t0)
            learner.clock.to("publish")
            if item is None:
                params.publish(learner.version, learner.env_steps)  # re-announce for action-servers that (re)started meanwhile
                if learner.group is not None:
                    learner.group.check_peers()  # a rank waiting for its share of a batch a lost peer never asks for
                continue
            i, meta = item
            learner.clock.to("update")
            priorities = learner.train(slots[i], meta)
            learner.clock.to("publish")
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
