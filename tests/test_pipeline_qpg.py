"""DDPG, TD3 and SAC on Pendulum-v1 through the real pipeline, and SAC in serial mode.

The shipped configs carry the references' hyperparameters (400x300 or 256x256 networks,
1-step returns, 10k random steps for DDPG/TD3). These checks learn with 64x64 networks,
3-step returns and 1000 random steps (100 for SAC, as shipped), which reach -200 in 3.5-6k
env steps for a fraction of the learner time: the targets are the issue's (-200 over the
last 10 episodes within 20k env steps, 30k for DDPG).
"""

from __future__ import annotations

import pytest
import torch

from shared.runtime.runfiles import CHECKPOINT
from services.serial import train_serial
from shared.config import loading as config
from tests.pipeline import CONFIGS, rlpipe_here

pytestmark = pytest.mark.learning

SMALL = ("model.hidden_sizes=[64, 64]", "replay.n_step=3")
FAST = (*SMALL, "agent.random_steps=1000", "replay.min_size_to_sample=1000")


def reached(result: dict, steps: int) -> bool:
    return result["reason"] == "target" and result["mean_return"] >= -200 and result["env_steps"] <= steps


def test_sac_pendulum_local_inference_reaches_minus_200_within_20k_steps(runs):
    result = runs("pendulum_sac.toml", "sampler.inference=local", *SMALL).wait_result(300)
    assert reached(result, 20_000), result


def test_td3_pendulum_server_inference_reaches_minus_200_within_20k_steps(runs):
    """The action-server adds each env's Gaussian noise and the random warm-up follows the
    env steps the learner publishes."""
    result = runs("pendulum_td3.toml", "sampler.inference=server", *FAST).wait_result(300)
    assert reached(result, 20_000), result


def test_ddpg_with_ou_noise_and_normalised_observations_reaches_minus_200_within_30k_steps(runs):
    """Ornstein-Uhlenbeck noise: one state per env in the action-server, reset by the
    samplers' episode-start flags. Observation statistics: every env step inserted into
    replay counted once by the learner, checkpointed, used by ``rlpipe evaluate``."""
    run = runs("pendulum_ddpg.toml", "sampler.inference=server", *FAST, 'agent.noise="ou"', "agent.noise_scale=0.2",
               "model.normalize_observations=true")
    result = run.wait_result(300)
    assert reached(result, 30_000), result
    state = torch.load(run.dir / CHECKPOINT, weights_only=True)
    assert state["agent"]["obs_norm.count"].item() == result["env_steps"] == state["env_steps"]
    assert state["agent"]["obs_norm.var"][2] > 1.0  # angular velocity in [-8, 8]: not the initial 1
    out = rlpipe_here("evaluate", str(run.dir), "--episodes", "4")
    assert out.returncode == 0 and "4 greedy episodes" in out.stdout, out.stdout + out.stderr


def test_sac_pendulum_serial_mode_reaches_minus_200_within_20k_steps():
    exp = config.load(CONFIGS / "pendulum_sac.toml", list(SMALL))
    result = train_serial(exp)
    assert reached(result, 20_000), result
