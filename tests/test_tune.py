"""`rlpipe tune`: parameter specs, their check against the config schema, the pruner's
checkpoints, and one real tune (CartPole PPO, 4 trials, 2 at a time) read back with optuna."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from shared.config import loading
from shared.config.schema import ConfigError
from shared.launch import rundirs, supervisor
from shared.launch.lab import runs, tune
from shared.runtime.runfiles import RUN_CONFIG
from tests.pipeline import CONFIGS, rlpipe_here

optuna = pytest.importorskip("optuna")

CONFIG = str(CONFIGS / "cartpole_ppo.toml")


def drawn(param: tune.Param, n: int = 30) -> list:
    """``n`` values of ``param`` drawn by a real (in-memory) study's random sampler."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    values = []
    for _ in range(n):
        trial = study.ask()
        values.append(param.suggest(trial))
        study.tell(trial, 0.0)
    return values


def test_each_distribution_parses_and_draws_within_its_bounds_as_a_value_the_config_takes():
    lr = tune.parse_param("algo.lr=loguniform:1e-4:3e-3")
    assert (lr.key, lr.kind, lr.low, lr.high) == ("algo.lr", "loguniform", 1e-4, 3e-3)
    values = drawn(lr)
    assert all(1e-4 <= v <= 3e-3 for v in values)
    assert sum(v < math.sqrt(1e-4 * 3e-3) for v in values) >= 8  # log scale: about half below the geometric mean
    lam = tune.parse_param(" algo.gae_lambda = uniform:0.9:0.99")
    assert all(0.9 <= v <= 0.99 for v in drawn(lam))
    epochs = tune.parse_param("algo.epochs=int:1:8")
    assert set(drawn(epochs, 60)) == set(range(1, 9))
    mb = tune.parse_param("algo.minibatches=choice:1,2,4")
    assert set(drawn(mb)) == {1, 2, 4}
    adv = tune.parse_param("algo.advantages=choice:gae,'vtrace'")
    assert adv.choices == ("gae", "vtrace")
    for param, value, field in ((lr, 0.00123, ("algo", "lr")), (epochs, 3, ("algo", "epochs")),
                                (mb, 4, ("algo", "minibatches")), (adv, "vtrace", ("algo", "advantages"))):
        exp = loading.load(CONFIG, [param.override(value)])
        assert getattr(getattr(exp, field[0]), field[1]) == value


@pytest.mark.parametrize("spec, says", [
    ("algo.lr", "expected section.key=DISTRIBUTION:ARGS"),
    ("lr=uniform:1:2", "expected section.key=DISTRIBUTION:ARGS"),
    ("algo.lr=normal:0:1", "unknown distribution 'normal' (known: loguniform, uniform, int, choice"),
    ("algo.lr=uniform:1e-4", "expected uniform:LOW:HIGH with number bounds"),
    ("algo.lr=uniform:a:b", "expected uniform:LOW:HIGH with number bounds"),
    ("algo.epochs=int:1.5:8", "expected int:LOW:HIGH with integer bounds"),
    ("algo.lr=uniform:3e-3:1e-4", "LOW must be below HIGH"),
    ("algo.lr=loguniform:0:1e-3", "loguniform needs LOW > 0"),
    ("algo.minibatches=choice:", "expected choice:V1,V2,... with no empty value"),
    ("algo.minibatches=choice:1,,2", "expected choice:V1,V2,... with no empty value"),
    ("algo.minibatches=choice:1,[2]", "a choice must be a number, a string or a boolean"),
    ("algo.minibatches=choice:1,2,1", "a value is given twice"),
])
def test_a_spec_that_does_not_parse_is_one_line_naming_it(spec, says):
    with pytest.raises(ConfigError) as e:
        tune.parse_param(spec)
    assert str(e.value).startswith(f"--param {spec!r}: ") and says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("spec, says", [
    ("algo.lrr=loguniform:1e-4:3e-3", "unknown key algo.lrr (did you mean 'lr'?)"),
    ("trainer.lr=uniform:0.1:0.2", "unknown section [trainer]"),
    ("algo.epochs=uniform:1:8", "at 1.0: algo.epochs = 1.0: expected int, got float"),
    ("algo.gae_lambda=uniform:0.9:1.5", "at 1.5: [algo]: PPOConfig: need 0 <= gamma <= 1 and 0 <= gae_lambda <= 1"),
    ("algo.minibatches=choice:1,'two'", "at 'two': algo.minibatches = 'two': expected int"),
])
def test_a_parameter_the_config_cannot_take_fails_before_any_trial(spec, says, tmp_path):
    out = rlpipe_here("tune", CONFIG, "--param", "algo.lr=loguniform:1e-4:3e-3", "--param", spec, "--trials", "4",
                      "--out", str(tmp_path / "tune"))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("rlpipe: config error: --param ") and says in out.stderr
    assert not (tmp_path / "tune").exists()


def test_two_distributions_for_one_field_or_none_at_all_are_refused():
    with pytest.raises(ConfigError, match="--param algo.lr is given twice"):
        tune.parse_params(["algo.lr=uniform:1e-4:1e-3", "algo.lr=loguniform:1e-4:1e-3"])
    with pytest.raises(ConfigError, match="give at least one --param"):
        tune.parse_params([])


