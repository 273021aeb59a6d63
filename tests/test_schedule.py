"""What the algorithm's schedules (annealed learning rates) count as the run's fraction done,
``run.schedule_by``: env steps of ``max_env_steps`` by default; with ``budget``, the wall-clock's
share of ``max_wall_s`` where that is further along, so that a run bounded by time anneals fully
by its end, counting the seconds of earlier incarnations as a resume restores them."""

from __future__ import annotations

import pytest
import torch

from services.build import env_probe, example_step, make_agent, make_algo
from services.learner.learner import Learner
from shared.config import loading as config
from shared.config.schema import ConfigError
from tests.pipeline import CONFIGS
from tests.test_ranks import random_batch


def learning_rate(run_dir, schedule_by: str, wall_before: float, env_steps: int) -> float:
    """The learning rate of PPO's update on CartPole (lr annealed to 0 over the run) after a
    batch that brings the run to ``env_steps`` of 100,000, ``wall_before`` of 600 s having passed."""
    exp = config.load(CONFIGS / "cartpole_ppo.toml", [f"run.schedule_by='{schedule_by}'", "run.max_env_steps=100000",
                                                      "run.max_wall_s=600"])
    probe = env_probe(exp)
    agent = make_agent(exp, probe)
    slot = random_batch(exp, example_step(exp, probe), seed=0)
    probe.close()
    learner = Learner(exp, agent, make_algo(exp, agent), torch.device("cpu"), run_dir)
    learner.progress.wall_before = wall_before
    learner.train(slot, {"env_steps": env_steps, "episodes": []})
    return learner.last_stats["lr"] / exp.algo.lr


@pytest.mark.parametrize("schedule_by, wall_before, env_steps, left", [
    ("env_steps", 450.0, 10_000, 0.9),  # three quarters of the time gone count for nothing
    ("budget", 450.0, 10_000, 0.25),  # the wall-clock is further along: 450 of 600 s
    ("budget", 30.0, 10_000, 0.9),  # the env steps are: 10% against 5%
])
def test_the_learning_rate_anneals_by_the_budget_nearer_its_end(tmp_path, schedule_by, wall_before, env_steps, left):
    assert learning_rate(tmp_path, schedule_by, wall_before, env_steps) == pytest.approx(left, abs=0.01)


def test_schedule_by_is_checked():
    with pytest.raises(ConfigError, match=r"^run.schedule_by = 'wall': allowed: env_steps, budget$"):
        config.load(CONFIGS / "cartpole_ppo.toml", ["run.schedule_by='wall'"])
    with pytest.raises(ConfigError, match=r"^run.schedule_by = 'budget' with learner.count = 2: "):
        config.load(CONFIGS / "cartpole_ppo.toml", ["run.schedule_by='budget'", "learner.count=2"])
