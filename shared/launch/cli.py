"""The `rlpipe` command line: launch, train, grid, tune, status, top, ls, results, scale, stop, logs, clean, evaluate,
play, export, package, plot, tensorboard."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "cartpole_ppo.toml"


def _import_from_working_directory() -> None:
    """Let a config's ``module:attribute`` references resolve from the working directory here as
    in the services, which get it on their ``PYTHONPATH`` (``rundirs.python_path``): the ``rlpipe``
    script starts with its own directory on ``sys.path`` instead. Appended, so it does not
    shadow an installed package of the same name."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def main(argv=None) -> int:
    _import_from_working_directory()
    p = argparse.ArgumentParser(prog="rlpipe", description="Deep RL as a pipeline of processes.")
    sub = p.add_subparsers(dest="cmd", required=True)

    for name, help_ in (("launch", "start a run under supervisord and follow it"),
                        ("train", "like launch; with --serial, run every part in this one process")):
        c = sub.add_parser(name, help=help_)
        c.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="experiment TOML file")
        c.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a config value (repeatable), e.g. --set sampler.count=4")
        c.add_argument("--detach", action="store_true", help="start the run and return (follow with `rlpipe status`)")
        c.add_argument("--resume", metavar="RUN", help="start a stopped run again from its checkpoint (and its replay "
                                                       "table's snapshot, with replay.snapshot_interval_s); no CONFIG")
        c.add_argument("--cluster", metavar="ray[://ADDRESS]",
                       help="place the services as actors on a Ray cluster (RAY_ADDRESS or this host's, or the Ray "
                            "Client address) instead of under supervisord; [placement] labels are node resources")
        if name == "train":
            c.add_argument("--serial", action="store_true", help="one process, in-process transport (debugging)")
    c = sub.add_parser("prepare", help="make a run directory and print its path (for honcho/foreman and the Procfile)")
    c.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="experiment TOML file")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    for name, help_ in (("status", "supervisorctl status of a run, and where its services' time went"),
                        ("stop", "stop a run"),
                        ("clean", "stop what is left of a run and remove its shared memory from /dev/shm")):
        c = sub.add_parser(name, help=help_)
        c.add_argument("run", help="run directory or run id (under runs/)")
    c = sub.add_parser("top", help="where a live run's time goes, one line a service with the bottleneck named, "
                                   "over each interval until the run ends")
    c.add_argument("run", help="run directory or run id (under runs/)")
    c.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between two views (default: 2)")
    c.add_argument("--count", type=int, metavar="N", help="views to show (default: until the run ends)")
    c = sub.add_parser("scale", help="change how many samplers (action-servers) a live run has, e.g. "
                                     "`rlpipe scale RUN sampler=4 action_server=2`")
    c.add_argument("run", help="run directory or run id (under runs/)")
    c.add_argument("counts", nargs="+", metavar="SERVICE=N",
                   help="new count: sampler=N (1 to sampler.max_count), action_server=M (1 to action_server.max_count)")
    c = sub.add_parser("evaluate", help="greedy episodes of a run's latest checkpoint on held-out seeds")
    c.add_argument("run")
    c.add_argument("--episodes", type=int, default=None, help="default: the run's eval.episodes (10)")
    c.add_argument("--video", metavar="DIR", help="play the episodes in one env and record the first to an mp4 in DIR")
    c.add_argument("--opponent", metavar="random|heuristic|latest|RUN2",
                   help="two-player turn-based games: play the episodes as games against a uniformly random player, "
                        "a scripted one (win if it can, block if it must, else random), the policy itself or the "
                        "greedy policy of another run's latest checkpoint (same game), half as first player and "
                        "half as second, and report win / draw / loss rates per seat")
    c.add_argument("--tactics", action="store_true",
                   help="with --opponent: also count, per seat, the positions where a move won at once and the "
                        "policy played another, and those where it had to block and did not (two moves of "
                        "lookahead on copies of each position: ~5 ms a move on connect four)")
    c = sub.add_parser("play", help="play a two-player turn-based game (tic-tac-toe, connect four) against the greedy "
                                    "policy of a run's latest checkpoint in the terminal")
    c.add_argument("run")
    seat = c.add_mutually_exclusive_group()
    seat.add_argument("--first", dest="seat", action="store_const", const=0, help="you move first (default)")
    seat.add_argument("--second", dest="seat", action="store_const", const=1, help="the policy moves first")
    c = sub.add_parser("export", help="the greedy policy of a run's latest checkpoint as a standalone file "
                                      "(observation normaliser inside, value head and recurrent state as outputs)")
    c.add_argument("run")
    c.add_argument("--format", default="onnx", help="onnx (default), torchscript or exported (torch.export)")
    c.add_argument("--out", metavar="DIR", help="directory to write to (default: RUN/export)")
    c = sub.add_parser("package", help="a folder to publish a run's agent as is: model card, safetensors weights, "
                                       "config, ONNX policy, training curve and an evaluation video")
    c.add_argument("run")
    c.add_argument("--out", metavar="DIR", help="directory to write to (default: RUN/package)")
    c.add_argument("--episodes", type=int, default=None, help="greedy evaluation episodes for the model card "
                                                               "(default: the run's eval.episodes)")
    c.add_argument("--push", metavar="REPO", help="then upload the files it wrote to this Hugging Face Hub model repo "
                                                  "(needs a token: HF_TOKEN or `hf auth login`)")
    c = sub.add_parser("grid", help="run every combination of --vary values and seeds, K runs at a time")
    c.add_argument("config", nargs="?", help="experiment TOML file")
    c.add_argument("--vary", action="append", default=[], metavar="SECTION.KEY=V1,V2",
                   help="values to try for a config field, TOML literals (an array or inline table is one value: "
                        "model.hidden_sizes=[64,64],[256,256]); repeatable: the grid is their product")
    c.add_argument("--seeds", help="run.seed values, comma-separated (default: 0)")
    c.add_argument("--parallel", type=int, metavar="K", help="runs at a time (default: as many as the cores hold; "
                                                             "with --resume: as the grid was started)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value of every run (repeatable)")
    c.add_argument("--resume", metavar="GRID_DIR", help="go on with a stopped grid: runs with a result are kept, "
                                                        "the others resume from their checkpoint, the rest start; "
                                                        "no CONFIG, --vary, --seeds or --set")
    c = sub.add_parser("tune", help="search hyperparameters with Optuna (TPE, median pruning): each trial a run, "
                                    "K at a time; the best trial's config written out (pip install 'rlpipe[tune]')")
    c.add_argument("config", help="experiment TOML file")
    c.add_argument("--param", dest="params", action="append", default=[], metavar="SECTION.KEY=DIST",
                   help="a field to tune (repeatable): DIST is loguniform:LOW:HIGH, uniform:LOW:HIGH, int:LOW:HIGH "
                        "or choice:V1,V2,..., e.g. --param algo.lr=loguniform:1e-4:3e-3")
    c.add_argument("--trials", type=int, required=True, metavar="N", help="trials (runs) to make")
    c.add_argument("--parallel", type=int, metavar="K", help="runs at a time (default: as many as the cores hold)")
    c.add_argument("--out", metavar="DIR", help="tune directory (default: RUNS_DIR/tune_NAME_STAMP); one holding an "
                                                "earlier tune's study.db goes on with that study")
    c.add_argument("--metric", choices=("final", "auc"), default="final",
                   help="objective: final = mean return of the last episodes when the run ended (default); auc = "
                        "mean of the returns at env-step checkpoints along the budget (docs/tuning.md)")
    c.add_argument("--seed", type=int, default=0, help="seed of the TPE sampler (default: 0)")
    c.add_argument("--startup-trials", type=int, default=5, metavar="N",
                   help="trials that finish before any is pruned (default: 5)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value of every trial (repeatable), e.g. its budget run.max_env_steps")
    c = sub.add_parser("ls", help="list runs (also inside grid directories) with status and results")
    c.add_argument("dir", nargs="?", default="runs", help="directory to search (default: runs)")
    c = sub.add_parser("results", help="results rows from run directories (one a config over its seeds: returns, "
                                       "wall-clock, date, commit, hardware, the command) as Markdown and JSON")
    c.add_argument("runs", nargs="+", metavar="RUN_OR_GRID", help="run directories, run ids, or directories holding "
                                                                  "runs (a grid's)")
    c.add_argument("--out", metavar="FILE.md", help="also write the Markdown table here")
    c.add_argument("--json", metavar="FILE.json", help="also write the rows as JSON here")
    c.add_argument("--keep", metavar="DIR", help="copy the files each row is built from (config, provenance, result, "
                   "progress, evaluations; no checkpoint, log or secret) into DIR, to commit beside the table")
    c.add_argument("--into", metavar="FILE.md", help="write the table into FILE.md between its "
                   "'<!-- rlpipe results: begin -->' and '<!-- rlpipe results: end -->' lines")
    c.add_argument("--reference", metavar="TEXT", help="every row's published reference, with its step count and "
                                                       "source (default: the known one for its algorithm and env)")
    c = sub.add_parser("plot", help="learning curves of runs (seeds of one config as mean and min-max band); "
                                    "--stats: IQM and mean with bootstrap intervals")
    c.add_argument("runs", nargs="+", metavar="RUN", help="run directories, run ids, or directories holding runs")
    c.add_argument("--out", default="learning_curves.png", help="PNG file to write (default: learning_curves.png)")
    c.add_argument("--x", choices=("steps", "time"), default="steps", help="x axis: env steps or wall time")
    c.add_argument("--group-by", metavar="SECTION.KEY", help="one curve per value of this config field "
                                                             "(default: one per config, seeds together)")
    c.add_argument("--stats", action="store_true",
                   help="also print the IQM and mean of the runs' final returns with 95%% stratified bootstrap "
                        "intervals, and with several envs draw their performance profile to OUT's stem + _profile.png")
    c = sub.add_parser("tensorboard", help="serve the runs' TensorBoard files on 127.0.0.1")
    c.add_argument("runs", nargs="+", metavar="RUN", help="run directories, run ids, or directories holding runs")
    c.add_argument("--port", type=int, default=6006)
    c = sub.add_parser("logs", help="show a run's logs")
    c.add_argument("run")
    c.add_argument("service", nargs="?", help="e.g. learner, sampler, sampler1; default: all")
    c.add_argument("-n", type=int, default=40, help="lines per log")

    args = p.parse_args(argv)
    try:
        return COMMANDS[args.cmd](args)
    except Exception as e:
        failure = _failure(e, args.cmd)
        if failure is None:  # a fault of rlpipe's own: its traceback is what to report
            raise
        print(f"rlpipe: {failure}", file=sys.stderr)
        return failure.code


