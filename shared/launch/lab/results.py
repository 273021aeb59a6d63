"""Results rows from run directories (``rlpipe results``): one row per config (variant and env)
over its seeds, with what docs/benchmarks.md's learning-results table shows, as Markdown and
as JSON, built from what the runs wrote: their config, result or last progress row, the
evaluator's latest greedy evaluation (``eval.json``), provenance (``meta.json``) and, for a
grid's runs, the grid's record (``grid.json``).

Runs are grouped as ``rlpipe plot`` groups their curves (``plots.group_runs``: the whole config
but the seed, name, runs directory and ports). A row's final return is each seed's last mean
training return, as the grid's summary takes it (``runs.summary``), with the median and the
range over seeds. The published reference comes from REFERENCES (values quoted in
docs/benchmarks.md with their sources) or ``--reference``; a row with neither says "—".
"""

from __future__ import annotations

import json
import shlex
import shutil
import statistics
from pathlib import Path

from shared.launch.lab import gridfile, plots, runs, stats
from shared.launch import provenance
from shared.runtime import evaluation
from shared.runtime.runfiles import EVAL_CSV, EVAL_LATEST, META, PROGRESS, RESULT, RUN_CONFIG

COLUMNS = ("algorithm", "env (config)", "env steps", "seeds", "final mean return (training window)",
           "greedy evaluation", "wall-clock", "measured (date, commit, host)", "published reference (source)",
           "reproduce")
"""The Markdown table's columns: docs/benchmarks.md's "Learning results" table."""

REFERENCES = {
    ("ppo", "CartPole-v1"): "500 ± 0 at 100k env steps (rl-baselines3-zoo `benchmark.md`, deterministic)",
    ("a2c", "CartPole-v1"): "500 ± 0 at 500k (rl-baselines3-zoo)",
    ("dqn", "CartPole-v1"): "500 ± 0 at 50k (rl-baselines3-zoo)",
    ("pqn", "CartPole-v1"): "495 at 500k (CleanRL `pqn.py`, RAdam, 4 envs × 128 steps)",
    ("ppo", "Pendulum-v1"): "−172 ± 104 at 100k (rl-baselines3-zoo)",
    ("sac", "Pendulum-v1"): "−157 ± 89 at 20k (rl-baselines3-zoo)",
    ("td3", "Pendulum-v1"): "−152 ± 90 at 20k (rl-baselines3-zoo)",
    ("ddpg", "Pendulum-v1"): "−152 ± 94 at 20k (rl-baselines3-zoo)",
    ("sac", "HalfCheetah-v5"): "9,535 ± 100 at 1M, HalfCheetah-v3 (rl-baselines3-zoo); none at 100k",
    ("sac", "Hopper-v5"): "2,326 ± 1,130 at 1M, Hopper-v3 (rl-baselines3-zoo); none at 100k",
    ("sac", "Walker2d-v5"): "3,863 ± 254 at 1M, Walker2d-v3 (rl-baselines3-zoo); none at 100k",
    ("td3", "HalfCheetah-v5"): "9,656 ± 970 at 1M, HalfCheetah-v3 (rl-baselines3-zoo); none below 1M",
    ("td3", "Hopper-v5"): "3,606 ± 4 at 1M, Hopper-v3 (rl-baselines3-zoo); none below 1M",
    ("td3", "Walker2d-v5"): "4,718 ± 46 at 1M, Walker2d-v3 (rl-baselines3-zoo); none below 1M",
    **{("crossq", f"{env}-v5"): "none tabulated (the CrossQ paper, Bhatt et al. 2024, gives curves); "
       "beside the SAC row of the same env, steps and samplers" for env in ("HalfCheetah", "Hopper", "Walker2d")},
    # MAPPO's Spread counts world steps (3 of our agent-steps each) and sums the three agents'
    # rewards, with a collision penalty mpe2 drops at local_ratio 0: docs/benchmarks.md converts.
    ("ppo", "pettingzoo:mpe2.simple_spread_v3"):
        "MAPPO ≈ −120 at 20M world steps (60M of ours), in its units = 3 × ours − 75 − 2 × colliding "
        "pair-steps, i.e. ≈ −15 of ours with no collision (marlbenchmark/on-policy `train_mpe_spread.sh`, "
        "as its issues #49 and #112 report it; local_ratio 0)",
    ("ppo", "pettingzoo:mpe2.simple_adversary_v3"):
        "none in returns (MADDPG, Lowe et al. 2017, gives its physical deception as success rates); "
        "each group's greedy return beside the other's",
}
MINATAR_PAPER = {"Breakout": ("DQN ~10", "~17.5 (AC(λ))"), "SpaceInvaders": ("DQN ~43", "~185 (AC(λ))"),
                 "Asterix": ("DQN ~17", None), "Freeway": ("DQN ~50", None), "Seaquest": ("DQN ~20", None)}
