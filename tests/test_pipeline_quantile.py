"""QR-DQN and IQN through the real pipeline: CartPole-v1 to 475 within 150k env steps."""

from __future__ import annotations

import pytest

from shared.agents.acting import read_acting_file

pytestmark = pytest.mark.learning


def test_qr_dqn_cartpole_reaches_475_within_150k_steps(runs):
    """Local inference: the samplers act in numpy from QR-DQN's acting plan (the mean of the quantiles)."""
    run = runs("cartpole_qr_dqn.toml", "sampler.inference=local")
    result = run.wait_result(150)
    assert result["reason"] == "target" and result["mean_return"] >= 475 and result["env_steps"] <= 150_000, result
    assert read_acting_file(run.dir)["plan"]["n_atoms"] == run.config().algo.n_quantiles


def test_iqn_cartpole_reaches_475_within_150k_steps(runs):
    """Local inference: IQN has no acting plan, the samplers draw its K fractions in torch."""
    run = runs("cartpole_iqn.toml", "sampler.inference=local")
    result = run.wait_result(150)
    assert result["reason"] == "target" and result["mean_return"] >= 475 and result["env_steps"] <= 150_000, result
    assert read_acting_file(run.dir)["plan"] is None
