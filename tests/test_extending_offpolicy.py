"""docs/extending.md's off-policy path as a user meets it: the batch tables it documents are the
code's, and its Munchausen-DQN example, written out from the page itself into a project of its
own, runs from that project's directory in serial mode, through the pipeline and in
`rlpipe evaluate` (the commands run with ``python -P``: like the installed ``rlpipe`` script, the
working directory is not on ``sys.path`` unless rlpipe puts it there)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from shared.data import batches
from shared.launch import rundirs
from tests.pipeline import REPO, Run, free_port

DOC = (REPO / "docs" / "extending.md").read_text()


def documented_fields(name: str) -> list[str]:
    """The first column of the table after the paragraph that starts with `name`."""
    after = DOC.split(f"\n`{name}`", 1)[1]
    table = re.search(r"\n\| field \|.*?\n\|---.*?\n((?:\|.*\n)+)", after).group(1)
    return [re.match(r"\| `(\w+)` \|", row).group(1) for row in table.splitlines()]


@pytest.mark.parametrize("name", ["Transition", "WindowSteps", "SequenceBatch", "OnPolicyBatch", "Samples"])
def test_the_documented_batch_fields_are_the_codes(name):
    assert documented_fields(name) == list(getattr(batches, name)._fields)


def project(tmp_path):
    """tmp_path/proj/mylab/: __init__.py and every file the page writes out (mdqn.py,
    mdqn_nstep.py, cartpole_mdqn.toml)."""
    root = tmp_path / "proj"
    (root / "mylab").mkdir(parents=True)
    (root / "mylab" / "__init__.py").write_text("")
    for path, block in re.findall(r"```(?:python|toml)\n# (mylab/\S+)\n(.*?)```", DOC, re.S):
        (root / path).write_text(block)
    assert {"mdqn.py", "mdqn_nstep.py", "cartpole_mdqn.toml"} <= {p.name for p in (root / "mylab").iterdir()}
    return root


def rlpipe_in(cwd, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "shared.launch.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.learning
@pytest.mark.parametrize("overrides", [
    [],
    # the page's exact n-step M-DQN, on the same budget
    ["algo.name='mylab.mdqn_nstep:SPEC'", "replay.n_step=3", "replay.store_steps=true"],
], ids=["mdqn", "exact-n-step-mdqn"])
def test_the_documented_munchausen_dqn_learns_in_serial_mode_from_its_projects_directory(tmp_path, overrides):
    """The page's config and budget; the run ends at the bar (150) instead of spending the rest of
    its 100k steps on the page's 475, which it does not reach."""
    root = project(tmp_path)
    sets = [arg for override in [*overrides, "run.target_return=150"] for arg in ("--set", override)]
    out = rlpipe_in(root, "train", "mylab/cartpole_mdqn.toml", "--serial", "--set", f"run.runs_dir='{tmp_path}/runs'",
                    *sets)
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = next((tmp_path / "runs").iterdir())
    result = json.loads((run_dir / "result.json").read_text())
    # random play: ~22; the page says ~190 at 100k steps
    assert result["reason"] == "target" and result["mean_return"] >= 150 and result["env_steps"] <= 100_000, result
    # One wall-clock: the last progress row, result.json and the command's own last words agree.
    assert float(rundirs.read_progress(run_dir)[-1]["wall_s"]) == result["wall_s"]
    assert f"in {result['wall_s']:.1f} s" in out.stdout.splitlines()[-2], out.stdout
    # Replay's lag is the sampled data's age in updates (docs/architecture.md, "Policy lag").
    assert float(rundirs.read_progress(run_dir)[-1]["policy_lag"]) > 100


@pytest.mark.learning
def test_the_documented_munchausen_dqn_trains_through_the_pipeline_and_evaluates(tmp_path):
    root = project(tmp_path)
    port = free_port()
    out = rlpipe_in(root, "launch", "mylab/cartpole_mdqn.toml", "--detach", "--set", f"run.runs_dir='{tmp_path}/runs'",
                    "--set", f"network.metrics_port={port}", "--set", "run.max_env_steps=4000",
                    "--set", "run.log_interval_s=0.5", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    run = Run(re.search(r"run directory: (\S+)", out.stdout).group(1), port)
    try:  # training, not learning (the serial check learns): 4k env steps, past min_size_to_sample 1000
        result = run.wait_result(180)
        assert result["reason"] == "budget" and result["updates"] > 0, result
        assert "learner: mylab.mdqn:SPEC on cpu" in run.logs("learner0")
    finally:
        run.close()
    assert run.segments() == []
    evaluated = rlpipe_in(root, "evaluate", str(run.dir), "--episodes", "2", timeout=120)
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    assert re.search(r": 2 greedy episodes of policy version \d+ .*: return \d", evaluated.stdout), evaluated.stdout
