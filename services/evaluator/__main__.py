"""python -m services.evaluator --run-dir RUN

Every ``eval.every_s`` seconds: take the newest parameter version from the learner's
segment (``ParamFollower``, as local-inference samplers do: no message, no checkpoint),
and if it was not evaluated yet, play ``eval.episodes`` greedy episodes on held-out seeds
(in a two-player turn-based game also ``eval.episodes`` games against each of ``eval.opponents``,
services/evaluator/matches.py) and report them (services/evaluator/reports.py). Between
evaluations the process sleeps.
An evaluation that fails (an env that raises) is counted, logged and tried again after a
pause that doubles; MAX_FAILURES in a row are an error that ends the process.
"""

import logging
import os
import time

from services.evaluator import matches
from services.evaluator.episodes import CannotRender, by_group, match, play, record_episode, summary
from shared.runtime import evaluation
from services.evaluator.reports import Reports
from shared.runtime import metrics as metrics_mod
from shared.transport import shm
from services.build import env_probe, make_agent
from shared.transport.params import ParamFollower
from shared.runtime.process import run_id_of, torch_device
from services.process import serve
from shared.runtime import heartbeat
from shared.runtime.retry import Backoff

log = logging.getLogger("services.evaluator")
NICE = 10  # scheduling priority below the run's other processes (which keep the default 0)
IDLE_S = 3600.0  # evaluation off (eval.every_s = 0, e.g. under the Procfile): wake this seldom
FAILURE_PAUSE_S = 2.0  # after a failed evaluation, doubling up to 8 times this
MAX_FAILURES = 5  # failed evaluations in a row before the evaluator gives up with an error


def evaluation_failed(failures: Backoff, error: Exception, version: int, m) -> float:
    """Count and log a failed evaluation (with its traceback the first time); the pause before
    the next try, or RuntimeError naming the last error once ``failures`` is spent (supervisord
    restarts the evaluator: an env that fails every time was a crash loop with no pause)."""
    m.failures.inc()
    pause = failures.fail()
    if failures.spent():
        raise RuntimeError(f"evaluation of version {version} failed {failures.failures} times in a row, last: "
                           f"{type(error).__name__}: {error}; giving up (the env's error is above)") from error
    log.error("evaluation of version %d failed (%d in a row): %s: %s; trying again in %.0f s", version,
              failures.failures, type(error).__name__, error, pause, exc_info=failures.failures == 1)
    return pause


def run(exp, run_dir, instance: int) -> None:
    m = metrics_mod.for_service("evaluator", instance, exp.placement.node("evaluator"))
    cfg = exp.eval
    if cfg.every_s == 0:
        log.warning("eval.every_s = 0: evaluation is off; this evaluator only waits")
        while True:
            heartbeat.sleep(IDLE_S)
    torch_device("cpu")  # one thread: evaluation must not take the samplers' and learner's cores
    os.nice(NICE)  # and it yields to them: on a busy machine evaluations take longer, learning does not
    probe = env_probe(exp)
    agent = make_agent(exp, probe).eval()
    probe.close()
    run_id = run_id_of(run_dir)
    params = ParamFollower(agent, shm.segment_name(run_id, "learner", 0, "params"), shm.Owner(run_id, "learner", 0))
    reports = Reports(run_dir, m)
    opponents = matches.service_opponents(exp)
    m.healthy.set(1)
    against = f", {cfg.episodes} game(s) against {' and '.join(opponents)}" if opponents else ""
    log.info("evaluator: %d greedy episode(s) of %s in %d env(s)%s every %g s", cfg.episodes, exp.env.id,
             min(cfg.envs, cfg.episodes), against, cfg.every_s)
    evaluated = -1
    failures = Backoff(FAILURE_PAUSE_S, 8 * FAILURE_PAUSE_S, max_failures=MAX_FAILURES)
    video = cfg.video
    try:
        while True:
            t0 = time.monotonic()
            params.poll()
            if params.version > evaluated:
                version, env_steps = params.version, params.env_steps
                try:
                    played = play(exp, agent, cfg.episodes, cfg.envs)
                    games = []
                    for opponent in opponents:
                        t_match = time.monotonic()
                        row = match(exp, agent, opponent, cfg.episodes, version, env_steps)
                        games.append({**row, "eval_s": round(time.monotonic() - t_match, 3)})
                except Exception as e:  # noqa: BLE001 - an env's error: retried after a pause, then given up on
                    heartbeat.sleep(evaluation_failed(failures, e, version, m))
                    continue
                failures.reset()
                result = {**summary(played.returns, version, env_steps), **by_group(exp, played)}
                result["video"] = ""
                if video:
                    try:
                        record_episode(exp, agent, evaluation.video_path(run_dir, version))
                        result["video"] = str(evaluation.video_path(run_dir, version).relative_to(run_dir))
                    except CannotRender as e:
                        log.error("eval.video: %s; evaluations go on without", e)
                        video = False
                reports.write(result, time.monotonic() - t0, games)
                evaluated = version
                log.info("version %d (%d env steps): return %.1f +- %.1f over %d episodes in %.2f s", version,
                         env_steps, result["mean_return"], result["std_return"], result["episodes"],
                         time.monotonic() - t0)
                for row in games:
                    log.info("version %d: %s", version, matches.describe(row))
            heartbeat.sleep(max(0.0, cfg.every_s - (time.monotonic() - t0)))
    finally:
        params.close()
        reports.close()


if __name__ == "__main__":
    serve("evaluator", run)