class Failed(Exception):
    """A command that cannot do what was asked: one line on stderr after ``rlpipe: ``, and the
    exit status: 2 for what was typed or configured, 1 for a run or file that failed it."""

    def __init__(self, line: str, code: int = 2):
        super().__init__(line)
        self.code = code


def _failure(e: Exception, cmd: str) -> Failed | None:
    """The commands' known errors as their one line (``Failed``); None for any other exception."""
    from shared.config.schema import ConfigError

    if isinstance(e, Failed):
        return e
    if isinstance(e, ConfigError):
        return Failed(f"config error: {e}")
    from shared.launch import api, backend
    from shared.launch.artefacts import export
    from shared.launch.lab import tune  # export imports torch: only for what is left

    if isinstance(e, (api.NotResumable, tune.MissingExtra)):
        return Failed(str(e))
    if isinstance(e, (export.ExportError, backend.ScaleError, tune.StudyInUse)):
        return Failed(f"{cmd}: {e}")
    if isinstance(e, api.LaunchError):  # no such cluster, a placement it cannot satisfy
        return Failed(f"cannot start the run: {e}", 1)
    return None



def _experiment(args):
    """The validated experiment of ``args.config`` and ``--set``s; None for ``--resume RUN``,
    which takes the run's own config and so no CONFIG or ``--set``."""
    from shared.launch import api

    if not args.resume:
        return api.experiment(args.config, args.overrides)
    if args.overrides or args.config != str(DEFAULT_CONFIG):
        raise Failed(f"{args.cmd} --resume RUN takes the run's own config: no CONFIG or --set")
    return None


