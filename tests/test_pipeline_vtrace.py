"""V-trace through the pipeline: PPO on lagged segments (APPO) learns CartPole."""

from __future__ import annotations

import statistics

import pytest

pytestmark = pytest.mark.learning


def test_appo_reaches_475_on_cartpole_on_segments_six_versions_old(runs):
    """Two samplers with rings of 4 segments run ahead of a learner that trains on one segment a
    batch: batches are ~6 policy versions old (max_policy_lag 8 keeps most of them). PPO with
    V-trace advantages and value targets reaches 475 within 200k env steps. Plain PPO under the
    same lag, side by side: docs/architecture.md, "V-trace for lagged segments"."""
    run = runs("cartpole_ppo.toml", "sampler.count=2", "sampler.ring=4", "replay.max_policy_lag=8",
               'algo.advantages="vtrace"')
    result = run.wait_result(90)
    assert result["reason"] == "target" and result["mean_return"] >= 475 and result["env_steps"] <= 200_000, result
    assert run.config().algo.advantages == "vtrace"
    lags = [float(r["policy_lag"]) for r in run.progress()[1:]]
    assert statistics.mean(lags) >= 4, f"the lag was not forced: {lags}"