"""The MinAtar paper's values at 5M frames per game (read from its curves): DQN's and, where it
reports one, AC(λ)'s."""
for _game, (_dqn, _ac) in MINATAR_PAPER.items():
    _source = "at 5M frames, Young & Tian 2019 (read from its curves): "
    REFERENCES["dqn", f"MinAtar/{_game}-v1"] = _source + "; ".join(v for v in (_dqn, _ac) if v)
    REFERENCES["ppo", f"MinAtar/{_game}-v1"] = _source + "; ".join(v for v in (_ac, _dqn) if v)
    # No tabulated MinAtar values of PQN's or QR-DQN's were found to quote: these value-based rows
    # stand beside the MinAtar paper's DQN, as the DQN rows do.
    REFERENCES["pqn", f"MinAtar/{_game}-v1"] = REFERENCES["dqn", f"MinAtar/{_game}-v1"]
    REFERENCES["qr_dqn", f"MinAtar/{_game}-v1"] = REFERENCES["dqn", f"MinAtar/{_game}-v1"]
"""(algo.name, env.id) -> the published value a row stands beside, with its step count and
source, as docs/benchmarks.md quotes it; each algorithm's own comparison first."""


def rows(run_dirs: list[Path], reference: str | None = None) -> list[dict]:
    """One row per config over its seeds (``plots.group_runs``), in the order the runs are
    given; ``reference`` (if given) is every row's published reference. Each row is a dict of
    plain values (JSON): per-seed lists in seed order and the fields ``markdown`` formats."""
    configs = {Path(d).resolve(): plots.flat_config(d) for d in run_dirs}
    return [_row(label, sorted(dirs, key=lambda d: configs[d]["run.seed"]), configs, reference)
            for label, dirs in plots.group_runs(configs).items()]


def _row(label: str, dirs: list[Path], configs: dict[Path, dict], reference: str | None) -> dict:
    first = configs[dirs[0]]
    summaries = [runs.summary(d) for d in dirs]
    metas = [provenance.read(d) for d in dirs]
    greedy = [evaluation.latest(d) for d in dirs]
    algo, env = first["algo.name"], first["env.id"]
    return {
        "variant": label, "algorithm": _algorithm_label(algo, first), "env": env, "config": config_name(dirs[0], metas[0]),
        "seeds": [configs[d]["run.seed"] for d in dirs], "runs": [d.name for d in dirs],
        "reasons": [s["reason"] for s in summaries],
        "env_steps": [None if _number(s["env_steps"]) is None else int(_number(s["env_steps"])) for s in summaries],
        "final_returns": [stats.final_return(s) for s in summaries],
        "greedy_returns": [None if g is None else {k: g[k] for k in ("mean_return", "std_return", "episodes",
                                                                       "env_steps", "group_returns") if k in g}
                           for g in greedy],
        "matches": [evaluation.matches(d) for d in dirs],
        "wall_s": [_number(s["wall_s"]) for s in summaries],
        "created": [m.get("created") for m in metas], "commits": _unique(m.get("commit") for m in metas),
        "cpu": _unique(m.get("cpu") for m in metas), "gpu": _unique(m.get("gpu") for m in metas),
        "reference": reference if reference is not None else REFERENCES.get((algo, env)),
        "command": reproduce(dirs, [configs[d]["run.seed"] for d in dirs], metas),
    }


def _algorithm_label(algo: str, config: dict) -> str:
    """The algorithm as a row names it: PPO on V-trace advantages is APPO (Sample Factory's name),
    A2C on them IMPALA's loss without its optimizer, so each gets its own name beside the plain one."""
    if config.get("algo.advantages") != "vtrace" or algo not in ("ppo", "a2c"):
        return algo
    return "APPO (PPO, V-trace advantages)" if algo == "ppo" else "A2C (V-trace advantages)"


