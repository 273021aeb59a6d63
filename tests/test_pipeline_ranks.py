"""Data-parallel learner ranks through the real pipeline (``learner.count = 2``, gloo)."""

from __future__ import annotations

import os
import signal

import pytest

from shared.launch import supervisor as launch
from tests.pipeline import rlpipe

pytestmark = pytest.mark.learning


def test_two_learner_ranks_learn_ppo_cartpole_and_restart_together_after_a_kill(runs):
    """Two ranks train PPO on their halves of every batch and reach 475 within 200k env steps;
    their parameters are compared every 100 updates. Rank 1 killed with SIGKILL takes rank 0
    down with it (its next all-reduce fails), supervisord restarts both, and both resume from
    rank 0's checkpoint."""
    run = runs("cartpole_ppo.toml", "learner.count=2", "learner.checkpoint_interval_s=1.0")
    run.wait_for(lambda: (run.dir / "checkpoints" / "latest.pt").exists(), 60, "a checkpoint")
    pids = [run.pid("learner0"), run.pid("learner1")]
    os.kill(pids[1], signal.SIGKILL)
    for rank, pid in enumerate(pids):
        run.wait_for(lambda: run.status().get(f"learner{rank}", ("", None))[1] not in (None, pid), 30,
                     f"supervisord to restart learner rank {rank}")
    result = run.wait_result(240)
    assert result["reason"] == "target" and result["mean_return"] >= 475 and result["env_steps"] <= 200_000, result
    for rank in (0, 1):
        log = run.logs(f"learner{rank}")
        assert log.count(f"learner rank {rank} of 2 joined the group") == 2, log[-3000:]
        assert "resumed from" in log, log[-3000:]  # both from the same checkpoint: checked as they rejoin
    assert "parameters identical on 2 ranks at update" in run.logs("learner0")
    out = rlpipe("stop", str(run.dir))
    assert out.returncode == 0, out.stdout + out.stderr
    assert launch.service_pids(run.dir) == [] and run.segments() == []
