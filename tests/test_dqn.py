"""QAgent and DQN: hand-computed targets (plain, double, termination), target-network
updates, priorities, importance weights, checkpoints, exploration, and Q-values learned
on a tiny MDP whose optimal Q is known."""

import copy

import gymnasium as gym
import numpy as np
import pytest
import torch

from shared.algos.dqn import DQN, DQNConfig
from shared.agents.models import ModelConfig
from shared.agents.q import QAgent, QAgentConfig
from shared.data.batches import Transition

torch.set_num_threads(1)

LINEAR = ModelConfig(hidden_sizes=())  # Q = W obs + b: the head is one Linear on the raw obs


def linear_agent(weight, cfg=QAgentConfig()) -> QAgent:
    """A 2-action agent on 2-d observations with Q(obs) = weight @ obs."""
    agent = QAgent(np.zeros(2, np.float32), gym.spaces.Discrete(2), LINEAR, cfg)
    set_linear(agent, weight)
    return agent


def set_linear(agent: QAgent, weight) -> None:
    layer = agent.advantage.net[0]
    with torch.no_grad():
        layer.weight.copy_(torch.as_tensor(weight, dtype=torch.float32))
        layer.bias.zero_()


def transitions(obs, action, ret, boot, discount, weight=None) -> Transition:
    n = len(action)
    return Transition(
        observation=torch.tensor(np.array(obs), dtype=torch.float32),
        action=torch.tensor(action, dtype=torch.int64),
        return_=torch.tensor(ret, dtype=torch.float32),
        bootstrap_observation=torch.tensor(np.array(boot), dtype=torch.float32),
        bootstrap_discount=torch.tensor(discount, dtype=torch.float32),
        is_weight=torch.ones(n) if weight is None else torch.tensor(weight, dtype=torch.float32),
        policy_version=torch.zeros(n, dtype=torch.int64),
        steps=None,
    )


# Online Q(o) = o; target Q(o) = (o1, o0). Three items:
#  0: Q = 1 (a=0 at [1, 2]); r 1, gamma^m 0.5, o' = [3, 5]: online a* = 1, target there 3;
#     double y = 1 + 0.5 * 3 = 2.5, plain y = 1 + 0.5 * max(5, 3) = 3.5.
#  1: Q = -1 (a=1 at [4, -1]); r 2, terminated (discount 0): y = 2 either way.
#  2: Q = 0; r 0.5, gamma^m 0.9, o' = [-2, -4]: online a* = 0, target there -4;
#     double y = 0.5 - 3.6 = -3.1, plain y = 0.5 + 0.9 * max(-4, -2) = -1.3.
BATCH = dict(
    obs=[[1.0, 2.0], [4.0, -1.0], [0.0, 0.0]],
    action=[0, 1, 1],
    ret=[1.0, 2.0, 0.5],
    boot=[[3.0, 5.0], [7.0, 1.0], [-2.0, -4.0]],
    discount=[0.5, 0.0, 0.9],
)
SWAP = [[0.0, 1.0], [1.0, 0.0]]


@pytest.mark.parametrize("double, want_td", [(True, [1.5, 3.0, 3.1]), (False, [2.5, 3.0, 1.3])])
def test_hand_computed_targets(double, want_td):
    agent = linear_agent(np.eye(2))
    algo = DQN(agent, DQNConfig(double=double, huber_delta=1.0, lr=0.0))
    set_linear(algo.target, SWAP)
    out, priorities = algo.update(transitions(**BATCH), progress=0.0)
    np.testing.assert_allclose(priorities, want_td, rtol=1e-6)
    assert priorities.shape == (3,) and priorities.dtype == np.float32
    # Huber(1): |td| - 0.5 for |td| > 1
    np.testing.assert_allclose(out["loss"], np.mean(np.array(want_td) - 0.5), rtol=1e-6)
    np.testing.assert_allclose(out["q_mean"], np.mean([1.0, -1.0, 0.0]), atol=1e-6)