def _train(args) -> int:
    if not args.serial:
        return _launch(args)
    from shared.launch import api

    if args.cluster or args.detach:
        raise Failed("train --serial runs in this process: no --cluster or --detach")
    exp = _experiment(args)
    try:
        result = api.train_serial(exp, resume=args.resume)
    except KeyboardInterrupt:
        print("\ninterrupted: the run stopped with a checkpoint (`rlpipe launch --resume RUN` goes on from it)")
        return 1
    if result["reason"] == "failed":
        raise Failed(f"run {result['run_dir']} failed after {result['env_steps']} env steps: {result['error']}", 1)
    print(f"serial run ended ({result['reason']}): mean return {result['mean_return']:.1f} "
          f"after {result['env_steps']} env steps in {result['wall_s']:.1f} s")
    print(f"run directory: {result['run_dir']}")
    return 0


def _prepare(args) -> int:
    from shared.launch import api

    print(api.prepare(api.experiment(args.config, args.overrides)))  # a port in use is a ConfigError too
    return 0


def _launch(args) -> int:
    """A detached launch returns once the run is built and leaves it to `status` and `stop`; in
    the foreground, SIGTERM and SIGHUP stop the run as Ctrl-C does."""
    from shared.runtime.process import terminate_as_interrupt

    if args.detach:
        return _start_and_follow(args)
    with terminate_as_interrupt():
        return _start_and_follow(args)


