"""Builds the agent, the algorithm and the batch layout an experiment names (one place for all services)."""

from __future__ import annotations

import numpy as np

from shared.agents.config import info_example
from shared.config.schema import ConfigError, Experiment
from shared.runtime.plugins import first_line
from shared.envs.backends import AnyEnvGroup, columns_per_env, make_env_group
from shared.data.layout import segment_spec, slot_spec, step_example
from shared.data.namedarraytuple import from_spec, spec_field


def family(exp: Experiment) -> str:
    """The agent family of the experiment's algorithm: pg, q or qpg (``shared.agents.config.FAMILIES``)."""
    return exp.algo_spec.agent.family


def on_policy(exp: Experiment) -> bool:
    return exp.algo_spec.on_policy


def env_probe(exp: Experiment) -> AnyEnvGroup:
    """One env of the experiment (all its agents' columns), for its spaces and example observation/action."""
    return make_env_group(exp.env, columns_per_env(exp.env), exp.run.seed)


def make_agent(exp: Experiment, probe: AnyEnvGroup):
    """The run's agent, initialised from ``run.seed``: every process that builds it (learner,
    local samplers acting in torch, action-servers) holds the same version-0 parameters, so
    those can act before the learner has published anything. ConfigError (one line) for an
    agent that cannot be built for the env."""
    import torch

    torch.manual_seed(exp.run.seed)
    spec = exp.algo_spec
    try:
        agent = spec.agent.make(probe.example_observation(), probe.action_space, exp.model, exp.agent, exp.algo,
                                obs_space=probe.observation_space)
    except (ValueError, RuntimeError, TypeError) as e:
        raise ConfigError(f"the {spec.name} agent (encoder = {exp.model.encoder!r}) cannot be built for {exp.env.id}: "
                          f"{first_line(e)}") from None
    # The config checks pass any agent of the pg and q families; one of a user's own may know
    # nothing of groups, and make_encoder leaves the group leaf out: one network for all, unasked.
    if exp.env.groups and getattr(agent, "members", None) is None:
        raise ConfigError(f"env.groups: the {spec.name} agent ({spec.agent.name}) holds no networks per agent group "
                          "(members, shared.agents.groups); groups need the built-in PPO, A2C, IMPALA or DQN-family "
                          "agents; leave env.groups out")
    return agent


def check_buildable(exp: Experiment) -> None:
    """Build the env and the agent as every service will, so that a model that cannot
    exist is one ConfigError before anything starts (``rlpipe prepare``, grids)."""
    probe = env_probe(exp)
    try:
        make_agent(exp, probe)
    finally:
        probe.close()


def make_algo(exp: Experiment, agent):
    return exp.algo_spec.make(agent, exp.algo)


def agent_info(exp: Experiment):
    """``info(action_example)``: one env's agent info of zeros for the run's agent (the layout
    the acting side writes back with each action; a recurrent agent's ``Memory`` holds an
    action like ``action_example``)."""

    def info(action_example):
        return info_example(family(exp), exp.model, action_example, exp.agent)

    return info


def example_step(exp: Experiment, probe: AnyEnvGroup):
    """One step of samples of the experiment (the layout of every buffer that holds steps)."""
    action = probe.example_action()
    return step_example(probe.example_observation(), action, agent_info(exp)(action))


def step_buffers(exp: Experiment, group: AnyEnvGroup, n: int) -> tuple:
    """Buffers to step ``group``'s ``n`` = B columns with the run's agent: (slot: observation and action
    [B, ...], final observations [B, ...], reward [B], terminated [B], truncated [B], first [B]).
    first starts all True: per-env state (recurrent agents) resets at each episode start."""
    example = example_step(exp, group)
    slot = from_spec(slot_spec(example, n))
    final_obs = from_spec(slot_spec(example, n)).observation  # written on episode ends
    return slot, final_obs, np.zeros(n, np.float32), np.zeros(n, bool), np.zeros(n, bool), np.ones(n, bool)


def batch_items(exp: Experiment) -> int:
    """What the learner asks replay for per batch: segments (on-policy), transitions or sequences (r2d1)."""
    return exp.algo_spec.batch_kind.items(exp.learner, exp.algo)


def round_items(exp: Experiment) -> int:
    """What replay takes from its table for one batch of every learner rank: the batch's
    segments on-policy (the ranks split their env columns), a sample for each rank off-policy."""
    return batch_items(exp) * (1 if on_policy(exp) else exp.learner.count)


def batch_spec(exp: Experiment, example):
    """Layout of one learner batch slot: OnPolicyBatch [T, n*B / learner.count] (a rank's share
    of the env columns), Transition [batch_size] or SequenceBatch [sequence_length, batch_size] (r2d1)."""
    samples = spec_field(segment_spec(example, exp.sampler.horizon, exp.sampler.envs), "samples")
    return exp.algo_spec.batch_kind.batch_spec(samples, exp.replay, batch_items(exp), exp.learner.count)
