"""Hyperparameter search with Optuna: ``rlpipe tune CONFIG --param section.key=DIST ... --trials N``.

Each trial is a normal run of the config with the trial's values as ``--set`` overrides, started
K at a time by ``grid.Launcher`` (the machinery of ``rlpipe grid``) under a tune directory
``<runs_dir>/tune_<name>_<stamp>`` (or ``--out``), which also holds the Optuna study
(``study.db``, sqlite: ``optuna-dashboard sqlite:///DIR/study.db`` opens it), ``summary.md`` (a
row a trial) and ``best.toml`` (the config with the best trial's values, ready for ``rlpipe
launch``).

- Sampler: TPE, seeded (``--seed``), with the constant liar so that trials running side by side
  do not all try the same region.
- Pruning: the median rule on the learning curve. A trial reports its return (the progress
  rows' ``mean_return``, the mean over the last ``run.return_window`` episodes) at fixed env-step
  checkpoints, every ``run.max_env_steps / CHECKPOINTS`` steps; progress rows come every
  ``run.log_interval_s`` seconds and so at different env steps in each run, and the median rule
  compares trials at the same step. Past the first quarter of the budget (and short of its end), a
  trial whose return at a checkpoint is below the median of the finished trials' returns there is stopped
  (``follow.StopFollowing``: its run is stopped like any other, and leaves nothing running).
- Objective (maximised), ``--metric``: ``final``, the learner's mean return over its last
  ``run.return_window`` episodes when the run ended (its result.json); ``auc``, the mean of the
  returns at the checkpoints (the area under the learning curve, so learning early counts), a
  run that ended before its budget (at ``run.target_return``, or ``run.max_wall_s``) counting its
  final return for the checkpoints it did not reach. Only runs that ended as configured (target, budget, wall) count;
  a crashed run is a failed trial.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import math
import os
import sys
import threading
from datetime import datetime
from pathlib import Path

from shared.config import checks, loading
from shared.config.schema import ConfigError
from shared.launch import backend, follow, rundirs
from shared.launch.lab import runs
from shared.launch.lab.grid import FINISHED, Launcher, default_parallel, literal, run_experiment
from shared.launch.rundirs import read_result

DISTRIBUTIONS = ("loguniform", "uniform", "int", "choice")
METRICS = ("final", "auc")
STUDY_DB = "study.db"
STUDY_LOCK = "study.db.lock"
"""Held (flock) by the one ``rlpipe tune`` writing the study beside it; it holds that tune's pid."""
SUMMARY = "summary.md"
BEST_CONFIG = "best.toml"
CHECKPOINTS = 20
"""Env-step checkpoints of the budget at which a trial reports its return to the pruner."""
WARMUP = 0.25
"""Fraction of the budget before which no trial is pruned (early returns say little)."""
EXTRA = "pip install 'rlpipe[tune]' (optuna>=3.6)"


class StudyInUse(RuntimeError):
    """Another ``rlpipe tune`` writes the study of this tune directory; str() is one line naming it."""


class MissingExtra(RuntimeError):
    """A package of an optional extra is not installed; str() names the extra to install."""


def optuna():
    """The optuna module, or MissingExtra naming the extra."""
    try:
        import optuna as module
    except ImportError:
        raise MissingExtra(f"rlpipe tune needs optuna, which is not installed: {EXTRA}") from None
    return module


