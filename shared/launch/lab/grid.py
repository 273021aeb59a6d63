"""An experiment queue: every combination of config variants and seeds, run K at a time,
each under its own supervisord, then a summary table and a learning-curve plot per variant.

A grid directory ``<runs_dir>/grid_<name>_<stamp>`` holds the runs (each named by its
variant and seed, plus the stamp and random suffix every run id has), ``summary.md`` (a row a
run), ``stats.md`` (each variant's final returns over its seeds: IQM and mean with 95%
stratified bootstrap intervals, ``stats.py``), one PNG per variant (its seeds) plus ``all.png``
(every variant), and ``profile.png`` (performance profiles) where the grid varies ``env.id``.

``grid.json`` (``gridfile``) records the grid and each job's run directory as it starts, so a
grid whose launcher was stopped (killed, a closed terminal, a time limit) goes on with
``rlpipe grid --resume DIR``: runs with a result are kept as they are, runs without one are
stopped if anything of them still runs and started again from their checkpoint (and replay
snapshot) in their own directory, and jobs never started start.
"""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import os
import sys
import threading
import tomllib
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from shared.config import checks, endpoints, loading
from shared.launch import backend, follow, rundirs, supervisor
from shared.launch.lab import gridfile
from shared.launch.lab import runs, stats
from shared.launch import space
from shared.config.schema import ConfigError, Experiment
from shared.runtime.runfiles import FOLLOW_LOG, LOGS_DIR, RUN_CONFIG

SUMMARY = "summary.md"
SUMMARY_COLUMNS = ("variant", "seed", "reason", "steps_to_target", "wall_s_to_target", "final_return", "env_steps",
                   "wall_s", "run")
FINISHED = ("target", "budget", "wall")
"""Reasons of runs that ended as configured: their final returns enter the statistics."""
STATS = "stats.md"
PROFILE = "profile.png"


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str
    """What sets it apart, e.g. ``lr=0.001,count=2`` (empty without --vary)."""
    overrides: tuple[str, ...]
    """``section.key=value`` strings applied over the base config."""

    @property
    def method(self) -> str:
        """The label without its env.id part: across envs (tasks) a grid compares its other axes."""
        return ",".join(part for part, o in zip(self.label.split(","), self.overrides) if not o.startswith("env.id="))


def parse_vary(items: list[str]) -> list[Variant]:
    """The product of ``section.key=v1,v2,...`` items (values are TOML literals; an array or an
    inline table is one value, e.g. ``model.hidden_sizes=[64,64],[256,256]``). Labels name a
    field by its key, or by section.key where two keys clash."""
    axes = []
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or key.count(".") != 1 or not values:
            raise ConfigError(f"--vary {item!r}: expected section.key=value1,value2,... e.g. algo.lr=1e-3,3e-4")
        axes.append((key.strip(), split_values(values)))
    short = [key.split(".")[1] for key, _ in axes]
    names = [s if short.count(s) == 1 else key for s, (key, _) in zip(short, axes)]
    return [Variant(",".join(f"{n}={_label(literal(v))}" for n, v in zip(names, combo)),
                    tuple(f"{key}={v}" for (key, _), v in zip(axes, combo)))
            for combo in itertools.product(*(values for _, values in axes))]


def split_values(text: str) -> list[str]:
    """``v1,v2,...`` split at the commas outside brackets, braces and quotes."""
    out, depth, quote, escaped, start = [], 0, None, False, 0
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif quote:
            escaped = quote == '"' and ch == "\\"  # a basic string's escape: the next character is not its end
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    return out + [text[start:].strip()]


def _label(value) -> str:
    """A value as a label shows it, without commas: they part a label's fields (``Variant.method``)."""
    if isinstance(value, dict):
        return "{" + ";".join(f"{k}={_label(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ";".join(_label(v) for v in value) + "]"
    return str(value).replace(",", ";")  # a string's own commas too (env.kwargs is JSON in a string)


