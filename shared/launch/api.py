"""The Python API: an experiment from a TOML file, a dict or dataclasses; a run launched
under supervisord or on Ray and followed from Python; serial mode in this process.

    from shared.launch import api

    exp = api.experiment("deploy/configs/cartpole_ppo.toml", ["sampler.envs=8"])
    with api.launch(exp) as run:          # back once the learner has built the agent
        result = run.follow()             # progress rows printed until the run ends
    result = api.train_serial(exp)        # every part in this process, the same run directory

``rlpipe launch``, ``train`` and ``prepare`` are this module behind argparse. Errors: a
ConfigError (one line naming the field) before anything starts, or when the learner finds
the model cannot be built; LaunchError when the backend cannot start the run;
``follow.ServiceCrashLoop`` when services keep dying at start-up (the run is stopped
first); NotResumable for ``resume`` of a run that is not there or still runs.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Iterator, Sequence, TextIO

from shared.config import checks, endpoints, loading
from shared.config.schema import ConfigError, Experiment
from shared.launch import backend as backends
from shared.launch import follow, ray_backend, rundirs, space, supervisor
from shared.runtime.runfiles import LOGS_DIR, RUN_CONFIG, SERIAL_LOG



class LaunchError(RuntimeError):
    """The backend could not start the run (no such cluster, a placement it cannot satisfy,
    supervisord not coming up); str() is one line. Nothing of the run is left running."""


class NotResumable(ValueError):
    """``resume`` of a run directory that does not exist or whose processes still run."""


def experiment(config: str | Path | dict | Experiment, overrides: Sequence[str] = (), *,
               check_ports: bool = False) -> Experiment:
    """A validated Experiment from a TOML file's path, a dict of the TOML's shape
    (``{"algo": {"name": "ppo", "lr": 1e-3}, "sampler": {"count": 2}}``) or an Experiment of
    dataclasses (validated again: ``dataclasses.replace`` checks nothing), with ``--set``-style
    ``overrides`` (``"sampler.count=4"``) applied on top. ``check_ports``: also fail if a port
    the run would bind is taken."""
    overrides = list(overrides)
    if isinstance(config, (str, Path)):
        return loading.load(config, overrides, check_ports=check_ports)
    if isinstance(config, Experiment):
        config = tomllib.loads(loading.dumps(config))  # as the run directory's config.toml holds it
    if not isinstance(config, dict):
        raise TypeError(f"experiment(): a TOML path, a dict or an Experiment, not {type(config).__name__}")
    return loading.from_dict(loading.apply_overrides(config, overrides), check_ports=check_ports)


def prepare(exp: Experiment) -> Path:
    """A run directory for ``exp`` (resolved config, secret, socket directory), after checking
    that its ports are free and its agent can be built for its env; nothing is started
    (``rlpipe prepare``: for honcho and the Procfile)."""
    from services.build import check_buildable

    exp, _ = checks.resolve_inference(checks.resolve_max_count(experiment(exp, check_ports=True)))
    check_buildable(exp)
    return rundirs.make_run_dir(exp)


def launch(exp: Experiment | str | Path | dict, backend: str = "supervisord", *, wait: bool = True) -> "Run":
    """Start a run of ``exp`` (an Experiment, or what ``experiment`` takes): a fresh run
    directory, its services under supervisord, or as actors on a Ray cluster (``backend``
    ``"ray"``: RAY_ADDRESS or this host's cluster; ``"ray://HOST:PORT"``: Ray Client). With
    ``wait`` it returns once the learner has built the agent (``Run.wait_until_built``);
    the run goes on until it ends or ``Run.stop``. ConfigError (nothing made), LaunchError
    (one line; nothing runs: /dev/shm or the run directory's disk too small for the run, with
    nothing made; the backend could not start it, with its run directory left)."""
    _check_backend(backend)
    exp, why = checks.resolve_inference(checks.resolve_max_count(experiment(exp, check_ports=True)))
    _check_space(exp, backend, Path(exp.run.runs_dir))
    rundirs.service_env(exp)  # the launch directory's modules: ConfigError before anything is made
    return _start(Run(rundirs.make_run_dir(exp), exp, backend, why, fresh=True), wait)


def resume(run: str | Path, backend: str = "supervisord", *, wait: bool = True) -> "Run":
    """Start a stopped run again with its own config, from its learner's checkpoint (and its
    replay table's snapshot, with ``replay.snapshot_interval_s``): a launched run or a serial
    one. ``run``: its directory or its id under runs/. NotResumable if there is no such run
    or it still runs; otherwise as ``launch``."""
    _check_backend(backend)
    run_dir = _reopen(run)
    exp, why = checks.resolve_inference(experiment(run_dir / RUN_CONFIG, check_ports=True))
    _check_space(exp, backend, run_dir, run_dir.name)
    return _start(Run(run_dir, exp, backend, why, fresh=False), wait)


def train_serial(exp: Experiment | str | Path | dict | None = None, *, resume: str | Path | None = None,
                 out: TextIO | None = None, quiet: bool = False) -> dict:
    """Run ``exp`` in serial mode in this process (``services.serial``) until it ends, in a
    run directory made as ``launch`` makes one (or, with ``resume``, a stopped run's own,
    from its checkpoint); returns the learner's result plus ``run_dir``.

    Prints ``run directory: DIR``, then the progress rows as ``Run.follow`` prints them, to
    ``out`` (default: sys.stdout), or nowhere with ``quiet``. The parts' log records go to
    ``logs/serial0.log``; what the caller's logging let through before (warnings, by
    default) still reaches it. Leaves nothing in /dev/shm. An interrupt (Ctrl-C) writes a
    checkpoint, then raises KeyboardInterrupt.
    """
    from services import serial

    if (exp is None) == (resume is None):
        raise TypeError("train_serial(): an experiment, or resume=RUN, not both")
    if resume is None:
        exp, _ = checks.resolve_inference(experiment(exp))
        run_dir = rundirs.make_run_dir(exp)
    else:
        run_dir = _reopen(resume)
        exp = experiment(run_dir / RUN_CONFIG)
    out = _out(out, quiet)
    print(f"run directory: {run_dir}", file=out, flush=True)
    rows = _RowPrinter(run_dir, out)
    try:
        with _serial_log(run_dir), rows.printing():
            result = serial.train_serial(exp, run_dir)
    except ConfigError:  # learner.count > 1, an agent that cannot be built for the env: no run to keep
        if resume is None:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(endpoints.socket_dir(run_dir), ignore_errors=True)  # as a stopped run's
    return {**result, "run_dir": str(run_dir)}


class Run:
    """A launched run: its directory, config and backend, and what to ask of it."""

    def __init__(self, run_dir: Path, exp: Experiment, backend: str, inference: str, fresh: bool):
        self.dir, self.exp, self.backend = Path(run_dir), exp, backend
        self.inference = inference
        """How sampler.inference was chosen, e.g. ``inference local (auto: no CUDA device)``."""
        self.fresh = fresh  # this launch made the run directory (a config error removes it)

    @property
    def id(self) -> str:
        return self.dir.name

    def __repr__(self) -> str:
        return f"Run({str(self.dir)!r})"

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        if not self.stop():  # leave nothing running, and nothing in /dev/shm
            self.clean()

    def wait_until_built(self, timeout_s: float = follow.BUILD_TIMEOUT_S) -> None:
        """Return once the learner has built the agent. ConfigError when a service found the
        config cannot work (the run is cleaned up, and its directory removed if this launch
        made it); ``follow.ServiceCrashLoop`` when services keep dying (the run is stopped)."""
        try:
            error = follow.wait_until_built(self.dir, timeout_s)
        except follow.ServiceCrashLoop:
            self.stop()
            raise
        if error is not None:
            self.clean()
            if self.fresh:
                shutil.rmtree(self.dir, ignore_errors=True)
            raise ConfigError(error)

    def progress(self) -> list[dict]:
        """The progress rows (``progress.csv``) so far, as dicts of strings."""
        return rundirs.read_progress(self.dir)

    def running(self) -> bool:
        """Whether any process of the run is still there (a cluster run asks its cluster)."""
        return backends.for_run(self.dir).running(self.dir)

    def follow(self, out: TextIO | None = None, quiet: bool = False) -> dict | None:
        """Print each progress row to ``out`` (default: sys.stdout; nowhere with ``quiet``)
        as the learner writes it, until the run ends; then stop what still runs of it. The
        result, or None if the run was stopped or did not end within ``run.max_wall_s`` + 60 s.
        ``follow.ServiceCrashLoop`` when a service keeps dying at start-up (the run is stopped
        first)."""
        out = _out(out, quiet)
        try:
            result = follow.follow(self.dir, self.exp.run.max_wall_s, out)
        except follow.ServiceCrashLoop:
            self.stop()
            raise
        self.stop()
        return result

    def rows(self, poll_s: float = 0.5) -> Iterator[dict]:
        """Yield each progress row (a dict of strings, as ``progress``) as the learner writes
        it, until the run ends (its result is there, or its supervisor is gone); then stop
        what still runs of it. Leaving the loop early leaves the run running.
        ``follow.ServiceCrashLoop`` as ``follow``."""
        shown, watch = 0, follow.CrashWatch(self.dir)
        while True:
            ended = rundirs.read_result(self.dir) is not None or not backends.for_run(self.dir).supervised(self.dir)
            rows = self.progress()  # after the check: the last row is written before the result
            yield from rows[shown:]
            shown = len(rows)
            if ended:
                break
            try:
                watch.check()
            except follow.ServiceCrashLoop:
                self.stop()
                raise
            time.sleep(poll_s)
        self.stop()

    def result(self, wait: bool = True) -> dict | None:
        """The run's result (``result.json``). With ``wait``, first follow the run quietly to
        its end (then stop it); without, None while it has none."""
        if wait and rundirs.read_result(self.dir) is None:
            return self.follow(quiet=True)
        return rundirs.read_result(self.dir)

    def stop(self) -> bool:
        """Stop every process of the run (``rlpipe stop``); True once all are gone (else try ``clean``)."""
        return backends.for_run(self.dir).stop(self.dir)

    def clean(self) -> tuple[list[int], list[str]]:
        """Stop what is left of the run, kill what will not stop, remove its /dev/shm segments
        (``rlpipe clean``): (pids killed, segments removed)."""
        return backends.clean(self.dir)


# ---------------------------------------------------------------- helpers


def _check_backend(backend: str) -> None:
    """LaunchError unless ``backend`` is supervisord or a Ray target."""
    if backend == "supervisord":
        return
    try:
        ray_backend.parse_target(backend)
    except ValueError:
        raise LaunchError(f"backend {backend!r}: expected supervisord, ray or ray://HOST:PORT") from None


def _check_space(exp: Experiment, backend: str, runs_dir: Path, run_id: str | None = None) -> None:
    """LaunchError (one line: the shortfall) unless this host's /dev/shm and run directory hold
    the run (``shared.launch.space``); a Ray run's services place their segments on its nodes."""
    if backend != "supervisord":
        return
    try:
        space.check(exp, runs_dir, run_id)
    except space.NoRoom as e:
        raise LaunchError(str(e)) from None


