"""The numpy acting step equals the torch agents' step: same greedy actions, log-probs and
values, samples from the same distributions, and it follows parameter versions loaded in place."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from shared.acting import Actor, acting_seed
from shared.agent_config import ModelConfig, PgAgentConfig, QAgentConfig, QpgAgentConfig
from shared.agents import EVALUATE, StepContext
from shared.agents.numpy_acting import numpy_actor
from shared.agents.pg import PgAgent
from shared.agents.q import QAgent
from shared.agents.qpg import SacAgent

OBS = np.zeros(4, np.float32)
ATOL = 2e-5


def _obs(n: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 2.0, (n, 4)).astype(np.float32)


def _normalised(agent) -> None:
    """Observation statistics far from the initial ones, so that normalising matters."""
    if agent.obs_norm is not None:
        agent.obs_norm.mean.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64))
        agent.obs_norm.var.copy_(torch.tensor([4.0, 0.25, 9.0, 1.0], dtype=torch.float64))


def _rng():
    return np.random.default_rng(0)


PG_SPACES = {"discrete": gym.spaces.Discrete(3), "multi_discrete": gym.spaces.MultiDiscrete([2, 4]),
             "box": gym.spaces.Box(-1.0, 1.0, (2,), np.float32)}


@pytest.mark.parametrize("space", PG_SPACES)
@pytest.mark.parametrize("model", [ModelConfig(hidden_sizes=(64, 64)),
                                   ModelConfig(hidden_sizes=(32,), activation="relu", normalize_observations=True)])
@pytest.mark.parametrize("shared_encoder", [False, True])
def test_policy_gradient_agents_act_as_in_torch(space, model, shared_encoder):
    torch.manual_seed(0)
    agent = PgAgent(OBS, PG_SPACES[space], model, PgAgentConfig(shared_encoder=shared_encoder))
    _normalised(agent)
    actor, obs = numpy_actor(agent, _rng()), _obs()
    assert actor is not None
    with torch.no_grad():
        want_action, want = agent.step(torch.from_numpy(obs), EVALUATE)
        action, info = actor.step(obs, EVALUATE)
        np.testing.assert_allclose(action, want_action.numpy(), atol=ATOL)  # the mode
        np.testing.assert_allclose(info.log_prob, want.log_prob.numpy(), atol=ATOL)
        np.testing.assert_allclose(info.value, want.value.numpy(), atol=ATOL)
        # Sampled actions carry their exact log-probs and the values of their observations.
        action, info = actor.step(obs, StepContext())
        log_prob, _, value = agent.evaluate(torch.from_numpy(obs), torch.from_numpy(action))
    assert action.dtype == want_action.numpy().dtype and action.shape == want_action.shape
    assert info.log_prob.dtype == info.value.dtype == np.float32
    np.testing.assert_allclose(info.log_prob, log_prob.numpy(), atol=ATOL)
    np.testing.assert_allclose(info.value, value.numpy(), atol=ATOL)


def test_categorical_samples_follow_the_softmax():
    torch.manual_seed(1)
    agent = PgAgent(OBS, gym.spaces.Discrete(3), ModelConfig(hidden_sizes=(8,)))
    with torch.no_grad():
        agent.pi_head.net[0].bias.copy_(torch.tensor([1.0, 0.0, -1.0]))  # a policy far from uniform
        obs = np.repeat(_obs(1), 30_000, axis=0)
        probs = torch.softmax(agent._forward(torch.from_numpy(obs[:1]))[0], -1)[0].numpy()
    action, _ = numpy_actor(agent, _rng()).step(obs, StepContext())
    np.testing.assert_allclose(np.bincount(action, minlength=3) / len(action), probs, atol=0.01)


def test_gaussian_samples_have_the_policy_mean_and_std():
    torch.manual_seed(2)
    agent = PgAgent(OBS, PG_SPACES["box"], ModelConfig(hidden_sizes=(8,)), PgAgentConfig(init_log_std=-0.5))
    obs = np.repeat(_obs(1), 30_000, axis=0)
    with torch.no_grad():
        mean = agent._forward(torch.from_numpy(obs[:1]))[0][0].numpy()
    action, _ = numpy_actor(agent, _rng()).step(obs, StepContext())
    np.testing.assert_allclose(action.mean(0), mean, atol=0.01)
    np.testing.assert_allclose(action.std(0), np.exp(-0.5), atol=0.01)


@pytest.mark.parametrize("dueling", [False, True])
@pytest.mark.parametrize("distributional", [False, True])
def test_q_agents_act_as_in_torch(dueling, distributional):
    torch.manual_seed(3)
    cfg = QAgentConfig(dueling=dueling, distributional=distributional, n_atoms=11, v_min=-5.0, v_max=5.0,
                       eps_eval=0.0, eps_start=1.0, eps_decay_steps=1000, eps_end=0.0)
    agent = QAgent(OBS, gym.spaces.Discrete(4), ModelConfig(hidden_sizes=(32, 32), activation="relu",
                                                           normalize_observations=True), cfg)
    _normalised(agent)
    actor, obs = numpy_actor(agent, _rng()), _obs()
    with torch.no_grad():
        q = agent.q_values(torch.from_numpy(obs)).numpy()
    action, info = actor.step(obs, EVALUATE)
    np.testing.assert_array_equal(action, q.argmax(-1))
    np.testing.assert_allclose(info.value, q.max(-1), atol=ATOL)
    # Each env's epsilon from the agent's schedule: 1 at step 0 (uniform), 0 once decayed (greedy).
    action, _ = actor.step(np.repeat(obs[:1], 20_000, axis=0), StepContext(env_steps=0))
    np.testing.assert_allclose(np.bincount(action, minlength=4) / len(action), 0.25, atol=0.015)
    action, _ = actor.step(obs, StepContext(env_steps=5_000))
    np.testing.assert_array_equal(action, q.argmax(-1))


def test_the_actor_follows_parameters_loaded_in_place():
    """Parameter versions are copied into the agent's tensors (shared.params): the numpy views see them."""
    torch.manual_seed(4)
    agent = PgAgent(OBS, gym.spaces.Discrete(3), ModelConfig(hidden_sizes=(16,), normalize_observations=True))
    other = PgAgent(OBS, gym.spaces.Discrete(3), ModelConfig(hidden_sizes=(16,), normalize_observations=True))
    _normalised(other)
    actor, obs = numpy_actor(agent, _rng()), _obs()
    before = actor.step(obs, EVALUATE)[1].value.copy()
    agent.load_state_dict(other.state_dict())
    with torch.no_grad():
        want = other.step(torch.from_numpy(obs), EVALUATE)[1].value.numpy()
    after = actor.step(obs, EVALUATE)[1].value
    assert not np.allclose(before, want)
    np.testing.assert_allclose(after, want, atol=ATOL)