def test_a_td_target_of_ones_own_replaces_only_the_target():
    """The hook sees the DQN (its target network) and the batch, runs without gradients, and its
    values are what Q regresses on: priorities |y - Q| with Q = (1, -1, 0) for y = return + 10."""
    seen = []

    def plus_ten(dqn, batch):
        seen.append((dqn.target is algo.target, torch.is_grad_enabled()))
        return batch.return_ + 10.0

    algo = DQN(linear_agent(np.eye(2)), DQNConfig(lr=0.0), td_target=plus_ten)
    out, priorities = algo.update(transitions(**BATCH), progress=0.0)
    assert seen == [(True, False)]
    np.testing.assert_allclose(priorities, [10.0, 13.0, 10.5], rtol=1e-6)
    np.testing.assert_allclose(out["target_mean"], np.mean([11.0, 12.0, 10.5]), rtol=1e-6)


def test_a_td_target_on_a_distributional_head_is_refused():
    agent = QAgent(np.zeros(2, np.float32), gym.spaces.Discrete(2), LINEAR, QAgentConfig(distributional=True))
    with pytest.raises(ValueError, match="a TD target replaces a scalar Q head's only"):
        DQN(agent, DQNConfig(), td_target=lambda dqn, batch: batch.return_)


def test_squared_loss_and_importance_weights_scale_the_loss():
    agent = linear_agent(np.eye(2))
    td = np.array([1.5, 3.0, 3.1])
    weights = np.array([1.0, 0.5, 0.0])
    algo = DQN(agent, DQNConfig(double=True, huber_delta=0.0, lr=0.0))
    set_linear(algo.target, SWAP)
    out, priorities = algo.update(transitions(**BATCH, weight=weights.tolist()), progress=0.0)
    np.testing.assert_allclose(out["loss"], np.mean(weights * 0.5 * td**2), rtol=1e-6)
    # Priorities are not weighted: they are the raw |TD| of every item.
    np.testing.assert_allclose(priorities, td, rtol=1e-6)


def test_zero_weight_item_contributes_no_gradient():
    grads = []
    for weight in ([1.0, 0.0, 0.0], [1.0, 5.0, 7.0]):
        agent = linear_agent(np.eye(2))
        algo = DQN(agent, DQNConfig(lr=0.0))
        batch = transitions(**BATCH, weight=weight)
        algo.update(batch, 0.0)
        grads.append(agent.advantage.net[0].weight.grad.clone())
    alone = linear_agent(np.eye(2))
    algo = DQN(alone, DQNConfig(lr=0.0))
    algo.update(transitions(**{k: v[:1] for k, v in BATCH.items()}), 0.0)
    # item 0 alone in a batch of 1 has 3x the gradient it has as 1 of 3 with the others at weight 0
    torch.testing.assert_close(grads[0] * 3, alone.advantage.net[0].weight.grad)
    assert not torch.allclose(grads[0], grads[1])


@pytest.mark.parametrize("c51_priority, want", [("kl", [np.log(5), np.log(5 / 2)]),
                                                 ("cross_entropy", [np.log(5), np.log(5)])])
def test_c51_priorities_are_the_kl_or_the_cross_entropy(c51_priority, want):
    # Uniform online distribution (zero weights) over atoms -2..2. Two terminal items: reward 0
    # projects onto atom 2 alone (one-hot target: KL = cross-entropy = log 5); reward 0.5 splits
    # half and half between atoms 2 and 3 (target entropy log 2: cross-entropy log 5, KL
    # log 5 - log 2). Issue 26: the KL (Rainbow, rlpyt) is the default.
    cfg = QAgentConfig(distributional=True, n_atoms=5, v_min=-2.0, v_max=2.0)
    agent = QAgent(np.zeros(2, np.float32), gym.spaces.Discrete(2), LINEAR, cfg)
    with torch.no_grad():
        for p in agent.parameters():
            p.zero_()
    algo = DQN(agent, DQNConfig(lr=0.0, c51_priority=c51_priority))
    out, priorities = algo.update(transitions([[1.0, 1.0]] * 2, [0, 1], [0.0, 0.5], [[0.0, 0.0]] * 2, [0.0, 0.0]), 0.0)
    np.testing.assert_allclose(priorities, want, rtol=1e-6)
    np.testing.assert_allclose(out["loss"], np.log(5), rtol=1e-6)  # the loss stays the cross-entropy
    np.testing.assert_allclose(out["td_abs_mean"], np.mean([0.0, 0.5]), atol=1e-6)  # E[Q] = 0


