"""A user's own algorithm and encoder (tests/extending_for_tests.py), named in a config as
``module:attribute``, run everywhere the built-ins run: serial mode, the pipeline with local
and with server inference, and data-parallel learner ranks; nothing in services/ or shared/
names them. A reference that does not resolve is one config error before anything starts."""

from __future__ import annotations

import pytest

from shared.launch import api
from tests.pipeline import REPO, rlpipe

CONFIG = str(REPO / "tests" / "configs" / "cartpole_clipped_pg.toml")


def _learned(result: dict, target: float = 475) -> None:
    assert result["reason"] == "target" and result["mean_return"] >= target and result["env_steps"] <= 300_000, result


@pytest.mark.learning
def test_an_out_of_tree_algorithm_and_encoder_learn_cartpole_in_serial_mode(tmp_path):
    # 200, as through the action-server: local inference's pipeline check holds 475 for the same
    # agent, and serial mode's 475 took 30 s of make test's 14:47.
    result = api.train_serial(api.experiment(CONFIG, [f"run.runs_dir='{tmp_path}'", "run.target_return=200"]),
                              quiet=True)
    _learned(result, 200)


@pytest.mark.learning
@pytest.mark.parametrize("inference,target", [("local", 475), ("server", 200)])
def test_an_out_of_tree_algorithm_and_encoder_learn_cartpole_through_the_pipeline(runs, inference, target):
    """Both inference modes act with the out-of-tree agent; 475 is reached with local inference,
    200 through the action-server (and in serial mode), which costs a third of the time (in CI
    its 475 took 69 s, the longest test of make test)."""
    run = runs(CONFIG, f"sampler.inference={inference}", f"run.target_return={target}")
    _learned(run.wait_result(240), target)
    assert "learner: tests.extending_for_tests:CLIPPED_PG on cpu" in run.logs("learner0")


@pytest.mark.learning
def test_an_out_of_tree_algorithm_trains_on_two_learner_ranks(runs):
    # Training, not learning, is the claim (the pipeline checks above learn): ~40 updates of 256
    # env steps, each all-reduced over both ranks, show it as well as 80 did.
    run = runs(CONFIG, "learner.count=2", "run.max_env_steps=10000")
    result = run.wait_result(120)
    assert result["reason"] == "budget" and result["updates"] >= 10000 // 256 - 1, result
    for rank in (0, 1):
        assert f"learner rank {rank} of 2" in run.logs(f"learner{rank}")


@pytest.mark.parametrize("field,ref,says", [
    ("algo.name", "no_such_lab.algos:SPEC", "cannot import module 'no_such_lab.algos' (No module named 'no_such_lab')"),
    ("algo.name", "tests.extending_for_tests:NO_SUCH_SPEC",
     "module 'tests.extending_for_tests' has no attribute 'NO_SUCH_SPEC'"),
    ("algo.name", "tests.extending_for_tests:ClippedPG",
     "type is not an AlgoSpec (shared.algos.registry.AlgoSpec; docs/extending.md)"),
    ("model.encoder", "tests.extending_for_tests:NoSuchEncoder",
     "module 'tests.extending_for_tests' has no attribute 'NoSuchEncoder'"),
])
def test_a_reference_that_does_not_resolve_is_one_line_before_anything_starts(tmp_path, field, ref, says):
    out = rlpipe("launch", CONFIG, "--set", f"{field}='{ref}'", "--set", f"run.runs_dir='{tmp_path}'")
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr.splitlines() == [f"rlpipe: config error: {field} = {ref!r}: {says}"], out.stderr
    assert not any(tmp_path.iterdir())  # no run directory