def _start_and_follow(args) -> int:
    from shared.launch import api, follow

    exp = _experiment(args)
    backend = args.cluster or "supervisord"
    t0 = time.monotonic()
    try:
        run = api.resume(args.resume, backend, wait=False) if args.resume else api.launch(exp, backend, wait=False)
    except KeyboardInterrupt:  # while its services started: _start stopped what had started
        print("\ninterrupted while starting: the run is stopped")
        return 1
    try:
        run.wait_until_built()  # a model that cannot exist: nothing is left but the error line
        _announce(run, args.detach)
        if args.detach:
            return 0
        result = run.follow()
    except KeyboardInterrupt:
        result = None
        print("\ninterrupted: stopping the run")
    except follow.ServiceCrashLoop as e:  # the run is stopped
        raise Failed(f"{e}: run stopped. Last lines of {e.log_path}:\n{e.log_tail()}", 1) from e
    run.stop()
    if result is None:
        print(f"run {run.dir} stopped after {time.monotonic() - t0:.1f} s without a result")
        return 1
    if result["reason"] == "failed":
        raise Failed(f"run {run.dir} failed after {result['env_steps']} env steps: {result['error']}", 1)
    if result.get("error"):  # a run that could not go on (the watchdog's line)
        print(f"rlpipe: {result['error']}", file=sys.stderr)
    print(f"run ended ({result['reason']}): mean return {result['mean_return']:.1f} over the last episodes, "
          f"{result['env_steps']} env steps, {result['updates']} updates, in {result['wall_s']:.1f} s")
    print(f"run directory: {run.dir}")
    return 0 if result["reason"] == "target" else 1


def _announce(run, detach: bool) -> None:
    exp, run_dir = run.exp, run.dir
    servers = f", {exp.action_server.count} action-server(s)" if exp.sampler.inference == "server" else ""
    print(f"run {run_dir.name}: {exp.algo_name} on {exp.env.id}, {exp.sampler.count} sampler(s) x "
          f"{exp.sampler.envs} envs{servers}, {run.inference}")
    print(f"run directory: {run_dir}")
    if exp.network.metrics_port:
        print(f"metrics: http://{exp.network.metrics_host}:{exp.network.metrics_port}/metrics")
    if detach:
        print(f"detached; follow with `rlpipe status {run_dir}`, end with `rlpipe stop {run_dir}`")


def _run_dir(args) -> Path:
    from shared.launch import rundirs

    try:
        return rundirs.resolve_run(args.run)
    except FileNotFoundError as e:
        raise Failed(str(e)) from e


def _status(args) -> int:
    from shared.launch import backend, rundirs, timesplit

    run_dir = _run_dir(args)
    runner = backend.for_run(run_dir)
    if not runner.running(run_dir):
        result = rundirs.read_result(run_dir)
        ended = f"; ended ({result['reason']})" + (f": {result['error']}" if result.get("error") else "") if result else ""
        print(f"{run_dir.name}: not running{ended}")
        code = 0
    else:
        code = runner.status(run_dir)
    rows = rundirs.read_progress(run_dir)
    if rows and int(rows[-1].get("skipped_updates") or 0):  # rows of runs made before it was counted have none
        print(f"skipped updates: {rows[-1]['skipped_updates']} of {rows[-1]['updates']} learned nothing (every gradient "
              "step skipped: loss or gradient norm not finite)")
    for line in timesplit.lines(timesplit.read(run_dir), "since the start"):
        print(line)
    return code


