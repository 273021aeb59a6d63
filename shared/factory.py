"""Builds the agent and the algorithm an experiment names (one place, used by every service)."""

from __future__ import annotations

from shared.agents import PgAgent
from shared.config import Experiment
from shared.envs import EnvGroup


def env_probe(exp: Experiment) -> EnvGroup:
    """One env of the experiment, for its spaces and example observation/action."""
    return EnvGroup(exp.env, 1, exp.run.seed)


def make_agent(exp: Experiment, probe: EnvGroup) -> PgAgent:
    return PgAgent(probe.example_observation(), probe.action_space, exp.model, exp.agent)


def make_algo(exp: Experiment, agent: PgAgent):
    from shared.algos.a2c import A2C
    from shared.algos.ppo import PPO

    return {"ppo": PPO, "a2c": A2C}[exp.algo_name](agent, exp.algo)