def test_c51_kl_priority_is_zero_when_the_online_distribution_is_the_target():
    # Online logits log([0.5, 0.5] on atoms 2, 3): the reward-0.5 terminal item is fitted exactly.
    cfg = QAgentConfig(distributional=True, n_atoms=5, v_min=-2.0, v_max=2.0)
    agent = QAgent(np.zeros(2, np.float32), gym.spaces.Discrete(2), LINEAR, cfg)
    with torch.no_grad():
        for p in agent.parameters():
            p.zero_()
        agent.advantage.net[-1].bias.copy_(torch.tensor([-30.0, -30.0, 0.0, 0.0, -30.0] * 2))
    algo = DQN(agent, DQNConfig(lr=0.0))
    _, priorities = algo.update(transitions([[1.0, 1.0]], [0], [0.5], [[0.0, 0.0]], [0.0]), 0.0)
    np.testing.assert_allclose(priorities, [0.0], atol=1e-6)
    with pytest.raises(ValueError, match="c51_priority"):
        DQNConfig(c51_priority="ce")


def test_hard_target_update_every_period():
    agent = linear_agent(np.eye(2))
    algo = DQN(agent, DQNConfig(lr=0.1, target_update_period=3, target_tau=1.0))
    start = copy.deepcopy(algo.target.state_dict())
    batch = transitions(**BATCH)
    for k in range(1, 7):
        algo.update(batch, 0.0)
        target_w = algo.target.advantage.net[0].weight
        online_w = agent.advantage.net[0].weight
        if k < 3:
            torch.testing.assert_close(target_w, start["advantage.net.0.weight"])
        if k == 3 or k == 6:
            torch.testing.assert_close(target_w, online_w)
        elif k in (4, 5):
            assert not torch.allclose(target_w, online_w)


def test_polyak_target_update():
    agent = linear_agent(np.eye(2))
    algo = DQN(agent, DQNConfig(lr=0.1, target_update_period=1, target_tau=0.25))
    before = algo.target.advantage.net[0].weight.clone()
    algo.update(transitions(**BATCH), 0.0)
    after_online = agent.advantage.net[0].weight
    assert not torch.allclose(after_online, before)
    torch.testing.assert_close(algo.target.advantage.net[0].weight, 0.75 * before + 0.25 * after_online)
    assert not any(p.requires_grad for p in algo.target.parameters())


def test_state_dict_round_trip_restores_target_optimizer_and_count():
    agent = linear_agent(np.eye(2))
    algo = DQN(agent, DQNConfig(lr=0.1, target_update_period=2))
    for _ in range(3):
        algo.update(transitions(**BATCH), 0.0)
    state = copy.deepcopy(algo.state_dict())
    fresh = DQN(linear_agent(SWAP), DQNConfig(lr=0.1, target_update_period=2))
    fresh.load_state_dict(state)
    assert fresh.updates == 3
    torch.testing.assert_close(fresh.target.state_dict(), algo.target.state_dict())
    opt_a, opt_b = algo.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    torch.testing.assert_close(opt_a, opt_b)


# ---------------------------------------------------------------- agent


def test_epsilon_schedule_and_apex_spread():
    obs, space = np.zeros(3, np.float32), gym.spaces.Discrete(2)
    agent = QAgent(obs, space, LINEAR, QAgentConfig(eps_start=1.0, eps_end=0.1, eps_decay_steps=1000))
    np.testing.assert_allclose(agent.cfg.epsilon(0, np.arange(4), 4), [1.0] * 4)
    np.testing.assert_allclose(agent.cfg.epsilon(500, 2, 4), 0.55, rtol=1e-6)
    np.testing.assert_allclose(agent.cfg.epsilon(10_000, np.arange(4), 4), [0.1] * 4, rtol=1e-6)
    apex = QAgent(obs, space, LINEAR, QAgentConfig(eps_start=1.0, eps_decay_steps=0, apex_alpha=7.0, apex_eps_base=0.4))
    eps = apex.cfg.epsilon(0, np.array([0, 4, 8]), 9)
    np.testing.assert_allclose(eps, [0.4, 0.4**4.5, 0.4**8], rtol=1e-5)
    assert eps.shape == (3,) and eps.dtype == np.float32
    # the decay leads each env to its own final value: halfway, halfway from eps_start
    half = QAgent(obs, space, LINEAR, QAgentConfig(eps_start=1.0, eps_decay_steps=100, apex_alpha=7.0))
    np.testing.assert_allclose(half.cfg.epsilon(50, np.array([0, 8]), 9), [0.7, 0.5 + 0.5 * 0.4**8], rtol=1e-5)
    np.testing.assert_allclose(apex.cfg.epsilon(0, 0, 1), 0.4, rtol=1e-6)  # one env: the base


