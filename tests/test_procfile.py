"""The Procfile runs the same pipeline under honcho (no supervisord)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shared.runtime import evaluation
from shared.launch import rundirs, supervisor
from tests.pipeline import CONFIGS, REPO, Run, free_port, rlpipe_here

pytestmark = pytest.mark.learning


def test_honcho_runs_the_procfile_pipeline(tmp_path):
    out = rlpipe_here("prepare", str(CONFIGS / "cartpole_ppo.toml"), "--set", f"run.runs_dir='{tmp_path}'",
                      "--set", f"network.metrics_port={free_port()}", "--set", "eval.every_s=2.0",
                      "--set", "run.log_interval_s=0.5")
    assert out.returncode == 0, out.stderr
    run_dir = Path(out.stdout.strip())
    env = dict(os.environ, RUN=str(run_dir))
    honcho = subprocess.Popen([sys.executable, "-m", "honcho", "-f", str(REPO / "Procfile"), "start"], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        Run(run_dir).wait_steps(5_000, timeout=90)
        Run(run_dir).wait_for(lambda: evaluation.read_rows(run_dir), 60, "the Procfile's evaluator to report")
    finally:
        os.killpg(honcho.pid, signal.SIGTERM)
        honcho.communicate(timeout=60)
        supervisor.clean(run_dir)
    rows = rundirs.read_progress(run_dir)
    assert int(rows[-1]["updates"]) > 0
    assert list(Path("/dev/shm").glob(f"rlpipe-{run_dir.name}-*")) == []