def _top(args) -> int:
    from shared.launch import backend, timesplit

    run_dir = _run_dir(args)
    if args.interval <= 0 or (args.count is not None and args.count < 1):
        raise Failed("top: --interval takes seconds > 0 and --count a number >= 1")
    runner = backend.for_run(run_dir)
    if not runner.running(run_dir):
        print(f"{run_dir.name}: not running (`rlpipe status {run_dir}` shows where its time went)")
        return 1
    try:
        timesplit.top(run_dir, lambda: runner.running(run_dir), args.interval, args.count)
    except KeyboardInterrupt:
        pass
    return 0


def _stop(args) -> int:
    from shared.launch import backend

    run_dir = _run_dir(args)
    ok = backend.for_run(run_dir).stop(run_dir)
    print(f"{run_dir.name}: " + ("stopped" if ok else "some processes did not stop; try `rlpipe clean`"))
    return 0 if ok else 1


def _scale(args) -> int:
    from shared.launch import backend

    run_dir = _run_dir(args)
    counts = {}
    for item in args.counts:
        service, _, value = item.partition("=")
        if not value.lstrip("-").isdigit():
            raise Failed(f"scale: {item!r}: expected SERVICE=N, e.g. sampler=4")
        counts[service] = int(value)
    added, removed, moved = backend.for_run(run_dir).scale(run_dir, counts)
    print(f"{run_dir.name}: " + ", ".join(f"{k}={v}" for k, v in counts.items())
          + (f"; started {' '.join(added)}" if added else "") + (f"; stopped {' '.join(removed)}" if removed else "")
          + (f"; restarted {' '.join(moved)} for their new action-server" if moved else ""))
    return 0


def _clean(args) -> int:
    from shared.launch import backend

    run_dir = _run_dir(args)
    killed, removed = backend.clean(run_dir)
    print(f"{run_dir.name}: killed {len(killed)} process(es), removed {len(removed)} shared-memory segment(s)")
    return 0


def _evaluate(args) -> int:
    run_dir = _run_dir(args)
    from services.evaluator import matches
    from services.evaluator.episodes import CannotRender, Unloadable, evaluate
    from shared.config import loading
    from shared.config.schema import OPPONENTS
    from shared.launch import rundirs
    from shared.launch.lab import runs
    from shared.runtime import evaluation
    from shared.runtime.runfiles import EVAL_LATEST, RUN_CONFIG

    exp = loading.load(run_dir / RUN_CONFIG)
    episodes = exp.eval.episodes if args.episodes is None else args.episodes
    if episodes < 1:
        raise Failed(f"--episodes {episodes}: must be >= 1")
    rival = None
    if args.tactics and args.opponent is None:
        raise Failed("--tactics without --opponent: missed wins and blocks are counted in games against an opponent")
    if args.opponent is not None:
        if args.video:
            raise Failed("--video with --opponent: no video is recorded of games against an opponent")
        try:
            if args.opponent not in OPPONENTS:
                with contextlib.suppress(FileNotFoundError):  # no run of that name: an unknown opponent
                    rival_dir = rundirs.resolve_run(args.opponent)
                    rival = loading.load(rival_dir / RUN_CONFIG), rival_dir
            matches.check_opponent(exp, args.opponent, rival[0] if rival else None)
        except ValueError as e:
            raise Failed(str(e)) from e
    t0 = time.monotonic()
    try:
        result = evaluate(exp, run_dir, episodes, Path(args.video) if args.video else None, args.opponent, rival,
                          args.tactics)
    except (FileNotFoundError, Unloadable, CannotRender) as e:
        raise Failed(str(e), 1) from e
    except ValueError as e:  # the rival run's checkpoint, or a game --tactics cannot copy
        raise Failed(str(e)) from e
    what = f"games ({result['episodes'] // 2} a seat)" if args.opponent else "episodes"
    print(f"{run_dir.name}: {result['episodes']} greedy {what} of policy version {result['policy_version']} "
          f"({result['env_steps']} env steps): return {result['mean_return']:.1f} +- {result['std_return']:.1f} "
          f"(min {result['min_return']:.1f}, max {result['max_return']:.1f})")
    if args.opponent:
        print(matches.describe(result))
    for name, group in result.get("group_returns", {}).items():
        print(f"  group {name}: return {group['mean_return']:.1f} over {group['episodes']} agent-episodes")
    if runs.status(run_dir) != "running":  # a live run's evaluator owns its evaluation files
        evaluation.record(run_dir, {**result, "wall_time": round(time.time(), 3),
                                    "eval_s": round(time.monotonic() - t0, 3), "video": ""})
        print(f"recorded in {run_dir / EVAL_LATEST} (`rlpipe results` shows it)")
    if args.video:
        print(f"video of the first episode: {', '.join(str(p) for p in sorted(Path(args.video).glob('*.mp4')))}")
    return 0