def test_epsilon_greedy_is_greedy_at_zero_epsilon_and_uniform_at_one():
    torch.manual_seed(0)
    agent = QAgent(np.zeros(4, np.float32), gym.spaces.Discrete(3), ModelConfig((16,), "relu"), QAgentConfig())
    obs = torch.randn(2000, 4)
    q = agent.q_values(obs)
    action, info = agent.epsilon_greedy(obs, 0.0)
    assert action.dtype == torch.int64 and info.value.dtype == torch.float32
    torch.testing.assert_close(action, q.argmax(-1))
    torch.testing.assert_close(info.value, q.max(-1).values)
    random, _ = agent.epsilon_greedy(obs, torch.ones(2000))
    counts = np.bincount(random.numpy(), minlength=3) / 2000
    np.testing.assert_allclose(counts, [1 / 3] * 3, atol=0.05)
    mixed, _ = agent.epsilon_greedy(obs, torch.cat([torch.zeros(1000), torch.ones(1000)]))
    torch.testing.assert_close(mixed[:1000], q[:1000].argmax(-1))


@pytest.mark.parametrize("distributional", [False, True])
def test_dueling_head_advantages_have_zero_mean(distributional):
    cfg = QAgentConfig(dueling=True, distributional=distributional, n_atoms=11, v_min=-5.0, v_max=5.0,
                       head_hidden_sizes=(8,))
    agent = QAgent(np.zeros(4, np.float32), gym.spaces.Discrete(3), ModelConfig((16,), "relu"), cfg)
    obs = torch.randn(7, 4)
    out = agent._head(obs).reshape(7, 3, -1)  # [N, A, atoms], atoms = 1 for scalar Q
    value = agent.value(agent.encoder(obs))  # [N, atoms]
    torch.testing.assert_close(out.mean(dim=1), value)
    if distributional:
        assert agent.dist(obs).shape == (7, 3, 11)
        torch.testing.assert_close(agent.dist(obs).exp().sum(-1), torch.ones(7, 3))
        assert "support" in agent.state_dict()


# ---------------------------------------------------------------- learning

# A 3-state MDP (one-hot observations), gamma 0.9:
#   s0: a0 -> r 0, s1;   a1 -> r 1, end
#   s1: a0 -> r 0, s2;   a1 -> r 0, s0
#   s2: a0 -> r 2, end;  a1 -> r 0, s1
# Q*: s2 = [2, 0.9*1.8]; s1 = [0.9*2, 0.9*V(s0)]; s0 = [0.9*1.8, 1] (V(s0) = 1.62).
Q_STAR = np.array([[1.62, 1.0], [1.8, 1.458], [2.0, 1.62]])
MDP = [(0, 0, 0.0, 1, False), (0, 1, 1.0, 0, True), (1, 0, 0.0, 2, False), (1, 1, 0.0, 0, False),
       (2, 0, 2.0, 0, True), (2, 1, 0.0, 1, False)]


@pytest.mark.parametrize(
    "cfg",
    [
        QAgentConfig(),
        QAgentConfig(dueling=True),
        QAgentConfig(dueling=True, distributional=True, n_atoms=31, v_min=0.0, v_max=3.0),
    ],
    ids=["dqn", "dueling", "rainbow"],
)
def test_learns_optimal_q_of_a_small_mdp(cfg):
    torch.manual_seed(0)
    eye = np.eye(3, dtype=np.float32)
    agent = QAgent(eye[0], gym.spaces.Discrete(2), ModelConfig((32,), "relu"), cfg)
    algo = DQN(agent, DQNConfig(lr=3e-3, double=True, target_update_period=20, target_tau=1.0, huber_delta=1.0))
    batch = transitions(
        [eye[s] for s, *_ in MDP], [a for _, a, *_ in MDP], [r for *_, r, _, _ in MDP],
        [eye[s2] for *_, s2, _ in MDP], [0.0 if done else 0.9 for *_, done in MDP],
    )
    for _ in range(1500):
        out = algo.update(batch, 0.0).stats
    q = agent.q_values(torch.as_tensor(eye)).detach().numpy()
    np.testing.assert_allclose(q, Q_STAR, atol=0.08)
    assert out["td_abs_mean"] < 0.08
