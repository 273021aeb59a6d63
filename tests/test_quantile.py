"""QR-DQN and IQN: the quantile Huber loss and IQN's cosine embedding against hand computations,
hand-computed priorities, acting by the mean of the quantiles (in torch and numpy), checkpoints,
config errors, and Q-values learned on a tiny MDP whose optimal Q is known."""

import io

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

from services.build import check_buildable
from shared.agents import EVALUATE
from shared.agents.actor import acting_plan, state_arrays
from shared.agents.acting import numpy_actor
from shared.agents.config import ModelConfig, QAgentConfig, QuantileHead
from shared.agents.models import CosineEmbedding
from shared.agents.q import QAgent
from shared.algos import registry
from shared.algos.quantiles import quantile_huber
from shared.algos.hparams import IQNConfig, QRDQNConfig
from shared.config import loading
from shared.config.schema import ConfigError
from tests.pipeline import CONFIGS
from tests.test_dqn import MDP, Q_STAR, transitions

torch.set_num_threads(1)

LINEAR = ModelConfig(hidden_sizes=())  # features = the raw observation; the head is one Linear


def make(name: str, cfg, agent_cfg=QAgentConfig(), model=LINEAR, obs_dim=2, actions=2):
    """The agent and algorithm that ``algo.name = name`` builds, on obs_dim-d observations."""
    spec = registry.resolve(name)
    agent = spec.agent.make(np.zeros(obs_dim, np.float32), gym.spaces.Discrete(actions), model, agent_cfg, cfg)
    return agent, spec.make(agent, cfg)


# ---------------------------------------------------------------- the loss

# One item, quantiles 0 and 1 at fractions 0.25 and 0.75, target samples 0.5 and 3:
#   u = target - value: i=0 (tau 0.25): [0.5, 3]; i=1 (tau 0.75): [-0.5, 2]
#   weights |tau - 1{u < 0}|: i=0: [0.25, 0.25]; i=1: [0.25, 0.75]
#   kappa 1, L/kappa = [0.125, 2.5] and [0.125, 1.5]: (0.25*0.125 + 0.25*2.5)/2 + (0.25*0.125 + 0.75*1.5)/2
#   kappa 0, |u|: (0.25*0.5 + 0.25*3)/2 + (0.25*0.5 + 0.75*2)/2
#   kappa 2, L/kappa = [0.0625, 2] and [0.0625, 1]: (0.25*0.0625 + 0.25*2)/2 + (0.25*0.0625 + 0.75*1)/2
@pytest.mark.parametrize("kappa, want", [(1.0, 0.328125 + 0.578125), (0.0, 0.4375 + 0.8125),
                                         (2.0, 0.2578125 + 0.3828125)])
def test_quantile_huber_loss_by_hand(kappa, want):
    values = torch.tensor([[0.0, 1.0]], requires_grad=True)
    loss = quantile_huber(values, torch.tensor([[0.5, 3.0]]), kappa, torch.tensor([[0.25, 0.75]])).mean(-1).sum(-1)
    assert loss.shape == (1,)
    np.testing.assert_allclose(loss.item(), want, rtol=1e-6)
    if kappa == 0.0:
        # The quantile loss's gradient at value_i is -(tau_i - fraction of targets below value_i):
        # i=0: -(0.25 - 0), i=1: -(0.75 - 1/2).
        loss.sum().backward()
        np.testing.assert_allclose(values.grad.numpy(), [[-0.25, -0.25]], rtol=1e-6)


def test_quantile_loss_minimum_is_the_quantile_of_the_targets():
    """Minimising the loss over the values recovers the target samples' tau-quantiles."""
    torch.manual_seed(0)
    targets = torch.randn(1, 2000) * 2.0 + 1.0
    taus = torch.tensor([[0.1, 0.5, 0.9]])
    values = torch.zeros(1, 3, requires_grad=True)
    optimizer = torch.optim.Adam([values], lr=0.05)
    for _ in range(800):
        optimizer.zero_grad()
        quantile_huber(values, targets, 0.0, taus).mean(-1).sum().backward()
        optimizer.step()
    want = torch.quantile(targets[0], taus[0])
    np.testing.assert_allclose(values.detach()[0].numpy(), want.numpy(), atol=0.05)


