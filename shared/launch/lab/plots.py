"""Learning curves from run directories: mean return against env steps or wall time, one
curve per config, seeds drawn as their mean with a min–max band; and performance profiles of
several tasks' final returns (``shared/launch/lab/stats.py``).

matplotlib is imported only when a plot is drawn (Agg backend: no display needed).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from shared.config import loading, schema
from shared.launch.lab import runs, stats
from shared.launch.rundirs import read_progress
from shared.runtime.runfiles import RUN_CONFIG

X_AXES = {"steps": ("env_steps", "env steps"), "time": ("wall_s", "wall time (s)")}
GRID_POINTS = 200
BAND_ALPHA = 0.25
FIGSIZE_IN, DPI = (8.0, 5.0), 100  # 800 x 500 pixels
SEED_FIELDS = {"run.seed", "run.name", "run.runs_dir", "network.base_port", "network.metrics_port"}
"""Config fields that tell runs of one config apart without changing what is learned; so does
the whole ``[logging]`` section (where rows go: TensorBoard, W&B), whose defaults also changed
between runs of one config."""


def learned_from(field: str) -> bool:
    """Whether config ``field`` ("section.key") can change what a run learns (group_runs)."""
    return field not in SEED_FIELDS and not field.startswith("logging.")


def flat_config(run_dir: Path) -> dict[str, object]:
    """The run's resolved config as ``{"section.key": value}`` (algo.name included)."""
    exp = loading.load(Path(run_dir) / RUN_CONFIG)
    flat = {"algo.name": exp.algo_name}
    for section in (*schema.SECTIONS, "agent", "algo"):
        obj = getattr(exp, section)
        flat.update({f"{section}.{name}": value for name, value in vars(obj).items()})
    return flat


def curve(run_dir: Path, x: str = "steps") -> tuple[np.ndarray, np.ndarray]:
    """(x [n], mean return [n]) of the run's progress rows that have a mean return."""
    field = X_AXES[x][0]
    rows = [(float(r[field]), float(r["mean_return"])) for r in read_progress(Path(run_dir))]
    rows = [(a, b) for a, b in rows if math.isfinite(b)]
    return np.array([a for a, _ in rows]), np.array([b for _, b in rows])


def group_runs(configs: dict[Path, dict], group_by: str | None = None) -> dict[str, list[Path]]:
    """Runs grouped by config: label -> run dirs, from ``{run dir: flat_config(run dir)}``.

    With ``group_by`` ("section.key") runs are grouped by that field's value, labelled
    ``key=value``; otherwise by their whole config but the fields ``learned_from`` leaves out, labelled by
    the fields in which the groups differ; one group is labelled by its runs' ``run.name``
    (a grid names its runs by their variant), or by algorithm and env where the names differ.
    """
    if group_by is not None:
        missing = [d for d, c in configs.items() if group_by not in c]
        if missing:
            raise ValueError(f"--group-by {group_by}: no such config field (e.g. algo.lr, sampler.count, run.seed)")
        groups: dict[str, list[Path]] = {}
        for d, c in configs.items():
            groups.setdefault(f"{group_by.split('.')[-1]}={c[group_by]}", []).append(d)
        return groups
    keyed: dict[tuple, list[Path]] = {}
    for d, c in configs.items():
        keyed.setdefault(tuple(sorted((k, repr(v)) for k, v in c.items() if learned_from(k))), []).append(d)
    if len(keyed) == 1:
        (dirs,) = keyed.values()
        names = {configs[d]["run.name"] for d in dirs}
        first = configs[dirs[0]]
        return {names.pop() if len(names) == 1 else f"{first['algo.name']} on {first['env.id']}": dirs}
    keys = [dict(k) for k in keyed]  # a field one run's config lacks (older code) differs, as None
    differing = sorted({f for k in keys for f in k if len({other.get(f) for other in keys}) > 1})
    return {",".join(f"{f.split('.')[-1]}={configs[dirs[0]].get(f)}" for f in differing): dirs
            for dirs in keyed.values()}


