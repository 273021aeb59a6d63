"""The action-server's fast sampling path draws from the policy that evaluate() scores."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch

from shared.agents import EVALUATE
from shared.agents.pg import PgAgent
from shared.agents.models import ModelConfig


def test_discrete_sample_frequencies_follow_the_softmax():
    torch.manual_seed(0)
    agent = PgAgent(np.zeros(3, np.float32), gym.spaces.Discrete(4), ModelConfig(hidden_sizes=(8,)))
    with torch.no_grad():
        agent.twin.biases[-1][0, 0].copy_(torch.tensor([2.0, 1.0, 0.0, -1.0]))  # the policy member's output layer
        agent.twin.weights[-1][0].zero_()
    obs = torch.zeros(20_000, 3)
    action, info = agent.step(obs)
    freq = np.bincount(action.numpy(), minlength=4) / len(action)
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0, -1.0]), 0).numpy()
    assert np.abs(freq - expected).max() < 0.015
    log_prob, _, _ = agent.evaluate(obs[:100], action[:100])
    assert torch.allclose(info.log_prob[:100], log_prob, atol=1e-5)


def test_gaussian_samples_have_the_policy_moments_and_exact_log_probs():
    torch.manual_seed(0)
    space = gym.spaces.Box(-2.0, 2.0, (2,), np.float32)
    agent = PgAgent(np.zeros(3, np.float32), space, ModelConfig(hidden_sizes=(8,)))
    with torch.no_grad():
        agent.log_std.copy_(torch.tensor([0.0, -1.0]))
    obs = torch.randn(20_000, 3)
    action, info = agent.step(obs)
    with torch.no_grad():
        mean = agent.step(obs, EVALUATE)[0]
    std = (action - mean).std(0)
    assert torch.allclose(std, torch.tensor([1.0, np.exp(-1.0)], dtype=torch.float32), rtol=0.03)
    log_prob, _, _ = agent.evaluate(obs[:100], action[:100])
    assert torch.allclose(info.log_prob[:100], log_prob, atol=1e-4)
