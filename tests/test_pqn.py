"""PQN: Q(lambda) returns against the recursion written as a loop (terminations, truncations, the
segment end), its lambda = 0 and lambda = 1 limits, the targets it builds from a segment batch, a
LayerNorm Q-network, and an update that fits a bandit's Q-values."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from shared.agents.actor import acting_plan
from shared.agents.config import ModelConfig, QAgentConfig, QAgentInfo
from shared.agents.q import QAgent
from shared.algos import registry
from shared.algos.hparams import PQNConfig
from shared.algos.pqn import PQN, batch_targets, q_lambda_returns
from shared.data.batches import OnPolicyBatch, Samples
from shared.config import loading
from shared.config.schema import ConfigError
from tests.pipeline import CONFIGS
from tests.test_vtrace import PATTERNS, as_t, random_segment

torch.set_num_threads(1)


def naive_q_lambda(reward, next_value, terminated, truncated, gamma, lam):
    """G_t = r_t + gamma [(1 - lam) next_value[t] + lam G_{t+1}], step by step from the end:
    G_t = r_t after a termination; G_{t+1} := next_value[t] where step t was truncated or is the
    segment's last."""
    T, B = reward.shape
    G = np.zeros((T, B))
    for b in range(B):
        for t in reversed(range(T)):
            if terminated[t, b]:
                G[t, b] = reward[t, b]
                continue
            later = next_value[t, b] if truncated[t, b] or t == T - 1 else G[t + 1, b]
            G[t, b] = reward[t, b] + gamma * ((1 - lam) * next_value[t, b] + lam * later)
    return G


@pytest.mark.parametrize("lam", [0.0, 0.65, 1.0])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_q_lambda_returns_match_the_recursion(pattern, lam):
    rng = np.random.default_rng(PATTERNS.index(pattern))
    reward, value, next_value, terminated, done = random_segment(rng, 12, 5, pattern)
    truncated = done & ~terminated
    expected = naive_q_lambda(reward, next_value, terminated, truncated, 0.9, lam)
    got = q_lambda_returns(*as_t(reward, value, next_value, terminated, done), 0.9, lam)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_lambda_0_is_one_step_and_lambda_1_the_return_bootstrapped_at_truncation():
    reward = np.array([[1.0], [2.0], [3.0], [4.0], [5.0]])
    next_value = np.array([[10.0], [20.0], [30.0], [40.0], [50.0]])
    # max Q(s_t): next_value[t - 1] where step t - 1's episode goes on (as the learner builds them)
    value = np.array([[7.0], [10.0], [7.0], [30.0], [7.0]])
    terminated = np.array([[False], [True], [False], [False], [False]])
    truncated = np.array([[False], [False], [False], [True], [False]])
    done = terminated | truncated
    args = as_t(reward, value, next_value, terminated, done)
    one_step = q_lambda_returns(*args, 0.5, 0.0)[:, 0].tolist()
    assert one_step == [1 + 0.5 * 10, 2, 3 + 0.5 * 30, 4 + 0.5 * 40, 5 + 0.5 * 50]
    returns = q_lambda_returns(*args, 0.5, 1.0)[:, 0].tolist()
    # episode 1 ends in a termination at t = 1; episode 2 is truncated at t = 3 (bootstrap 40);
    # step 4 starts episode 3, cut by the segment end (bootstrap 50).
    assert returns == [1 + 0.5 * 2, 2, 3 + 0.5 * (4 + 0.5 * 40), 4 + 0.5 * 40, 5 + 0.5 * 50]


def q_agent(layer_norm=True, seed=0):
    torch.manual_seed(seed)
    return QAgent(np.zeros(3, np.float32), gym.spaces.Discrete(2),
                  ModelConfig(hidden_sizes=(16, 16), activation="relu", layer_norm=layer_norm), QAgentConfig())


def segment(agent, T, B, seed, reward_fn=None):
    """A [T, B] segment batch of random observations, epsilon-greedy actions, terminations and truncations."""
    rng = np.random.default_rng(seed)
    obs = torch.as_tensor(rng.normal(size=(T, B, 3)).astype(np.float32))
    final = torch.as_tensor(rng.normal(size=(T, B, 3)).astype(np.float32))
    action, info = agent.step(obs.reshape(T * B, 3))
    action = action.reshape(T, B)
    terminated = torch.as_tensor(rng.random((T, B)) < 0.15)
    truncated = torch.as_tensor(rng.random((T, B)) < 0.15) & ~terminated
    reward = reward_fn(obs, action) if reward_fn else torch.as_tensor(rng.normal(size=(T, B)).astype(np.float32))
    samples = Samples(observation=obs, action=action, reward=reward, terminated=terminated, truncated=truncated,
                      final_observation=final, agent_info=QAgentInfo(info.value.reshape(T, B)),
                      policy_version=torch.zeros(T, B, dtype=torch.int64),
                      failed=torch.zeros(T, B, dtype=torch.bool))
    boot = torch.as_tensor(rng.normal(size=(B, 3)).astype(np.float32))
    return OnPolicyBatch(samples, torch.zeros(B), boot)