def plot_runs(run_dirs, out, x: str = "steps", group_by: str | None = None) -> Path:
    """Draw the runs' learning curves into the PNG ``out`` (800 x 500 px); returns its path.

    Each group (``group_runs``) is one colour: its runs are interpolated linearly on a common
    grid of GRID_POINTS x values from 0 to the group's longest run and drawn as their mean with
    a min–max band (a lone run as its line). A run counts from its first mean return on; one
    that ended earlier (at its target, mostly) holds its last value to the end of the grid, so
    the mean does not jump where a seed stops. A dashed line marks each ``run.target_return``
    within reach of the curves (``targets_in_reach``).
    ``x`` is "steps" (env steps) or "time" (wall seconds).
    Raises ValueError when no run has a mean return yet.
    """
    if x not in X_AXES:
        raise ValueError(f"x = {x!r}: allowed: {', '.join(X_AXES)}")
    plt = _pyplot()

    configs = {Path(d): flat_config(d) for d in run_dirs}
    groups = group_runs(configs, group_by)
    curves = {label: [c for c in (curve(d, x) for d in dirs) if len(c[0])] for label, dirs in groups.items()}
    if not any(curves.values()):
        raise ValueError("no run has a mean return yet (progress.csv has no finished episodes)")
    fig, ax = plt.subplots(figsize=FIGSIZE_IN, dpi=DPI)
    try:
        for i, (label, runs) in enumerate(curves.items()):
            if runs:
                _draw_group(ax, f"C{i}", label, runs)
        low, high = ax.get_ylim()
        targets = targets_in_reach({c["run.target_return"] for c in configs.values()}, low, high)
        for target in targets:
            ax.axhline(target, color="0.3", linestyle="--", linewidth=1, label=f"target {target:g}")
        if targets:
            ax.set_ylim(low, max(high, targets[-1] + 0.05 * (high - low)))  # the target line clear of the frame
        names = sorted({c["env.id"] for c in configs.values()})
        ax.set_title(f"mean return of the last episodes on {', '.join(names)}")
        ax.set_xlabel(X_AXES[x][1])
        ax.set_ylabel("mean episode return")
        return _save(fig, ax, out)
    finally:
        plt.close(fig)


def targets_in_reach(targets, low: float, high: float) -> list[float]:
    """The targets worth a line on a y axis from ``low`` to ``high`` (the curves' returns): at most
    one span of it above the top, sorted. A budget-only run's out-of-reach target (1e9) is left
    out, or the frame would stretch to it and flatten every curve."""
    return sorted(t for t in targets if t <= high + (high - low))


def final_scores(run_dirs, group_by: str | None = None) -> dict[str, dict[str, list[float]]]:
    """``{method: {task (env.id): final returns}}`` of the runs, for ``stats.summary_rows``.
    Runs of one env are grouped as their curves are (``group_runs``); across several envs a
    method is the value of ``group_by``, or the algorithm, since the rest of a config
    (model, horizon, target) changes with the env. Runs without a final return are left out."""
    configs = {Path(d): flat_config(d) for d in run_dirs}
    several = len({c["env.id"] for c in configs.values()}) > 1
    groups = group_runs(configs, group_by or "algo.name") if several else group_runs(configs, group_by)
    scores: dict[str, dict[str, list[float]]] = {}
    for label, dirs in groups.items():
        for d in dirs:
            value = stats.final_return(runs.summary(d))
            if value is not None:
                scores.setdefault(label, {}).setdefault(configs[d]["env.id"], []).append(value)
    return scores


def plot_profiles(scores: dict[str, dict[str, list[float]]], out) -> Path:
    """Draw each method's performance profile over the tasks' min-max normalised final returns
    (``stats.normalise``) into the PNG ``out`` (800 x 500 px), with its 95% stratified bootstrap
    band (``stats.PROFILE_REPS`` resamples); returns its path."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=FIGSIZE_IN, dpi=DPI)
    try:
        tasks = set()
        for i, (method, by_task) in enumerate(stats.normalise(scores).items()):
            m = stats.matrix(by_task)
            tasks.update(by_task)
            low, high = stats.bootstrap_ci(m, stats.profile, reps=stats.PROFILE_REPS)
            ax.plot(stats.TAUS, stats.profile(m), color=f"C{i}", label=f"{method} ({m.shape[0]} runs x {m.shape[1]} tasks)")
            ax.fill_between(stats.TAUS, low, high, color=f"C{i}", alpha=BAND_ALPHA, linewidth=0)
        ax.set_title(f"performance profile over {len(tasks)} tasks (bands: 95% stratified bootstrap)")
        ax.set_xlabel("final return, min-max normalised per task over the runs shown (tau)")
        ax.set_ylabel("fraction of runs with score > tau")
        ax.set_ylim(-0.02, 1.02)
        return _save(fig, ax, out)
    finally:
        plt.close(fig)


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only), imported when a plot is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, ax, out) -> Path:
    """The last steps of every plot here: grid, legend, layout, then the PNG ``out`` (its folder made)."""
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return out


def _draw_group(ax, color: str, label: str, runs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    if len(runs) == 1:
        ax.plot(*runs[0], color=color, label=f"{label} (1 run)")
        return
    grid = np.linspace(0.0, max(xs[-1] for xs, _ in runs), GRID_POINTS)
    ys = np.array([np.where(grid >= xs[0], np.interp(grid, xs, vs), np.nan) for xs, vs in runs])
    covered = ~np.isnan(ys).all(axis=0)
    grid, ys = grid[covered], ys[:, covered]
    ax.plot(grid, np.nanmean(ys, axis=0), color=color, label=f"{label} (mean of {len(runs)} runs)")
    ax.fill_between(grid, np.nanmin(ys, axis=0), np.nanmax(ys, axis=0), color=color, alpha=BAND_ALPHA,
                    linewidth=0, label=f"{label}: min–max band")