@dataclasses.dataclass(frozen=True)
class Param:
    """One ``--param``: a config field and the distribution its values are drawn from."""
    key: str
    """``section.key`` of the config field, also the parameter's name in the study."""
    kind: str
    """One of DISTRIBUTIONS."""
    low: float = 0.0
    high: float = 0.0
    """Bounds (inclusive) of loguniform, uniform and int."""
    choices: tuple = ()
    """The values of choice (numbers, strings, booleans), as TOML reads them."""
    texts: tuple[str, ...] = ()
    """The choices as given (TOML literals or plain strings), for the override."""

    def suggest(self, trial):
        """The trial's value of this parameter (drawn by the study's sampler)."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high))
        return trial.suggest_float(self.key, self.low, self.high, log=self.kind == "loguniform")

    def override(self, value) -> str:
        """``section.key=value`` for ``loading.apply_overrides``."""
        if self.kind == "choice":
            return f"{self.key}={next(t for c, t in zip(self.choices, self.texts) if type(c) is type(value) and c == value)}"
        return f"{self.key}={value!r}"

    def extremes(self) -> list:
        """The values a config must accept for every trial of this parameter to be valid: its
        bounds, or every choice."""
        if self.kind == "choice":
            return list(self.choices)
        if self.kind == "int":
            return [int(self.low), int(self.high)]
        return [self.low, self.high]


def parse_param(text: str) -> Param:
    """A ``section.key=DIST`` spec: ``loguniform:LOW:HIGH``, ``uniform:LOW:HIGH``,
    ``int:LOW:HIGH`` or ``choice:V1,V2,...`` (TOML literals, no commas inside one).
    ConfigError (one line naming the spec and the fix) if it does not parse."""
    where = f"--param {text!r}"
    key, sep, spec = text.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(f"{where}: expected section.key=DISTRIBUTION:ARGS, e.g. algo.lr=loguniform:1e-4:3e-3")
    kind, _, args = spec.strip().partition(":")
    if kind not in DISTRIBUTIONS:
        raise ConfigError(f"{where}: unknown distribution {kind!r} (known: {', '.join(DISTRIBUTIONS)}; e.g. "
                          f"{key}=uniform:0.9:0.99 or {key}=choice:1,2,4)")
    if kind == "choice":
        texts = tuple(t.strip() for t in args.split(","))
        if not args or not all(texts):
            raise ConfigError(f"{where}: expected choice:V1,V2,... with no empty value, e.g. {key}=choice:1,2,4")
        choices = tuple(literal(t) for t in texts)
        if not all(isinstance(c, (bool, int, float, str)) for c in choices):
            raise ConfigError(f"{where}: a choice must be a number, a string or a boolean")
        if len(set(zip(map(type, choices), choices))) != len(choices):
            raise ConfigError(f"{where}: a value is given twice")
        return Param(key, kind, choices=choices, texts=texts)
    bounds = args.split(":")
    number = int if kind == "int" else float
    try:
        if len(bounds) != 2:
            raise ValueError
        low, high = (number(b) for b in bounds)
    except ValueError:
        raise ConfigError(f"{where}: expected {kind}:LOW:HIGH with {'integer' if kind == 'int' else 'number'} "
                          f"bounds, e.g. {key}={kind}:{'1:8' if kind == 'int' else '1e-4:3e-3'}") from None
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ConfigError(f"{where}: LOW must be below HIGH (both finite)")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{where}: loguniform needs LOW > 0 (use uniform for a range from 0 or below)")
    return Param(key, kind, low, high)


def parse_params(items: list[str]) -> list[Param]:
    """Every ``--param``; at least one, each field once."""
    if not items:
        raise ConfigError("give at least one --param section.key=DIST, e.g. --param algo.lr=loguniform:1e-4:3e-3")
    params = [parse_param(item) for item in items]
    keys = [p.key for p in params]
    for key in keys:
        if keys.count(key) > 1:
            raise ConfigError(f"--param {key} is given twice: give each field one distribution")
    return params


def check_params(config: str, overrides: list[str], params: list[Param]) -> None:
    """ConfigError unless the config takes every parameter at each of its ``extremes`` (the field
    exists, has the type and lies in its allowed range): before any trial starts."""
    for p in params:
        for value in p.extremes():
            try:
                loading.load(config, [*overrides, p.override(value)])
            except ConfigError as e:
                raise ConfigError(f"--param {p.key}={p.kind}: at {value!r}: {e}") from None


class Checkpoints:
    """A run's return at the env-step checkpoints ``every, 2 every, ...`` from its progress rows:
    each checkpoint takes the first row at or past it that has a return."""

    def __init__(self, every: int):
        self.every = every
        self.values: list[float] = []
        """The return at checkpoint i+1."""

    def add(self, row: dict) -> list[tuple[int, float]]:
        """The (env step, return) checkpoints ``row`` (a progress row) completes."""
        value = float(row["mean_return"])
        if not math.isfinite(value):  # no episode has ended yet
            return []
        new = []
        while (len(self.values) + 1) * self.every <= int(row["env_steps"]):
            self.values.append(value)
            new.append((len(self.values) * self.every, value))
        return new

    def area(self, final: float, count: int) -> float:
        """The mean return over ``count`` checkpoints, those not reached at ``final``."""
        values = self.values[:count]
        return (sum(values) + final * (count - len(values))) / count


class Tune:
    """``trials`` runs of one config with parameters drawn by Optuna, K at a time; see ``run``."""

    def __init__(self, config: str, overrides: list[str], params: list[Param], trials: int,
                 parallel: int | None = None, out_dir: str | None = None, metric: str = "final", seed: int = 0,
                 startup_trials: int = 5, out=None):
        self.optuna = optuna()
        base = loading.load(config, overrides)
        check_params(config, overrides, params)
        if trials < 1:
            raise ConfigError(f"--trials {trials}: must be >= 1")
        if metric not in METRICS:
            raise ConfigError(f"--metric {metric!r}: expected one of {', '.join(METRICS)}")
        if startup_trials < 0:
            raise ConfigError(f"--startup-trials {startup_trials}: must be >= 0")
        stamp = datetime.now().strftime("%Y%m%dT%H%M%S")
        self.dir = (Path(out_dir) if out_dir else
                    Path(base.run.runs_dir) / f"tune_{rundirs.safe_name(base.run.name)}_{stamp}").resolve()
        self.config, self.overrides, self.params, self.trials = config, overrides, params, trials
        self.name, self.metric, self.seed, self.startup_trials = base.run.name, metric, seed, startup_trials
        self.budget = base.run.max_env_steps
        self.every = max(1, self.budget // CHECKPOINTS)
        self.launcher = Launcher(parallel or default_parallel(checks.resolve_inference(base)[0]), out)
        self.lock = threading.Lock()  # one trial at a time talks to the study (its sqlite storage)

    @property
    def storage(self) -> str:
        return f"sqlite:///{self.dir / STUDY_DB}"

    def run(self) -> list[dict]:
        """Every trial, K at a time; a trial whose run fails is a failed trial and the others go
        on. Writes the summary (a row a trial of this call: its number, state, value, parameters,
        why its run ended, env steps, wall time, run directory) and the best trial's config
        (BEST_CONFIG, over every trial of the study); returns the rows. Ctrl-C (and SIGTERM,
        SIGHUP: ``cli``) or a crash stops the live runs, fails their trials and starts no more.
        StudyInUse if another tune writes this directory's study."""
        rundirs.make_runs_dir(self.dir)  # --out of an earlier tune: its study goes on
        with self._only_writer():
            return self._run()

    @contextlib.contextmanager
    def _only_writer(self):
        """Hold STUDY_LOCK while inside, or StudyInUse at once: two tunes writing one study
        would see each other's trials as running and end late in sqlite's "database is locked"."""
        with open(self.dir / STUDY_LOCK, "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                holder = lock.read().strip() or "?"
                raise StudyInUse(f"{self.dir / STUDY_DB} is being written by another rlpipe tune (pid {holder}): "
                                 "wait for it to end, or give this one another --out") from None
            lock.truncate(0)
            lock.write(str(os.getpid()))
            lock.flush()
            yield

    def _end_orphans(self, study) -> None:
        """What a tune killed outright (SIGKILL: nothing of it could clean up) left: its trials'
        runs still going are stopped, its trials still RUNNING in the study are failed. With
        STUDY_LOCK held, no other tune runs them."""
        for run_dir in sorted(self.dir.glob("trial_*")):
            runner = backend.for_run(run_dir)
            if runner.running(run_dir):
                self._say(f"{run_dir.name}: left running by an earlier tune: stopping it")
                runner.stop(run_dir)
        for trial in study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.RUNNING,)):
            self._say(f"trial {trial.number}: left running by an earlier tune: failed")
            study.tell(trial.number, state=self.optuna.trial.TrialState.FAIL)

    def _run(self) -> list[dict]:
        optuna = self.optuna
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # each trial's line is ours
        study = optuna.create_study(
            storage=self.storage, study_name=self.name, direction="maximize", load_if_exists=True,
            sampler=optuna.samplers.TPESampler(seed=self.seed, constant_liar=True),
            pruner=optuna.pruners.MedianPruner(n_startup_trials=self.startup_trials,
                                               n_warmup_steps=int(self.budget * WARMUP)))
        self._end_orphans(study)
        self._say(f"tune {self.dir}: {self.trials} trial(s) of {', '.join(p.key for p in self.params)}, "
                  f"{self.launcher.parallel} at a time, objective: {self.metric} return; study {self.storage}")
        rows = [r for r in self.launcher.map(lambda _: self._trial(study), range(self.trials)) if "trial" in r]
        rows.sort(key=lambda r: r["trial"])
        table = runs.markdown_table(rows, self.columns)
        (self.dir / SUMMARY).write_text(table + "\n")
        self._say(table)
        self._write_best(study)
        return rows

    @property
    def columns(self) -> tuple[str, ...]:
        return ("trial", "state", "value", *(p.key for p in self.params), "reason", "env_steps", "wall_s", "run")

    def _trial(self, study) -> dict:
        if self.launcher.stopping.is_set():
            return {}
        states = self.optuna.trial.TrialState
        with self.lock:
            trial = study.ask()
            values = {p.key: p.suggest(trial) for p in self.params}
        label = f"trial {trial.number}"
        row = {"trial": trial.number, **{k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in values.items()}}
        try:
            exp = run_experiment(self.config, [*self.overrides, *(p.override(values[p.key]) for p in self.params)],
                                 self.dir, f"trial_{trial.number}")
        except ConfigError as e:  # a combination of values the config cannot build
            self._say(f"{label}: config error: {e}")
            with self.lock:
                study.tell(trial, state=states.FAIL)
            return {**row, "state": "FAIL", "reason": "config error"}
        checkpoints = Checkpoints(self.every)

        def report(progress_row: dict) -> None:
            for step, value in checkpoints.add(progress_row):
                with self.lock:
                    trial.report(value, step)
                    # At the budget's end the run ends anyway: it finishes and counts.
                    prune = step < self.budget and trial.should_prune()
                if prune:
                    raise follow.StopFollowing("pruned")

        try:
            run_dir, reason = self.launcher.run(exp, f"trial_{trial.number}", label, report)
        except BaseException:  # no free port, a full disk: the study must not keep it as running
            with self.lock:
                study.tell(trial, state=states.FAIL)
            raise
        result = read_result(run_dir)
        if reason == "pruned" and result is not None:  # its run ended on its own before the stop
            reason = result["reason"]
        final = result["mean_return"] if result and reason in FINISHED else float("nan")
        value = checkpoints.area(final, CHECKPOINTS) if self.metric == "auc" else final
        state = "PRUNED" if reason == "pruned" else "COMPLETE" if math.isfinite(value) else "FAIL"
        with self.lock:
            trial.set_user_attr("run", str(run_dir))
            trial.set_user_attr("reason", reason)
            study.tell(trial, value if state == "COMPLETE" else None, state=states[state])
        summary = runs.summary(run_dir)
        row = {**row, "state": state, "value": round(value, 2) if math.isfinite(value) else "", "reason": reason,
               "env_steps": summary["env_steps"], "wall_s": summary["wall_s"], "run": run_dir.name}
        self._say(f"{label}: {state.lower()} ({reason}), value {row['value'] or '-'} after {row['env_steps']} env "
                  f"steps in {row['wall_s']} s")
        return row

    def _write_best(self, study) -> None:
        """BEST_CONFIG from the study's best trial, or say there is none."""
        complete = [t for t in study.trials if t.state == self.optuna.trial.TrialState.COMPLETE]
        if not complete:
            self._say("no trial completed: no best config")
            return
        best = study.best_trial
        by_key = {p.key: p for p in self.params}
        chosen = [by_key[k].override(v) for k, v in best.params.items() if k in by_key]
        exp = loading.load(self.config, [*self.overrides, *chosen])
        header = (f"# rlpipe tune {self.dir}: trial {best.number} of {len(study.trials)}, {self.metric} return "
                  f"{best.value:.2f}\n# " + " ".join(chosen) + "\n\n")
        path = self.dir / BEST_CONFIG
        path.write_text(header + loading.dumps(exp))
        self._say(f"best: trial {best.number}, {self.metric} return {best.value:.2f}: {' '.join(chosen)}")
        self._say(f"best config: {path} (rlpipe launch {path})")

    def _say(self, line: str) -> None:
        self.launcher.say(line)