def config_name(run_dir: Path, meta: dict) -> str:
    """The config file a run was started from: its grid's, or the first ``.toml`` of its command."""
    record = grid_of(run_dir)
    if record is not None:
        return Path(record.plan["config"]).name
    words = shlex.split(meta.get("command", ""))
    return next((Path(w).name for w in words if w.endswith(".toml")), "")


def grid_of(run_dir: Path) -> gridfile.GridFile | None:
    """The record of the grid that holds ``run_dir`` (its parent directory), or None."""
    try:
        return gridfile.GridFile.load(Path(run_dir).parent)
    except gridfile.NotAGrid:
        return None


def reproduce(dirs: list[Path], seeds: list[int], metas: list[dict]) -> str:
    """The command that makes these runs again: for a grid's runs, ``rlpipe grid`` of its config
    with its overrides and this variant's as ``--set``, these seeds, one run at a time; else each
    run's own command (``meta.json``), the distinct ones joined by ``;``."""
    record = grid_of(dirs[0])
    variant = next((r["variant"] for r in record.plan["runs"] if r["run"] == dirs[0].name), None) if record else None
    if variant is not None:
        plan = record.plan
        overrides = [*plan["overrides"], *next(v["overrides"] for v in plan["variants"] if v["label"] == variant)]
        words = ["rlpipe", "grid", shown_config(Path(plan["config"])), *(w for o in overrides for w in ("--set", o)),
                 "--seeds", ",".join(map(str, seeds)), "--parallel", "1"]
        return shlex.join(words)
    return "; ".join(_unique(m.get("command") for m in metas))


def shown_config(config: Path) -> str:
    """``config`` as a reader types it from the repository's root: a grid records the absolute
    path it ran, and a shipped config (``deploy/configs``) run from another checkout of the
    project is the same file here."""
    shipped = provenance.REPO / "deploy" / "configs"
    if config.is_relative_to(provenance.REPO):
        return str(config.relative_to(provenance.REPO))
    if config.parent.parts[-2:] == shipped.parts[-2:] and (shipped / config.name).is_file():
        return str((shipped / config.name).relative_to(provenance.REPO))
    return str(config)


def markdown(result_rows: list[dict]) -> str:
    """``result_rows`` (``rows``) as docs/benchmarks.md's learning-results table (COLUMNS)."""
    return runs.markdown_table([_cells(r) for r in result_rows], COLUMNS)


def _cells(r: dict) -> dict:
    seeds = ", ".join(map(str, r["seeds"]))
    finals = [v for v in r["final_returns"] if v is not None]
    final = ", ".join(_fmt(v) for v in r["final_returns"]) + f" (seed {seeds})"
    if len(finals) > 1:
        final += f"; median {_fmt(statistics.median(finals))} ({_fmt(min(finals))}–{_fmt(max(finals))})"
    final += f"; ended: {', '.join(_unique(r['reasons'])) or 'not yet'}"
    greedy = [g for g in r["greedy_returns"] if g is not None]
    greedy_text = "; ".join(f"{_fmt(g['mean_return'])} ± {_fmt(g['std_return'])} ({g['episodes']} episodes at "
                            f"{g['env_steps']:,} env steps{_group_text(g)})" for g in greedy)
    if greedy:
        greedy_text += " (± over episodes)"
    if any(r["matches"]):  # a two-player game's evaluations say more as win rates
        greedy_text = _match_text(r)
    gpu = [g for g in r["gpu"] if g and g != "none"]
    host = "; ".join(r["cpu"]) + (f", GPU {'; '.join(gpu)}" if gpu else "")
    cells = {
        "algorithm": r["algorithm"].upper().replace("_", "-") if r["algorithm"].isidentifier() else r["algorithm"],
        "env (config)": r["env"] + (f" (`{r['config']}`)" if r["config"] else ""),
        "env steps": _spread([v for v in r["env_steps"] if v is not None], "{:,.0f}"),
        "seeds": f"{len(r['seeds'])} ({seeds})",
        "final mean return (training window)": final,
        "greedy evaluation": greedy_text or "not measured",
        "wall-clock": ", ".join(_fmt(w) for w in r["wall_s"] if w is not None) + " s",
        "measured (date, commit, host)": f"{_when(r['created'])}, {', '.join(r['commits']) or 'commit not recorded'}, "
                                         f"{host or 'host not recorded'}",
        "published reference (source)": r["reference"] or "—",
        "reproduce": f"`{r['command']}`" if r["command"] else "—",
    }
    return {k: v.replace("|", "\\|") for k, v in cells.items()}  # a | inside a cell would end it