def _play(args) -> int:
    run_dir = _run_dir(args)
    from services.evaluator.episodes import Unloadable
    from shared.config import loading
    from shared.envs.pettingzoo_backend import check_two_player_game
    from shared.launch.artefacts import terminal_game
    from shared.runtime.runfiles import RUN_CONFIG

    exp = loading.load(run_dir / RUN_CONFIG)
    try:
        check_two_player_game(exp.env, "play")
    except ValueError as e:
        raise Failed(str(e)) from e
    try:
        return terminal_game.play(exp, run_dir, args.seat or 0, sys.stdin, sys.stdout)
    except (FileNotFoundError, Unloadable, ValueError) as e:
        raise Failed(str(e), 1) from e


def _export(args) -> int:
    run_dir = _run_dir(args)
    from shared.launch.artefacts import export

    path = export.export(run_dir, args.format, Path(args.out) if args.out else None)
    print(f"{run_dir.name}: greedy policy written to {path} (inputs and outputs: {path.parent / export.METADATA})")
    return 0


def _package(args) -> int:
    run_dir = _run_dir(args)
    from shared.launch.artefacts import package

    if args.episodes is not None and args.episodes < 1:
        raise Failed(f"package: --episodes {args.episodes}: must be >= 1")
    files = package.package(run_dir, Path(args.out) if args.out else None, args.episodes)
    print(f"{run_dir.name}: package written to {files[0].parent}")
    if args.push:
        print(f"uploaded {', '.join(f.name for f in files)} to {package.push(files, args.push)}")
    return 0


def _run_dirs(names: list[str]) -> list[Path]:
    """Run directories from run paths, run ids or directories holding runs (a grid's)."""
    from shared.launch import rundirs
    from shared.launch.lab import runs

    found = []
    for name in names:
        try:
            found.append(rundirs.resolve_run(name))
        except FileNotFoundError as e:
            inside = runs.find_runs(Path(name))
            if not inside:
                raise Failed(str(e)) from e
            found += inside
    return found


def _grid(args) -> int:
    from shared.config import schema
    from shared.launch.lab.grid import FINISHED, Grid, parse_seeds, parse_vary
    from shared.runtime.process import terminate_as_interrupt

    if args.resume and (args.config or args.vary or args.seeds or args.overrides):
        raise Failed("grid --resume GRID_DIR takes the grid's own config, variants and seeds: no CONFIG, --vary, "
                     "--seeds or --set")
    if not args.resume and not args.config:
        raise Failed("grid needs an experiment TOML file (or --resume GRID_DIR)")
    if args.resume:
        try:
            grid = Grid.resume(Path(args.resume), args.parallel)
        except schema.ConfigError as e:  # also gridfile.NotAGrid
            raise Failed(f"grid --resume: {e}") from e
    else:
        grid = Grid(args.config, args.overrides, parse_vary(args.vary), parse_seeds(args.seeds or "0"), args.parallel)
    # A terminal closing or a scheduler's time limit ends the grid as Ctrl-C does: the live runs
    # stop (the learners checkpoint) and `grid --resume` goes on from there.
    with terminate_as_interrupt():
        rows = grid.run()
    return 0 if all(r["reason"] in FINISHED for r in rows) else 1


