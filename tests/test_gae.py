"""GAE against hand-computed numbers and a direct-sum reference, across termination,
truncation and the segment end."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.agents.config import AgentInfo
from shared.agents.pg import PgAgent
from shared.data.batches import OnPolicyBatch, Samples
from shared.algos.gae import batch_advantages, explained_variance, gae
from shared.algos.hparams import PgTargetsConfig

torch.set_num_threads(1)


def reference_gae(reward, value, next_value, terminated, done, gamma, lam):
    """A_t = sum_k (gamma lam)^k delta_{t+k}, summed forward until the episode's done step."""
    T, B = reward.shape
    adv = np.zeros((T, B))
    for b in range(B):
        for t in range(T):
            total, weight = 0.0, 1.0
            for k in range(t, T):
                delta = reward[k, b] + gamma * next_value[k, b] * (not terminated[k, b]) - value[k, b]
                total += weight * delta
                if done[k, b]:
                    break
                weight *= gamma * lam
            adv[t, b] = total
    return adv, adv + value


def as_t(*arrays):
    return [torch.as_tensor(np.asarray(a)) for a in arrays]


def test_hand_computed_termination_truncation_and_segment_end():
    # One column, T = 4: step 0 normal, step 1 terminates, step 2 truncates (time limit,
    # final-obs value 5), step 3 ends the segment (bootstrap 7). gamma 0.5, lambda 0.5.
    reward = np.array([[1.0], [2.0], [3.0], [4.0]])
    value = np.array([[10.0], [20.0], [30.0], [40.0]])
    next_value = np.array([[20.0], [999.0], [5.0], [7.0]])  # 999: ignored (terminated)
    terminated = np.array([[False], [True], [False], [False]])
    truncated = np.array([[False], [False], [True], [False]])
    adv, ret = gae(*as_t(reward, value, next_value, terminated, terminated | truncated), gamma=0.5, lam=0.5)
    # deltas: d0 = 1 + .5*20 - 10 = 1; d1 = 2 - 20 = -18; d2 = 3 + .5*5 - 30 = -24.5;
    # d3 = 4 + .5*7 - 40 = -32.5. A1 = d1 (terminated), A2 = d2 (truncated: recursion cut),
    # A3 = d3 (segment end), A0 = d0 + .25 * A1 = 1 - 4.5 = -3.5.
    np.testing.assert_allclose(adv.numpy()[:, 0], [-3.5, -18.0, -24.5, -32.5])
    np.testing.assert_allclose(ret.numpy()[:, 0], [6.5, 2.0, 5.5, 7.5])


def test_lambda_one_gives_discounted_monte_carlo_returns_plus_bootstrap():
    gamma = 0.9
    reward = np.array([[1.0], [2.0], [3.0], [4.0], [5.0]])
    value = np.array([[0.3], [0.1], [-0.2], [0.7], [0.4]])
    terminated = np.array([[False], [True], [False], [False], [False]])
    bootstrap = 2.0
    next_value = np.vstack([value[1:], [[bootstrap]]])
    _, ret = gae(*as_t(reward, value, next_value, terminated, terminated), gamma=gamma, lam=1.0)
    expected = [
        1 + gamma * 2,  # episode ends at step 1
        2.0,
        3 + gamma * 4 + gamma**2 * 5 + gamma**3 * bootstrap,  # runs into the segment end
        4 + gamma * 5 + gamma**2 * bootstrap,
        5 + gamma * bootstrap,
    ]
    np.testing.assert_allclose(ret.numpy()[:, 0], expected, rtol=1e-6)


def test_lambda_zero_gives_td0_targets():
    rng = np.random.default_rng(0)
    T, B, gamma = 6, 3, 0.97
    reward, value, next_value = rng.normal(size=(3, T, B))
    terminated = rng.random((T, B)) < 0.3
    done = terminated | (rng.random((T, B)) < 0.3)
    adv, ret = gae(*as_t(reward, value, next_value, terminated, done), gamma=gamma, lam=0.0)
    np.testing.assert_allclose(ret.numpy(), reward + gamma * next_value * ~terminated, rtol=1e-6)
    np.testing.assert_allclose(adv.numpy(), ret.numpy() - value, rtol=1e-6, atol=1e-12)


def test_gamma_zero_is_the_immediate_reward():
    reward = np.array([[1.0, -2.0], [3.0, 0.5]])
    value = np.array([[0.2, 0.4], [0.6, 0.8]])
    no = np.zeros((2, 2), bool)
    _, ret = gae(*as_t(reward, value, value + 100, no, no), gamma=0.0, lam=0.95)
    np.testing.assert_allclose(ret.numpy(), reward)


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(1, 7),
    B=st.integers(1, 3),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_direct_sum_reference(T, B, gamma, lam, seed):
    rng = np.random.default_rng(seed)
    reward, value, next_value = rng.normal(size=(3, T, B))
    terminated = rng.random((T, B)) < 0.25
    done = terminated | (rng.random((T, B)) < 0.25)
    adv, ret = gae(*as_t(reward, value, next_value, terminated, done), gamma=gamma, lam=lam)
    ref_adv, ref_ret = reference_gae(reward, value, next_value, terminated, done, gamma, lam)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(ret.numpy(), ref_ret, rtol=1e-9, atol=1e-9)