# ---------------------------------------------------------------- IQN's embedding


def test_cosine_embedding_by_hand():
    # cos(pi i tau), i = 0, 1, 2: tau 0 -> [1, 1, 1]; tau 1/3 -> [1, 0.5, -0.5]; tau 1/2 -> [1, 0, -1]
    embed = CosineEmbedding(3, 3)
    with torch.no_grad():
        embed.linear.weight.copy_(torch.tensor([[1.0, 2.0, -3.0], [1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]]))
        embed.linear.bias.copy_(torch.tensor([0.5, 0.1, 0.0]))
    out = embed(torch.tensor([[0.0, 1 / 3, 0.5]]))
    assert out.shape == (1, 3, 3)
    want = [[0.5, 3.1, 0.0], [4.0, 1.1, 0.0], [4.5, 0.1, 0.0]]  # ReLU: the third row is -1 before it
    np.testing.assert_allclose(out[0].detach().numpy(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("merge", [(512,), (16, 8), ()])
def test_iqn_quantiles_are_the_head_on_the_features_times_the_embedding(merge):
    """psi(x) * phi(tau), then the paper's (Dopamine's) 512-wide ReLU layer by default, or the
    ``merge_hidden_sizes`` given, shared by the dueling streams."""
    torch.manual_seed(1)
    model = ModelConfig(hidden_sizes=(), activation="relu")  # features = the raw observation
    agent, _ = make("iqn", IQNConfig(n_cosines=4, merge_hidden_sizes=merge), QAgentConfig(dueling=True), model=model,
                    obs_dim=3, actions=2)
    obs, taus = torch.randn(5, 3), torch.rand(5, 7)
    values, got_taus = agent.quantiles(obs, taus)
    assert values.shape == (5, 2, 7) and got_taus is taus
    mixed = obs[:, None, :] * agent.tau_embedding(taus)  # [5, 7, 3]
    for width, linear in zip(merge, [m for m in agent.merged.net if isinstance(m, nn.Linear)] if merge else []):
        assert linear.out_features == width
        mixed = torch.relu(linear(mixed))
    assert (agent.merged is None) == (merge == ())
    advantage, value = agent.advantage(mixed), agent.value(mixed)  # [5, 7, 2], [5, 7, 1]
    want = value + advantage - advantage.mean(-1, keepdim=True)
    torch.testing.assert_close(values, want.transpose(1, 2))


# ---------------------------------------------------------------- update: loss, priorities


def test_qr_dqn_update_loss_and_priorities_by_hand():
    # Zero weights: every observation gets the head's biases as quantiles at taus 0.25, 0.75:
    # action 0 [0, 1] (Q 0.5), action 1 [-1, 3] (Q 1: the bootstrap action, double or not).
    #  item 0: a 0, r 0.5, terminal: u = [0.5, -0.5] -> 0.25*0.125 + 0.25*0.125 = 0.0625
    #  item 1: a 1, r 3, terminal: u = [4, 0] -> 0.25*3.5 + 0.75*0 = 0.875
    #  item 2: a 0, r 1, discount 0.5: targets 1 + 0.5*[-1, 3] = [0.5, 2.5];
    #          i=0: u [0.5, 2.5] -> 0.25*(0.125 + 2)/2; i=1: u [-0.5, 1.5] -> (0.25*0.125 + 0.75*1)/2
    agent = QAgent(np.zeros(2, np.float32), gym.spaces.Discrete(2), LINEAR, QAgentConfig(),
                   quantiles=QuantileHead(n_quantiles=2))
    with torch.no_grad():
        agent.advantage.net[0].weight.zero_()
        agent.advantage.net[0].bias.copy_(torch.tensor([0.0, 1.0, -1.0, 3.0]))
    algo = registry.resolve("qr_dqn").make(agent, QRDQNConfig(n_quantiles=2, lr=0.0))
    weights = [1.0, 0.5, 2.0]
    batch = transitions([[1.0, 2.0], [0.0, -1.0], [3.0, 1.0]], [0, 1, 0], [0.5, 3.0, 1.0],
                        [[0.0, 0.0], [0.0, 0.0], [5.0, 5.0]], [0.0, 0.0, 0.5], weight=weights)
    out, priorities = algo.update(batch, 0.0)
    want = np.array([0.0625, 0.875, 0.265625 + 0.390625])
    assert priorities.shape == (3,) and priorities.dtype == np.float32
    np.testing.assert_allclose(priorities, want, rtol=1e-6)  # the per-item loss, unweighted
    np.testing.assert_allclose(out["loss"], np.mean(np.array(weights) * want), rtol=1e-6)
    np.testing.assert_allclose(out["q_mean"], np.mean([0.5, 1.0, 0.5]), rtol=1e-6)
    np.testing.assert_allclose(out["target_mean"], np.mean([0.5, 3.0, 1.5]), rtol=1e-6)


def test_iqn_update_returns_a_priority_per_item():
    torch.manual_seed(2)
    agent, algo = make("iqn", IQNConfig(n_taus=5, n_target_taus=3, n_acting_taus=4, n_cosines=8, lr=1e-3),
                       QAgentConfig(dueling=True), model=ModelConfig((16,), "relu"))
    batch = transitions(**{k: v for k, v in dict(obs=np.random.randn(6, 2), action=[0, 1, 0, 1, 0, 1],
                                                 ret=np.ones(6), boot=np.random.randn(6, 2),
                                                 discount=[0.9] * 5 + [0.0]).items()})
    out, priorities = algo.update(batch, 0.0)
    assert priorities.shape == (6,) and priorities.dtype == np.float32 and np.all(priorities > 0)
    np.testing.assert_allclose(out["loss"], priorities.mean(), rtol=1e-5)  # unit weights


# ---------------------------------------------------------------- acting


def test_qr_dqn_acts_by_the_mean_of_its_quantiles_in_torch_and_numpy():
    torch.manual_seed(3)
    agent, _ = make("qr_dqn", QRDQNConfig(n_quantiles=7), QAgentConfig(dueling=True, eps_eval=0.0),
                    model=ModelConfig((32,), "relu", normalize_observations=True), obs_dim=4, actions=3)
    obs = np.random.default_rng(0).normal(0.0, 2.0, (64, 4)).astype(np.float32)
    with torch.no_grad():
        values, taus = agent.quantiles(torch.from_numpy(obs))
        action, info = agent.step(torch.from_numpy(obs), EVALUATE)
    assert values.shape == (64, 3, 7)
    np.testing.assert_allclose(taus[0].numpy(), (2 * np.arange(7) + 1) / 14, rtol=1e-6)
    mean = values.mean(-1)
    assert len(set(mean.argmax(-1).tolist())) > 1  # the test sees more than one greedy action
    torch.testing.assert_close(action, mean.argmax(-1))
    torch.testing.assert_close(info.value, mean.max(-1).values)
    actor = numpy_actor(acting_plan(agent), state_arrays(agent), agent.cfg, np.random.default_rng(0))
    np_action, np_info = actor.step(obs, EVALUATE)
    np.testing.assert_array_equal(np_action, mean.argmax(-1).numpy())
    np.testing.assert_allclose(np_info.value, mean.max(-1).values.numpy(), atol=2e-5)


def test_iqn_acts_by_the_mean_of_k_sampled_quantiles_in_torch():
    torch.manual_seed(4)
    agent, _ = make("iqn", IQNConfig(n_acting_taus=6, n_cosines=8), QAgentConfig(eps_eval=0.0),
                    model=ModelConfig((32,), "relu"), obs_dim=4, actions=3)
    assert acting_plan(agent) is None  # sampled fractions: no numpy plan, it acts in torch
    obs = torch.randn(64, 4)
    with torch.no_grad():
        torch.manual_seed(5)
        action, info = agent.step(obs, EVALUATE)
        torch.manual_seed(5)
        values, taus = agent.quantiles(obs)
    assert values.shape == (64, 3, 6) and taus.shape == (64, 6) and 0 < taus.min() and taus.max() < 1
    mean = values.mean(-1)
    torch.testing.assert_close(action, mean.argmax(-1))
    torch.testing.assert_close(info.value, mean.max(-1).values)


# ---------------------------------------------------------------- checkpoints and config


@pytest.mark.parametrize("name, cfg", [("qr_dqn", QRDQNConfig(n_quantiles=5, target_update_period=2)),
                                       ("iqn", IQNConfig(n_taus=4, n_target_taus=4, n_cosines=8,
                                                         target_update_period=2))])
def test_state_dict_round_trip(name, cfg):
    torch.manual_seed(6)
    agent, algo = make(name, cfg, model=ModelConfig((16,), "relu"))
    batch = transitions(**{"obs": np.random.randn(4, 2), "action": [0, 1, 1, 0], "ret": [1.0, 0.0, 2.0, 1.0],
                           "boot": np.random.randn(4, 2), "discount": [0.9, 0.9, 0.0, 0.9]})
    for _ in range(3):
        algo.update(batch, 0.0)
    buffer = io.BytesIO()
    torch.save({"agent": agent.state_dict(), "algo": algo.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    torch.manual_seed(7)
    fresh_agent, fresh = make(name, cfg, model=ModelConfig((16,), "relu"))
    fresh_agent.load_state_dict(saved["agent"])
    fresh.load_state_dict(saved["algo"])
    assert fresh.updates == 3
    torch.testing.assert_close(fresh.target.state_dict(), algo.target.state_dict())
    torch.testing.assert_close(fresh.optimizer.state_dict()["state"], algo.optimizer.state_dict()["state"])
    obs, taus = torch.randn(3, 2), (torch.rand(3, 5) if name == "iqn" else None)
    torch.testing.assert_close(fresh_agent.quantiles(obs, taus)[0], agent.quantiles(obs, taus)[0])
    # ...and training goes on identically from the restored state.
    torch.manual_seed(8)
    want = algo.update(batch, 0.0).priorities
    torch.manual_seed(8)
    np.testing.assert_allclose(fresh.update(batch, 0.0).priorities, want, rtol=1e-6)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="n_quantiles"):
        QRDQNConfig(n_quantiles=0)
    with pytest.raises(ValueError, match="n_taus"):
        IQNConfig(n_taus=0)
    with pytest.raises(ValueError, match="exactly one of n_quantiles"):
        QuantileHead(n_quantiles=4, n_cosines=8)
    assert IQNConfig().merge_hidden_sizes == (512,)
    with pytest.raises(ValueError, match="IQNConfig.merge_hidden_sizes: widths must be >= 1"):
        IQNConfig(merge_hidden_sizes=(0,))
    with pytest.raises(ValueError, match="QuantileHead.merge_hidden_sizes: IQN only"):
        QuantileHead(n_quantiles=4, merge_hidden_sizes=(8,))
    exp = loading.load(CONFIGS / "cartpole_qr_dqn.toml", ["agent.distributional=true"])
    with pytest.raises(ConfigError, match="agent.distributional = true"):
        check_buildable(exp)


# ---------------------------------------------------------------- learning


@pytest.mark.parametrize("name, cfg, dueling", [
    ("qr_dqn", QRDQNConfig(n_quantiles=8), False),
    ("iqn", IQNConfig(n_taus=8, n_target_taus=8, n_acting_taus=16, n_cosines=16), True),
])
def test_learns_optimal_q_of_a_small_mdp(name, cfg, dueling):
    """test_dqn's deterministic 3-state MDP: every quantile of the return is Q*, so is their mean."""
    torch.manual_seed(0)
    eye = np.eye(3, dtype=np.float32)
    hp = dict(lr=3e-3, double=True, target_update_period=20, target_tau=1.0)
    agent, algo = make(name, type(cfg)(**{**cfg.__dict__, **hp}), QAgentConfig(dueling=dueling),
                       model=ModelConfig((32,), "relu"), obs_dim=3)
    batch = transitions([eye[s] for s, *_ in MDP], [a for _, a, *_ in MDP], [r for *_, r, _, _ in MDP],
                        [eye[s2] for *_, s2, _ in MDP], [0.0 if done else 0.9 for *_, done in MDP])
    for _ in range(1500):
        out = algo.update(batch, 0.0).stats
    with torch.no_grad():
        q = agent.q_values(torch.as_tensor(eye)).numpy()
    np.testing.assert_allclose(q, Q_STAR, atol=0.08)
    assert out["td_abs_mean"] < 0.08