def _tune(args) -> int:
    from shared.launch.lab import tune
    from shared.runtime.process import terminate_as_interrupt

    study = tune.Tune(args.config, args.overrides, tune.parse_params(args.params), args.trials, args.parallel,
                      args.out, args.metric, args.seed, args.startup_trials)
    with terminate_as_interrupt():  # SIGTERM, SIGHUP: the live trials are stopped and failed as at Ctrl-C
        rows = study.run()
    return 0 if any(r["state"] == "COMPLETE" for r in rows) else 1


def _ls(args) -> int:
    from shared.launch.lab import runs

    root = Path(args.dir)
    found = runs.find_runs(root)
    if not found:
        raise Failed(f"no runs under {root}", 1)
    rows = [{**runs.summary(d), "run": str(d.relative_to(root))} for d in found]
    print(runs.markdown_table(rows, runs.COLUMNS))
    return 0


def _results(args) -> int:
    from shared.launch.lab import results

    dirs = _run_dirs(args.runs)
    if args.keep:
        dirs = results.keep(dirs, Path(args.keep))
        print(f"kept the records of {len(dirs)} run(s) in {args.keep}")
    rows = results.rows(dirs, args.reference)
    table = results.write(rows, Path(args.out) if args.out else None, Path(args.json) if args.json else None)
    print(table)
    if args.into:
        try:
            results.into(Path(args.into), table)
        except (OSError, ValueError) as e:
            raise Failed(str(e), 1) from e
    for path in (args.out, args.json, args.into):
        if path:
            print(f"wrote {path}")
    return 0


def _plot(args) -> int:
    from shared.launch.lab.plots import plot_runs

    dirs = _run_dirs(args.runs)
    try:
        out = plot_runs(dirs, args.out, x=args.x, group_by=args.group_by)
    except ValueError as e:
        raise Failed(str(e), 1) from e
    print(f"wrote {out}")
    return _print_stats(dirs, out, args.group_by) if args.stats else 0


def _print_stats(dirs: list[Path], out: Path, group_by: str | None) -> int:
    """``plot --stats``: the final returns' statistics table, and a profile beside ``out`` with several envs."""
    from shared.launch.lab import plots, runs, stats

    scores = plots.final_scores(dirs, group_by)
    rows = stats.summary_rows(scores)
    if not rows:
        raise Failed("--stats: no run has a final return yet", 1)
    print(runs.markdown_table(rows, stats.COLUMNS))
    if len({task for by_task in scores.values() for task in by_task}) > 1:
        print(f"wrote {plots.plot_profiles(scores, out.with_name(out.stem + '_profile.png'))}")
    return 0


def _tensorboard(args) -> int:
    import os

    from shared.runtime.runfiles import TB_DIR

    dirs = _run_dirs(args.runs)
    spec = ",".join(f"{d.name}:{d / TB_DIR}" for d in dirs)
    print(f"TensorBoard on http://127.0.0.1:{args.port}/ for {len(dirs)} run(s)", flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "tensorboard.main", "--logdir_spec", spec,
                              "--host", "127.0.0.1", "--port", str(args.port)])


def _logs(args) -> int:
    run_dir = _run_dir(args)
    from shared.runtime.runfiles import LOGS_DIR

    pattern = f"{args.service}*.log" if args.service else "*.log"
    paths = sorted((run_dir / LOGS_DIR).glob(pattern))
    if not paths:
        raise Failed(f"no logs matching {pattern} in {run_dir / LOGS_DIR}", 1)
    for path in paths:
        lines = path.read_text(errors="replace").splitlines()[-args.n:]
        print(f"==> {path.name} <==")
        print("\n".join(lines))
    return 0


COMMANDS = {"launch": _launch, "train": _train, "prepare": _prepare, "evaluate": _evaluate, "play": _play,
            "export": _export, "package": _package, "status": _status, "top": _top, "stop": _stop, "logs": _logs,
            "scale": _scale, "clean": _clean, "grid": _grid, "tune": _tune, "ls": _ls, "results": _results, "plot": _plot,
            "tensorboard": _tensorboard}


if __name__ == "__main__":
    sys.exit(main())