def _start(run: Run, wait: bool) -> Run:
    """Start ``run``'s services on its backend (LaunchError after cleaning up); with ``wait``,
    wait until its agent is built. An interrupt meanwhile (Ctrl-C, or SIGTERM to a foreground
    launch: ``terminate_as_interrupt``) leaves nothing of the run running, then goes on up."""
    try:
        try:
            if run.backend == "supervisord":
                supervisor.start(run.exp, run.dir)
            else:
                ray_backend.start(run.exp, run.dir, run.backend)
        except (ValueError, ConnectionError, RuntimeError) as e:  # no such cluster, a placement it cannot satisfy
            run.clean()
            raise LaunchError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        if wait:
            run.wait_until_built()
    except KeyboardInterrupt:  # a supervisord half started included: clean stops what runs and removes segments
        run.clean()
        raise
    return run


def _reopen(run: str | Path) -> Path:
    """The stopped run ``run`` names, made ready to start again (NotResumable if it cannot be)."""
    try:
        run_dir = rundirs.resolve_run(str(run))
    except FileNotFoundError as e:
        raise NotResumable(str(e)) from None
    runner = backends.for_run(run_dir)
    if runner.supervised(run_dir):
        raise NotResumable(f"run {run_dir.name} is running: nothing to resume")
    if runner.running(run_dir):  # a second set of services would start beside them
        raise NotResumable(f"run {run_dir.name}: services of it run on without their supervisor (killed?): "
                           f"`rlpipe stop {run_dir}` ends them, then resume")
    rundirs.reopen_run_dir(run_dir)
    return run_dir