@pytest.mark.parametrize("recompute", [True, False])
def test_batch_targets_bootstrap_from_the_final_observation_at_truncations(recompute):
    agent = q_agent()
    batch = segment(agent, 8, 4, seed=1)
    s = batch.samples
    cfg = PQNConfig(gamma=0.9, q_lambda=0.5, recompute_values=recompute)
    returns, value = batch_targets(agent, batch, cfg)
    with torch.no_grad():
        greedy = lambda obs: agent.q_values(obs).max(-1).values  # noqa: E731
        expected_value = greedy(s.observation.reshape(-1, 3)).reshape(8, 4) if recompute else s.agent_info.value
        boot = greedy(batch.bootstrap_observation) if recompute else batch.bootstrap_value
        next_value = torch.cat([expected_value[1:], boot[None]])
        cut = s.truncated & ~s.terminated
        next_value = torch.where(cut, greedy(s.final_observation.reshape(-1, 3)).reshape(8, 4), next_value)
    assert cut.any() and s.terminated.any()
    torch.testing.assert_close(value, expected_value)
    expected = naive_q_lambda(s.reward.numpy(), next_value.numpy(), s.terminated.numpy(), cut.numpy(), 0.9, 0.5)
    np.testing.assert_allclose(returns.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_layer_norm_q_network_acts_in_torch_and_normalises_every_hidden_layer():
    agent = q_agent(layer_norm=True)
    norms = [m for m in agent.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert [n.normalized_shape for n in norms] == [(16,), (16,)]
    assert acting_plan(agent) is None  # the numpy plan has no LayerNorm
    assert acting_plan(q_agent(layer_norm=False)) is not None
    with torch.no_grad():  # the trunk's output before its ReLU is normalised: zero mean over features
        x = torch.randn(5, 3) * 100
        linear, _ = agent.encoder.trunk.plan[0]
        h = torch.nn.functional.layer_norm(linear(x), (16,))
        assert torch.allclose(h.mean(-1), torch.zeros(5), atol=1e-5)


def test_pqn_refuses_a_distributional_agent():
    """PQN regresses scalar targets: with C51's head it would fit the distribution's expectation by MSE."""
    with pytest.raises(ConfigError, match=r"^agent.distributional = true: pqn regresses scalar Q\(lambda\) targets"):
        loading.load(CONFIGS / "cartpole_pqn.toml", ["agent.distributional=true"])
    assert loading.load(CONFIGS / "cartpole_pqn.toml").algo_name == "pqn"


def test_pqn_is_an_on_policy_algorithm_of_q_agents():
    spec = registry.resolve("pqn")
    assert spec.on_policy and spec.tables == ("queue",) and spec.agent.family == "q" and not spec.recurrent
    with pytest.raises(ValueError, match="q_lambda"):
        PQNConfig(q_lambda=1.5)
    with pytest.raises(ValueError, match=r"PQNConfig.optimizer: 'rmsprop' unknown; use one of adam, radam"):
        PQNConfig(optimizer="rmsprop")
    assert PQNConfig().optimizer == "adam"
    assert type(PQN(q_agent(), PQNConfig(optimizer="radam")).optimizer) is torch.optim.RAdam


@pytest.mark.parametrize("optimizer", ["adam", "radam"])
def test_pqn_update_fits_the_q_values_of_a_bandit(optimizer):
    """Every step terminates with reward +1 for the action that matches the sign of obs[0], -1
    otherwise: the targets are the rewards, and a few updates fit Q to them."""
    agent = q_agent(seed=2)

    def reward(obs, action):
        return torch.where((obs[..., 0] > 0).long() == action, 1.0, -1.0)

    algo = PQN(agent, PQNConfig(lr=1e-2, anneal_lr=False, epochs=4, minibatches=4, optimizer=optimizer))
    losses = []
    for k in range(30):
        batch = segment(agent, 16, 8, seed=10 + k, reward_fn=reward)
        batch.samples.terminated[:] = True
        stats = algo.update(batch, 0.0).stats
        losses.append(stats["loss"])
    assert set(stats) >= {"loss", "q_mean", "grad_norm", "target_mean", "lr"}
    assert np.mean(losses[-5:]) < 0.25 * np.mean(losses[:3]), losses
    obs = torch.tensor([[2.0, 0.0, 0.0], [-2.0, 0.0, 0.0]])
    assert agent.q_values(obs).argmax(-1).tolist() == [1, 0]