def _group_text(greedy: dict) -> str:
    """An evaluation's mean return per agent group (``episodes.by_group``), where the env has groups."""
    groups = greedy.get("group_returns") or {}
    return "".join(f"; {name} {_fmt(g['mean_return'])}" for name, g in groups.items())


def _match_text(r: dict) -> str:
    """Win rates per seat against each opponent a run's greedy policy played, seed by seed."""
    several = len(r["seeds"]) > 1
    return "; ".join(
        f"{f'seed {seed} ' if several else ''}vs {opponent}: wins {100 * g['win_first']:.1f} / "
        f"{100 * g['win_second']:.1f}% as first / second player ({g['episodes'] // 2} games a seat at "
        f"{g['env_steps']:,} env steps)"
        for seed, games in zip(r["seeds"], r["matches"]) for opponent, g in games.items())


def write(result_rows: list[dict], markdown_path: Path | None = None, json_path: Path | None = None) -> str:
    """The Markdown table of ``result_rows``, also written to ``markdown_path``; the rows as JSON to ``json_path``."""
    table = markdown(result_rows)
    if markdown_path is not None:
        Path(markdown_path).write_text(table + "\n")
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result_rows, indent=1) + "\n")
    return table


def _when(created: list[str | None]) -> str:
    """The runs' creation times (ISO, UTC) as ``2026-12-03 15:35–15:58 UTC``."""
    dates = sorted(c for c in created if c)
    if not dates:
        return "date not recorded"
    first, last = dates[0][:16].replace("T", " "), dates[-1][:16].replace("T", " ")
    return f"{first} UTC" if first == last else f"{first}–{last[11:] if last[:10] == first[:10] else last} UTC"


def _spread(values: list[float], fmt: str) -> str:
    if not values:
        return "—"
    if min(values) == max(values):
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} median ({fmt.format(min(values))}–{fmt.format(max(values))})"


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"


def _number(text) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _unique(values) -> list:
    return [v for v in dict.fromkeys(values) if v]


RECORD = (RUN_CONFIG, META, RESULT, PROGRESS, EVAL_CSV, EVAL_LATEST)
"""The files of a run directory that its results row is built from: what ``keep`` copies."""


def keep(run_dirs: list[Path], dest: Path) -> list[Path]:
    """Copy the RECORD files of each run (no checkpoints, logs, sockets or secret) into
    ``dest/<run>``, or ``dest/<grid>/<run>`` with the grid's record for a grid's run, so that
    ``rows`` of the copies equals ``rows`` of the runs; the copies' directories."""
    kept = []
    for run_dir in map(Path, run_dirs):
        record = grid_of(run_dir)
        target = Path(dest) / (f"{run_dir.parent.name}/{run_dir.name}" if record else run_dir.name)
        target.mkdir(parents=True, exist_ok=True)
        if record is not None:
            shutil.copy2(run_dir.parent / gridfile.GRID_FILE, target.parent / gridfile.GRID_FILE)
        for name in RECORD:
            if (run_dir / name).exists():
                shutil.copy2(run_dir / name, target / name)
        kept.append(target)
    return kept


BEGIN, END = "<!-- rlpipe results: begin -->", "<!-- rlpipe results: end -->"
"""The markers of the section of a Markdown file that ``into`` rewrites."""


def into(path: Path, table: str) -> None:
    """Replace what stands between BEGIN and END in the Markdown file ``path`` with ``table``;
    ValueError naming the file when it has no such section."""
    text = Path(path).read_text()
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise ValueError(f"{path}: no section between {BEGIN} and {END} to write the rows into")
    Path(path).write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")


def section(path: Path) -> str:
    """The table between BEGIN and END in the Markdown file ``path`` ('' without one)."""
    return Path(path).read_text().partition(BEGIN)[2].partition(END)[0].strip()