def sum_value_agent(obs_dim: int = 2) -> PgAgent:
    """A PgAgent whose V(obs) is the sum of the observation's features, recording what it was
    asked to evaluate: GAE's value passes (``segment_values``) against an exact oracle."""
    agent = PgAgent(np.zeros(obs_dim, np.float32), gym.spaces.Discrete(2))
    agent.calls = []

    def value(obs):
        agent.calls.append(obs.clone())
        return obs.sum(-1)

    agent.value = value
    return agent


def test_batch_advantages_bootstraps_truncation_from_final_observation_only():
    T, B, gamma, lam = 3, 2, 0.9, 0.8
    value = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    terminated = torch.tensor([[False, True], [False, False], [True, False]])
    # Column 0 truncated at t=1; column 1 both terminated and truncated at t=0 (termination wins).
    truncated = torch.tensor([[False, True], [True, False], [False, False]])
    final_obs = torch.full((T, B, 2), -42.42)
    final_obs[1, 0] = torch.tensor([0.25, 0.5])
    samples = Samples(
        observation=torch.zeros(T, B, 2),
        action=torch.zeros(T, B, dtype=torch.int64),
        reward=torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]),
        terminated=terminated,
        truncated=truncated,
        final_observation=final_obs,
        agent_info=AgentInfo(log_prob=torch.zeros(T, B), value=value),
        policy_version=torch.zeros(T, B, dtype=torch.int64),
        failed=torch.zeros(T, B, dtype=torch.bool),
    )
    agent = sum_value_agent()
    bootstrap = torch.tensor([7.0, 8.0])
    cfg = PgTargetsConfig(gamma=gamma, gae_lambda=lam, reward_scale=0.5, recompute_values=False)
    adv, ret, used = batch_advantages(agent, OnPolicyBatch(samples, bootstrap, torch.zeros(B, 2)), cfg)

    assert len(agent.calls) == 1 and agent.calls[0].tolist() == [[0.25, 0.5]]
    next_value = torch.tensor([[3.0, 4.0], [0.75, 6.0], [7.0, 8.0]])
    ref_adv, ref_ret = reference_gae(
        0.5 * samples.reward.numpy(), value.numpy(), next_value.numpy(),
        terminated.numpy(), (terminated | truncated).numpy(), gamma, lam,
    )
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-6)
    np.testing.assert_allclose(ret.numpy(), ref_ret, rtol=1e-6)
    assert torch.equal(used, value)


def test_batch_advantages_recomputes_values_and_the_bootstrap_with_the_current_net():
    T, B, gamma, lam = 3, 2, 0.9, 0.8
    no = torch.zeros(T, B, dtype=torch.bool)
    observation = torch.arange(T * B * 2, dtype=torch.float32).reshape(T, B, 2) / 10
    samples = Samples(
        observation=observation, action=torch.zeros(T, B), reward=torch.ones(T, B),
        terminated=no, truncated=no, final_observation=torch.zeros(T, B, 2),
        agent_info=AgentInfo(torch.zeros(T, B), torch.full((T, B), 100.0)),  # stale: unused
        policy_version=torch.zeros(T, B, dtype=torch.int64),
        failed=torch.zeros(T, B, dtype=torch.bool),
    )
    stale_bootstrap = torch.tensor([7.0, 8.0])  # the acting network's: unused
    bootstrap_observation = torch.tensor([[0.5, 0.25], [1.0, 2.0]])
    adv, ret, used = batch_advantages(sum_value_agent(), OnPolicyBatch(samples, stale_bootstrap, bootstrap_observation),
                                      PgTargetsConfig(gamma=gamma, gae_lambda=lam))
    fresh = observation.sum(-1)
    torch.testing.assert_close(used, fresh)
    next_value = torch.cat([fresh[1:], bootstrap_observation.sum(-1)[None]])
    ref_adv, _ = reference_gae(
        samples.reward.numpy(), fresh.numpy(), next_value.numpy(), no.numpy(), no.numpy(), gamma, lam
    )
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-5)


def test_batch_advantages_skips_the_value_pass_without_truncation():
    T, B = 2, 2
    no = torch.zeros(T, B, dtype=torch.bool)
    samples = Samples(
        observation=torch.zeros(T, B, 1), action=torch.zeros(T, B), reward=torch.ones(T, B),
        terminated=no, truncated=no, final_observation=torch.zeros(T, B, 1),
        agent_info=AgentInfo(torch.zeros(T, B), torch.zeros(T, B)),
        policy_version=torch.zeros(T, B, dtype=torch.int64),
        failed=torch.zeros(T, B, dtype=torch.bool),
    )
    agent = sum_value_agent(1)
    _, ret, _ = batch_advantages(agent, OnPolicyBatch(samples, torch.zeros(B), torch.zeros(B, 1)),
                                 PgTargetsConfig(gamma=1.0, gae_lambda=1.0, recompute_values=False))
    assert agent.calls == []
    np.testing.assert_allclose(ret.numpy(), [[2.0, 2.0], [1.0, 1.0]])


@pytest.mark.parametrize(
    "prediction, target, expected",
    [([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], 1.0), ([2.0, 2.0, 2.0], [1.0, 2.0, 3.0], 0.0)],
)
def test_explained_variance(prediction, target, expected):
    assert explained_variance(torch.tensor(prediction), torch.tensor(target)) == pytest.approx(expected)
