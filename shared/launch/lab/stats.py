"""Multi-seed statistics of runs' final returns, computed as rliable computes them (Agarwal et
al., 2021, "Deep Reinforcement Learning at the Edge of the Statistical Precipice"): the
interquartile mean (IQM) and the mean with 95% stratified bootstrap confidence intervals, and
performance profiles across tasks.

numpy only (rliable pulls in arch, pandas and seaborn); tests/test_stats.py checks the numbers
against rliable's own functions where rliable imports. Score matrices are ``[runs, tasks]``,
as rliable's: ``scores[n, m]`` is run n's final return on task m.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

REPS = 50_000
"""Bootstrap resamples of an interval estimate (rliable's get_interval_estimates default)."""
PROFILE_REPS = 2_000
"""Bootstrap resamples of a performance profile's band (rliable's create_performance_profile default)."""
CI_SIZE = 0.95
CHUNK = 2_000
"""Resamples drawn at once: bounds the memory of a bootstrap to CHUNK x runs x tasks scores."""
TAUS = np.linspace(0.0, 1.0, 101)
"""Thresholds of a performance profile over min-max normalised scores."""
COLUMNS = ("method", "task", "runs", "iqm", "iqm_ci95", "mean", "mean_ci95")


def iqm(scores: np.ndarray) -> np.ndarray:
    """The interquartile mean of each ``[runs, tasks]`` matrix of ``scores [..., runs, tasks]``:
    the mean of its runs x tasks scores with the lowest and highest quarter (int(n / 4) each)
    cut off (rliable.metrics.aggregate_iqm, scipy's trim_mean). Shape ``[...]``."""
    flat = np.sort(scores.reshape(*scores.shape[:-2], -1), axis=-1)
    cut = int(0.25 * flat.shape[-1])
    return flat[..., cut:flat.shape[-1] - cut].mean(axis=-1)


def mean(scores: np.ndarray) -> np.ndarray:
    """The mean over tasks of each task's mean over runs (rliable.metrics.aggregate_mean). Shape ``[...]``."""
    return scores.mean(axis=-2).mean(axis=-1)


def profile(scores: np.ndarray, taus: np.ndarray = TAUS) -> np.ndarray:
    """The performance profile: the fraction of all runs x tasks scores above each tau
    (rliable's score distribution, ``library.create_performance_profile``). Shape ``[..., taus]``."""
    flat = scores.reshape(*scores.shape[:-2], 1, -1)
    return (flat > np.asarray(taus)[:, None]).mean(axis=-1)


def bootstrap_ci(scores: np.ndarray, statistic, reps: int = REPS, size: float = CI_SIZE,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(low, high): the percentile interval of ``statistic`` over ``reps`` stratified bootstrap
    resamples of ``scores [runs, tasks]``, each task's column drawn with replacement from its own
    runs; the shape of what ``statistic`` gives one matrix.

    The same numbers as rliable's ``get_interval_estimates(..., method="percentile")`` after
    ``np.random.seed(seed)`` (its StratifiedBootstrap draws each resample's run indices
    ``[runs, tasks]`` from numpy's global RandomState; one stream of draws is the same numbers
    in chunks)."""
    runs, tasks = scores.shape
    rng = np.random.RandomState(seed)
    values = []
    for start in range(0, reps, CHUNK):
        rows = rng.choice(runs, (min(CHUNK, reps - start), runs, tasks))
        values.append(statistic(scores[rows, np.arange(tasks)]))
    alpha = (1.0 - size) / 2
    low, high = np.percentile(np.concatenate(values), [100 * alpha, 100 * (1.0 - alpha)], axis=0)
    return low, high


@dataclasses.dataclass(frozen=True)
class Estimate:
    point: float
    low: float
    high: float
    """The 95% confidence interval is [low, high]."""

    def __str__(self) -> str:
        return f"{self.point:.4g}"

    def interval(self) -> str:
        return f"[{self.low:.4g}, {self.high:.4g}]"


def estimate(scores: np.ndarray, statistic, seed: int = 0) -> Estimate:
    """``statistic`` of ``scores [runs, tasks]`` with its 95% stratified bootstrap interval."""
    low, high = bootstrap_ci(scores, statistic, seed=seed)
    return Estimate(float(statistic(scores)), float(low), float(high))


def normalise(tasks: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, np.ndarray]]:
    """Scores min-max normalised per task over every method's runs of it: 0 the lowest final
    return given for the task, 1 the highest (all 1 where they are equal). Runs carry no
    reference scores (rliable's human-normalised Atari scores have them), so a profile
    compares the methods given, not their distance to an absolute level."""
    per_task: dict[str, list[float]] = {}
    for by_task in tasks.values():
        for task, values in by_task.items():
            per_task.setdefault(task, []).extend(values)
    bounds = {task: (min(v), max(v)) for task, v in per_task.items()}
    return {method: {task: (np.asarray(v, float) - bounds[task][0]) / (bounds[task][1] - bounds[task][0])
                     if bounds[task][1] > bounds[task][0] else np.ones(len(v))
                     for task, v in by_task.items()}
            for method, by_task in tasks.items()}


def matrix(by_task: dict[str, np.ndarray | list[float]]) -> np.ndarray:
    """``[runs, tasks]`` of one method's scores per task; a task with more runs than another
    gives its first ones (a stratified bootstrap needs as many runs a task)."""
    n = min(len(v) for v in by_task.values())
    return np.stack([np.asarray(v, float)[:n] for v in by_task.values()], axis=1)


def summary_rows(scores: dict[str, dict[str, list[float]]], seed: int = 0) -> list[dict]:
    """Rows of COLUMNS from ``{method: {task: final returns}}``: one a method and task (its
    returns), and with several tasks one a method over all of them (min-max normalised
    scores, ``normalise``), ``task`` "all (normalised)". Methods or tasks without a run are left out."""
    scores = {m: {t: v for t, v in by_task.items() if v} for m, by_task in scores.items()}
    scores = {m: by_task for m, by_task in scores.items() if by_task}
    rows = []
    for method, by_task in scores.items():
        for task, values in by_task.items():
            rows.append(_row(method, task, str(len(values)), np.asarray(values, float)[:, None], seed))
    if len({t for by_task in scores.values() for t in by_task}) > 1:
        for method, by_task in normalise(scores).items():
            m = matrix(by_task)
            rows.append(_row(method, "all (normalised)", f"{m.shape[0]} x {m.shape[1]} tasks", m, seed))
    return rows


def _row(method: str, task: str, runs: str, m: np.ndarray, seed: int) -> dict:
    i, a = estimate(m, iqm, seed), estimate(m, mean, seed)
    return {"method": method, "task": task, "runs": runs, "iqm": str(i), "iqm_ci95": i.interval(),
            "mean": str(a), "mean_ci95": a.interval()}


def final_return(row: dict) -> float | None:
    """A run's final return from its summary row (``runs.summary``), None where it has none."""
    try:
        value = float(row.get("final_return", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None