def test_agents_the_numpy_step_does_not_cover_act_in_torch():
    recurrent = PgAgent(OBS, gym.spaces.Discrete(2), ModelConfig(hidden_sizes=(8,), lstm_size=8))
    image = QAgent(np.zeros((4, 84, 84), np.uint8), gym.spaces.Discrete(2), ModelConfig(encoder="nature_cnn"))
    continuous = SacAgent(OBS, PG_SPACES["box"], ModelConfig(hidden_sizes=(8,)), QpgAgentConfig())
    for agent in (recurrent, image, continuous):
        assert numpy_actor(agent, _rng()) is None
    # ...and the Actor runs them in torch, with the same call.
    actor = Actor(continuous, acting_seed(0, "sampler", 0))
    action, _ = actor(_obs(5), np.arange(5), np.zeros(5, bool), np.zeros(5, np.float32), 0, 5)
    assert action.shape == (5, 2) and np.all(np.abs(action) <= 1.0)


def test_acting_processes_draw_different_noise():
    """Every sampler and action-server of a run gets its own stream (they all build the agent from run.seed)."""
    torch.manual_seed(5)
    agent = PgAgent(OBS, gym.spaces.Discrete(2), ModelConfig(hidden_sizes=(8,)))
    obs = np.repeat(_obs(1), 256, axis=0)
    draws = [Actor(agent, acting_seed(7, service, i))(obs, np.arange(256), np.zeros(256, bool),
                                                        np.zeros(256, np.float32), 0, 256)[0]
             for service, i in (("sampler", 0), ("sampler", 1), ("action_server", 0))]
    assert not np.array_equal(draws[0], draws[1]) and not np.array_equal(draws[0], draws[2])
    again = Actor(agent, acting_seed(7, "sampler", 0))(obs, np.arange(256), np.zeros(256, bool),
                                                       np.zeros(256, np.float32), 0, 256)[0]
    np.testing.assert_array_equal(again, draws[0])  # and the same seed replays the same draws