def literal(text: str):
    """How a value reads in a label: 1e-3 -> 0.001, "'a'" -> a."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def processes_per_run(exp: Experiment) -> int:
    """The busy processes of a run, each one torch thread: its samplers, replay, the learner and
    (server inference) the action-servers; the metrics service mostly sleeps."""
    return exp.sampler.count + 2 + (exp.action_server.count if exp.sampler.inference == "server" else 0)


def default_parallel(exp: Experiment) -> int:
    """Runs of ``exp`` that fit this machine's cores side by side (at least 1)."""
    return max(1, len(os.sched_getaffinity(0)) // processes_per_run(exp))


class Ports:
    """Ports handed to the grid's live runs: each run gets its own metrics port and tcp block.

    A port is free to hand out only while no other grid or tune of this user holds it: each
    one handed out is claimed with an flock on ``<socket_base>/ports/<port>.lock`` until it is
    released, so two grids started at once (both finding a port unbound, because neither run
    has bound it yet) do not hand out the same one. The kernel drops a claim with the process
    that held it, so a launcher killed with ``kill -9`` leaves none behind."""

    def __init__(self):
        self.taken: dict[int, Any] = {}
        """port -> the open lock file that claims it."""
        self.lock = threading.Lock()

    def assign(self, exp: Experiment) -> Experiment:
        """``exp`` with network ports that are free now and not held by another run of the grid."""
        net = exp.network
        with self.lock:
            metrics = self._block(net.metrics_host, net.metrics_port, 1) if net.metrics_port else 0
            base = (self._block(net.host, net.base_port, len(endpoints.tcp_offsets(exp)))
                    if net.transport == "tcp" else net.base_port)
        return dataclasses.replace(exp, network=dataclasses.replace(net, metrics_port=metrics, base_port=base))

    def release(self, exp: Experiment) -> None:
        net = exp.network
        ports = [net.metrics_port] + (list(range(net.base_port, net.base_port + len(endpoints.tcp_offsets(exp))))
                                      if net.transport == "tcp" else [])
        with self.lock:
            for port in ports:
                held = self.taken.pop(port, None)
                if held is not None:
                    held.close()  # closing the file drops its flock

    def _block(self, host: str, start: int, count: int) -> int:
        for first in range(start, 65536 - count):
            claims = []
            for port in range(first, first + count):
                claim = None if port in self.taken or not endpoints.port_free(host, port) else _claim(port)
                if claim is None:
                    break
                claims.append((port, claim))
            else:
                self.taken.update(claims)
                return first
            for _, claim in claims:
                claim.close()
        raise ConfigError(f"no {count} free port(s) from {start} up on {host}")


def _claim(port: int):
    """The open lock file that claims ``port`` for this process, or None where another holds it."""
    base = endpoints.socket_base()
    locks = base / "ports"
    for d in (base, locks):  # the base first: made as a parent it would take the umask's mode
        rundirs.make_private_dir(d)
    f = open(locks / f"{port}.lock", "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


class Launcher:
    """Runs K at a time, each under its own supervisord with network ports of its own, each
    followed to its end and stopped; Ctrl-C stops the live ones and starts no more. ``rlpipe
    grid`` and ``rlpipe tune`` start their runs through one."""

    def __init__(self, parallel: int, out=None):
        self.parallel, self.out = parallel, out
        self.ports = Ports()
        self.live: set[Path] = set()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        """Set by Ctrl-C: a job that has not started its run yet should not."""

    def map(self, job: Callable[[Any], dict], items: list) -> list[dict]:
        """``job(item)`` for every item, ``parallel`` at a time; the results in the items' order
        (none for a job Ctrl-C cancelled before it began)."""
        with ThreadPoolExecutor(self.parallel) as pool:
            futures = [pool.submit(job, item) for item in items]
            try:
                for future in as_completed(futures):
                    future.result()  # a job's exception surfaces at once
            except BaseException as e:  # Ctrl-C (SIGTERM, SIGHUP: cli), or a job that crashed: no run is left going
                self.say("interrupted: stopping the live runs" if isinstance(e, KeyboardInterrupt) else
                         f"{type(e).__name__}: {e}: stopping the live runs")
                self.stopping.set()
                for future in futures:
                    future.cancel()
                with self.lock:
                    live = list(self.live)
                for run_dir in live:
                    backend.for_run(run_dir).stop(run_dir)
                if not isinstance(e, KeyboardInterrupt):
                    raise
            return [f.result() for f in futures if not f.cancelled()]

    def run(self, exp: Experiment, name: str, label: str, on_row: Callable[[dict], None] | None = None,
            on_start: Callable[[Path], None] | None = None) -> tuple[Path, str]:
        """Start ``exp`` (a ``run_experiment``) in a fresh run directory called ``name`` with ports
        no other live run holds, follow it to its end (``on_row`` sees each progress row and may
        end the run with ``follow.StopFollowing``) and stop it. The run directory and why the run
        ended (``_follow``); ``label`` names the run in what is printed; ``on_start`` gets the
        run directory before any of its services starts."""
        exp = self.ports.assign(exp)
        try:
            run_dir = rundirs.make_run_dir(exp, name)
            if on_start is not None:
                on_start(run_dir)
            reason = self._live(exp, run_dir, f"{label}: started {run_dir.name}", on_row)
        finally:
            self.ports.release(exp)
        return run_dir, reason

    def resume(self, run_dir: Path, label: str) -> tuple[Path, str]:
        """Start the run in ``run_dir`` again from its checkpoint (and replay snapshot), as
        ``launch --resume`` does, after stopping what still runs of it; its config gets network
        ports that are free now (the ones it had may be another resumed run's). As ``run``."""
        self.stop_leftovers(run_dir, label)
        exp = self.ports.assign(loading.load(run_dir / RUN_CONFIG))
        try:
            (run_dir / RUN_CONFIG).write_text(loading.dumps(exp))
            rundirs.reopen_run_dir(run_dir)
            reason = self._live(exp, run_dir, f"{label}: resumed {run_dir.name} from its checkpoint", None)
        finally:
            self.ports.release(exp)
        return run_dir, reason

    def stop_leftovers(self, run_dir: Path, label: str) -> None:
        """Stop what still runs of ``run_dir`` (its launcher was killed under it; the learner
        checkpoints as it stops) and remove its segments."""
        runner = backend.for_run(run_dir)
        if runner.running(run_dir):
            self.say(f"{label}: stopping {run_dir.name}, left running by the launcher that stopped")
            if not runner.stop(run_dir):
                backend.clean(run_dir)

    def _live(self, exp: Experiment, run_dir: Path, line: str, on_row) -> str:
        """``_follow`` the run in ``run_dir`` as one of the live runs (Ctrl-C stops those)."""
        with self.lock:
            self.live.add(run_dir)
        try:
            self.say(line)
            return self._follow(exp, run_dir, on_row)
        finally:
            with self.lock:
                self.live.discard(run_dir)

    def _follow(self, exp: Experiment, run_dir: Path, on_row) -> str:
        """Start the run, wait for its end and stop it; why it ended (the learner's reason, the
        reason of on_row's StopFollowing, crashed, killed: supervisord died under its services,
        stopped: it ended without a result, or no room: /dev/shm or the disk cannot hold it)."""
        try:
            space.check(exp, run_dir.parent)  # as `launch` does: /dev/shm and the disk hold the run, or one line
            supervisor.start(exp, run_dir)
            if self.stopping.is_set():  # stopped while it started: `map`'s stop may have come before it
                return "stopped"
            with (run_dir / LOGS_DIR / FOLLOW_LOG).open("a") as log:  # a resumed run's goes on
                result = follow.follow(run_dir, exp.run.max_wall_s, out=log, on_row=on_row)
            if result:
                return result["reason"]
            # supervisord was killed under its services (the stop below ends what is left of them).
            return "killed" if supervisor.killed(run_dir) or supervisor.running(run_dir) else "stopped"
        except follow.StopFollowing as e:
            return str(e)
        except follow.ServiceCrashLoop as e:
            self.say(f"{run_dir.name}: {e}; last lines of {e.log_path}:\n{e.log_tail(5)}")
            return "crashed"
        except space.NoRoom as e:
            self.say(f"{run_dir.name}: not started: {e}")
            return "no room"
        except RuntimeError as e:  # supervisord did not come up
            self.say(f"{run_dir.name}: {e}")
            return "not started"
        finally:
            if not backend.for_run(run_dir).stop(run_dir):
                backend.clean(run_dir)

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)


def run_experiment(config: str, overrides: list[str], runs_dir: Path, name: str | None = None,
                   seed: int | None = None) -> Experiment:
    """The validated, buildable config of ``config`` with ``overrides``, its run under ``runs_dir``,
    named ``name`` (plots label it so; default: its own run.name), with run.seed ``seed`` (default:
    its own)."""
    from services.build import check_buildable

    exp = loading.load(config, overrides)
    run = dataclasses.replace(exp.run, seed=exp.run.seed if seed is None else seed, name=name or exp.run.name,
                              runs_dir=str(runs_dir))
    exp = dataclasses.replace(exp, run=run)
    exp, _ = checks.resolve_inference(checks.resolve_max_count(exp))
    check_buildable(exp)
    return exp


class Grid:
    """Runs ``(variant, seed)`` pairs of one base config K at a time; see ``run``. ``Grid(...)``
    makes a new grid; ``Grid.resume(DIR)`` goes on with the one recorded in DIR."""

    def __init__(self, config: str, overrides: list[str], variants: list[Variant], seeds: list[int],
                 parallel: int | None = None, out=None, record: gridfile.GridFile | None = None):
        base = loading.load(config, overrides)
        for variant in variants:  # a typo in --vary fails here, before any run starts
            loading.load(config, [*overrides, *variant.overrides])
        stamp = datetime.now().strftime("%Y%m%dT%H%M%S")
        new_dir = Path(base.run.runs_dir).resolve() / f"grid_{rundirs.safe_name(base.run.name)}_{stamp}"
        self.dir = record.dir if record else new_dir
        self.config, self.overrides, self.variants, self.seeds = config, overrides, variants, seeds
        self.name = base.run.name
        self.record = record
        self.launcher = Launcher(parallel or default_parallel(checks.resolve_inference(base)[0]), out)

    @classmethod
    def resume(cls, directory: Path, parallel: int | None = None, out=None) -> "Grid":
        """The grid recorded in ``directory`` (gridfile.NotAGrid if none is), ``parallel`` runs at
        a time (default: as it was started)."""
        record = gridfile.GridFile.load(Path(directory).resolve())
        plan = record.plan
        variants = [Variant(v["label"], tuple(v["overrides"])) for v in plan["variants"]]
        return cls(plan["config"], plan["overrides"], variants, plan["seeds"], parallel or plan["parallel"], out,
                   record)

    def run(self) -> list[dict]:
        """Every run, K at a time; a run that fails is reported and the others go on. Writes
        and returns the summary rows (SUMMARY_COLUMNS), writes the statistics (write_stats) and
        draws the plots. Ctrl-C stops the runs that are live and starts no more. A resumed grid
        keeps the runs that have a result, resumes those that have none and starts the rest."""
        jobs = [(v, s) for v in self.variants for s in self.seeds]
        if self.record is None:
            rundirs.make_runs_dir(self.dir)
            variants = [{"label": v.label, "overrides": list(v.overrides)} for v in self.variants]
            self.record = gridfile.GridFile.create(self.dir, self.config, self.overrides, variants, self.seeds,
                                                   self.launcher.parallel)
            what = "grid"
        else:
            what = f"grid (resumed; {len(self.record.runs)} of {len(jobs)} run(s) started before)"
        self._say(f"{what} {self.dir}: {len(self.variants)} variant(s) x {len(self.seeds)} seed(s), "
                  f"{self.launcher.parallel} at a time")
        rows = self.launcher.map(self._run_one, jobs)
        table = runs.markdown_table(rows, SUMMARY_COLUMNS)
        (self.dir / SUMMARY).write_text(table + "\n")
        self._say(table)
        self._plot(rows)
        methods = {v.label: v.method or self.name for v in self.variants}
        for line in write_stats(self.dir, final_scores(self.dir, rows, methods)):
            self._say(line)
        return rows

    def _run_one(self, job: tuple[Variant, int]) -> dict:
        variant, seed = job
        row = {"variant": variant.label, "seed": seed}
        label = f"{variant.label} seed {seed}"
        if self.launcher.stopping.is_set():
            return {**row, "reason": "not started"}
        recorded = self.record.runs.get((variant.label, seed))
        run_dir = self.dir / recorded if recorded else None
        if run_dir is not None and (run_dir / RUN_CONFIG).exists():
            result = rundirs.read_result(run_dir)
            if result is not None:  # ended before the grid stopped: kept as it is
                self.launcher.stop_leftovers(run_dir, label)
                reason = result["reason"]
                self._say(f"{label}: kept {run_dir.name} ({reason})")
            else:
                run_dir, reason = self.launcher.resume(run_dir, label)
        else:
            try:
                exp = run_experiment(self.config, [*self.overrides, *variant.overrides], self.dir, variant.label, seed)
            except ConfigError as e:
                self._say(f"{label}: config error: {e}")
                return {**row, "reason": "config error"}
            run_dir, reason = self.launcher.run(exp, f"{exp.run.name},seed={seed}", label,
                                                on_start=lambda d: self.record.record_run(variant.label, seed, d.name))
        row = {**row, **runs.summary(run_dir), "reason": reason, "run": run_dir.name}
        self._say(f"{label}: {reason}, return {row['final_return']} after {row['env_steps']} env "
                  f"steps in {row['wall_s']} s")
        return row

    def _plot(self, rows: list[dict]) -> None:
        from shared.launch.lab.plots import plot_runs

        dirs = {label: [self.dir / r["run"] for r in rows if r["variant"] == label and r.get("run")]
                for label in dict.fromkeys(r["variant"] for r in rows)}
        plots = [(self.dir / f"{rundirs.safe_name(label) or 'runs'}.png", group) for label, group in dirs.items()]
        if len(dirs) > 1:
            plots.append((self.dir / "all.png", [d for group in dirs.values() for d in group]))
        for path, group in plots:
            try:
                self._say(f"plot: {plot_runs(group, path)}")
            except ValueError as e:  # no run of the group got as far as a mean return
                self._say(f"no plot {path.name}: {e}")

    def _say(self, line: str) -> None:
        self.launcher.say(line)


def final_scores(grid_dir: Path, rows: list[dict], methods: dict[str, str]) -> dict[str, dict[str, list[float]]]:
    """``{method: {env.id: final returns}}`` of the summary ``rows`` whose runs ended as
    configured (FINISHED); ``methods``: variant label -> method (``Variant.method``)."""
    scores: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        value = stats.final_return(r)
        if r.get("reason") in FINISHED and value is not None:
            task = loading.load(Path(grid_dir) / r["run"] / RUN_CONFIG).env.id
            scores.setdefault(methods[r["variant"]], {}).setdefault(task, []).append(value)
    return scores


def write_stats(grid_dir: Path, scores: dict[str, dict[str, list[float]]]) -> list[str]:
    """Write STATS (``stats.summary_rows`` of ``scores``), and PROFILE where there are several
    tasks, into ``grid_dir``; the lines to show (none without a finished run)."""
    rows = stats.summary_rows(scores)
    if not rows:
        return []
    text = ("Final returns over seeds (runs that ended as configured): IQM and mean with 95% stratified "
            f"bootstrap intervals ({stats.REPS} resamples)\n\n" + runs.markdown_table(rows, stats.COLUMNS))
    (Path(grid_dir) / STATS).write_text(text + "\n")
    lines = [text]
    if len({task for by_task in scores.values() for task in by_task}) > 1:
        from shared.launch.lab.plots import plot_profiles

        lines.append(f"plot: {plot_profiles(scores, Path(grid_dir) / PROFILE)}")
    return lines


def parse_seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: expected integers separated by commas, e.g. 0,1,2") from None