class _RowPrinter:
    """Prints the rows a serial run's learner appends to its progress.csv, as ``follow``
    prints a launched run's (read from the file by a thread: the rows hold the same columns)."""

    def __init__(self, run_dir: Path, out):
        self.run_dir, self.out, self.shown = run_dir, out, 0

    def flush(self) -> None:
        for row in rundirs.read_progress(self.run_dir)[self.shown:]:
            if None in row.values():
                break  # a row still being written: next time
            print(follow.format_row(row), file=self.out, flush=True)
            self.shown += 1

    @contextlib.contextmanager
    def printing(self, interval_s: float = 0.5):
        done = threading.Event()

        def loop():
            while not done.wait(interval_s):
                self.flush()

        thread = threading.Thread(target=loop, name="rlpipe-progress", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            done.set()
            thread.join()
            self.flush()


class _Discard:
    """An ``out`` that prints nothing."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _out(out: TextIO | None, quiet: bool):
    """Where rows go: nowhere (``quiet``), ``out``, or the sys.stdout of the moment (a default
    bound at import would miss a redirection: contextlib.redirect_stdout, a notebook's)."""
    return _Discard() if quiet else sys.stdout if out is None else out


class _ToCaller(logging.Handler):
    """Passes records on to the root logger's handlers (or Python's last resort): what the
    caller's logging would have shown had serial mode not taken the records for its file."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger().handle(record)


@contextlib.contextmanager
def _serial_log(run_dir: Path):
    """While serial mode runs: the records of ``services.*`` and ``shared.*`` at INFO and up
    go to ``logs/serial0.log`` in a service log's format, and those at the level the caller's
    logging let through before still reach the caller's handlers."""
    file = logging.FileHandler(run_dir / LOGS_DIR / SERIAL_LOG)
    file.setFormatter(logging.Formatter("%(asctime)s serial0 %(levelname)s %(name)s: %(message)s"))
    saved = []
    for name in ("services", "shared"):
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate))
        caller = _ToCaller(logger.getEffectiveLevel())
        logger.addHandler(file)
        logger.addHandler(caller)
        logger.setLevel(min(logging.INFO, logger.getEffectiveLevel()))
        logger.propagate = False
        saved[-1] += (caller,)
    try:
        yield
    finally:
        for logger, level, propagate, caller in saved:
            logger.removeHandler(file)
            logger.removeHandler(caller)
            logger.setLevel(level)
            logger.propagate = propagate
        file.close()