def test_without_optuna_tune_names_the_extra_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "optuna", None)  # `import optuna` raises ImportError, as when not installed
    out = rlpipe_here("tune", CONFIG, "--param", "algo.lr=loguniform:1e-4:3e-3", "--trials", "2",
                      "--out", str(tmp_path / "tune"))
    assert out.returncode == 2
    assert out.stderr == "rlpipe: rlpipe tune needs optuna, which is not installed: pip install 'rlpipe[tune]' (optuna>=3.6)\n"


def row(steps: int, value: float) -> dict:
    return {"env_steps": str(steps), "mean_return": str(value)}


def test_checkpoints_fall_on_the_same_env_steps_in_every_run_whenever_its_rows_come():
    c = tune.Checkpoints(500)
    assert c.add(row(256, 10.0)) == []
    assert c.add(row(768, float("nan"))) == []  # no episode has ended: nothing to report yet
    assert c.add(row(1024, 12.0)) == [(500, 12.0), (1000, 12.0)]
    assert c.add(row(1280, 13.0)) == []
    assert c.add(row(1536, 15.0)) == [(1500, 15.0)]
    # A run that ended at its target after 3 of 5 checkpoints holds its final return for the rest.
    assert c.area(20.0, 5) == pytest.approx((12 + 12 + 15 + 20 + 20) / 5)


BUDGET = 30_000


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """(tune directory, `rlpipe tune` output) of 4 trials of algo.lr over two decades, 2 at a time,
    BUDGET env steps each (CartPole returns stay far below the target 475), pruning after 1 trial."""
    root = tmp_path_factory.mktemp("tune")
    out = rlpipe_here("tune", CONFIG, "--param", "algo.lr=loguniform:3e-5:3e-3", "--param", "algo.epochs=int:4:20",
                      "--trials", "4", "--parallel", "2", "--startup-trials", "1", "--seed", "1",
                      "--out", str(root / "study"), "--set", f"run.runs_dir='{root}'",
                      "--set", f"run.max_env_steps={BUDGET}", "--set", "run.log_interval_s=0.25",
                      "--set", "network.metrics_port=0")
    yield root / "study", out
    for d in runs.find_runs(root):
        killed, removed = supervisor.clean(d)
        assert not killed and not removed, f"{d.name} left processes {killed} or segments {removed}"


def test_a_tune_prunes_or_finishes_every_trial_each_a_run_stopped_clean(tuned):
    tune_dir, out = tuned
    assert out.returncode == 0, out.stderr
    study = optuna.load_study(study_name="cartpole_ppo", storage=f"sqlite:///{tune_dir / tune.STUDY_DB}")
    trials = study.trials
    assert [t.number for t in trials] == [0, 1, 2, 3]
    assert all(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED) for t in trials), \
        [(t.number, t.state) for t in trials]
    every = BUDGET // tune.CHECKPOINTS
    for t in trials:
        run_dir = tune_dir / t.user_attrs["run"]
        assert run_dir.parent == tune_dir and (run_dir / RUN_CONFIG).exists()
        exp = loading.load(run_dir / RUN_CONFIG)
        assert (exp.algo.lr, exp.algo.epochs) == (t.params["algo.lr"], t.params["algo.epochs"])
        assert t.intermediate_values and all(step % every == 0 for step in t.intermediate_values)
        assert not supervisor.running(run_dir)
        assert not list(Path("/dev/shm").glob(f"rlpipe-{run_dir.name}-*"))
        result = rundirs.read_result(run_dir)
        if t.state == optuna.trial.TrialState.COMPLETE:
            assert t.user_attrs["reason"] == "budget" and result["env_steps"] >= BUDGET
            assert t.value == result["mean_return"]  # --metric final: the learner's mean return at the end
        else:  # stopped at a checkpoint before its budget where it fell below the median, before its end
            assert t.user_attrs["reason"] == "pruned" and result is None
            # (a progress row can pass the last checkpoint and the budget at once on a loaded machine:
            # the checkpoint it was pruned at is what is before the budget, not the run's last row)
            assert max(t.intermediate_values) < BUDGET, t.intermediate_values
    assert any(t.state == optuna.trial.TrialState.PRUNED for t in trials)
    lines = (tune_dir / tune.SUMMARY).read_text().splitlines()
    assert lines[0] == "| trial | state | value | algo.lr | algo.epochs | reason | env_steps | wall_s | run |"
    assert [line.split(" | ")[1] for line in lines[2:]] == [t.state.name for t in trials]
    assert "\n".join(lines) in out.stdout


def test_the_best_trials_config_loads_and_launches(tuned, tmp_path):
    tune_dir, out = tuned
    study = optuna.load_study(study_name="cartpole_ppo", storage=f"sqlite:///{tune_dir / tune.STUDY_DB}")
    best = study.best_trial
    path = tune_dir / tune.BEST_CONFIG
    assert f"best config: {path}" in out.stdout
    exp = loading.load(path)
    assert (exp.algo.lr, exp.algo.epochs) == (best.params["algo.lr"], best.params["algo.epochs"])
    assert exp.run.max_env_steps == BUDGET and exp.env.id == "CartPole-v1"
    prepared = rlpipe_here("prepare", str(path), "--set", f"run.runs_dir='{tmp_path}'")  # launch, short of starting
    assert prepared.returncode == 0, prepared.stderr
