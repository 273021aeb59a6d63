"""DDPG, TD3 and SAC: the agents' acting and the losses, against hand computations."""

from __future__ import annotations

import io
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.agents.config import CriticConfig, ModelConfig, QpgAgentConfig
from shared.agents import EVALUATE, StepContext
from shared.agents.qpg import DeterministicAgent, SacAgent, tanh_gaussian_log_prob
from shared.algos.qpg import DDPG, SAC, CrossQConfig, DDPGConfig, SACConfig, TD3Config, TQCConfig, TruncatedQuantiles
from shared.data.batches import Transition

OBS = np.zeros(3, np.float32)
MODEL = ModelConfig((32, 32), "relu")


def box(low=-2.0, high=2.0, dim=1):
    return gym.spaces.Box(np.full(dim, low, np.float32), np.full(dim, high, np.float32))


def batch(n=64, obs_dim=3, action_dim=1, low=-2.0, high=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Transition(
        observation=torch.randn(n, obs_dim, generator=g),
        action=low + torch.rand(n, action_dim, generator=g) * (high - low),
        return_=torch.randn(n, generator=g),
        bootstrap_observation=torch.randn(n, obs_dim, generator=g),
        bootstrap_discount=torch.full((n,), 0.99),
        is_weight=torch.ones(n),
        policy_version=torch.zeros(n, dtype=torch.int64),
        steps=None,
    )


# ------------------------------------------------------------------ the tanh-Gaussian

def test_tanh_gaussian_log_prob_is_the_change_of_variables_density():
    """exp(log p) integrates to 1 over (-1, 1) and matches N(atanh a) / (1 - a^2) pointwise."""
    mean, log_std = torch.tensor([[0.3]], dtype=torch.float64), torch.tensor([[-0.2]], dtype=torch.float64)
    a = torch.linspace(-1 + 1e-9, 1 - 1e-9, 200_001, dtype=torch.float64)[:, None]
    u = torch.atanh(a)
    density = tanh_gaussian_log_prob(u, mean, log_std).exp()
    reference = torch.distributions.Normal(mean, log_std.exp()).log_prob(u).exp()[:, 0] / (1 - a[:, 0] ** 2)
    torch.testing.assert_close(density, reference, rtol=1e-6, atol=1e-9)
    assert torch.trapezoid(density, a[:, 0]).item() == pytest.approx(1.0, abs=1e-4)


def test_sac_sample_log_probs_match_a_monte_carlo_histogram():
    torch.manual_seed(0)
    agent = SacAgent(OBS, box(-1.0, 1.0, 2), MODEL)
    obs = torch.randn(1, 3).expand(400_000, 3)
    with torch.no_grad():
        action, log_prob = agent.sample(obs)
    assert action.abs().max() <= 1.0 and log_prob.shape == (400_000,)
    # Dimensions are independent: the histogram of dimension 0 against its marginal density.
    mean, log_std = agent._mean_log_std(obs[:1])
    edges = torch.linspace(-0.99, 0.99, 41)
    counts = torch.histc(action[:, 0], bins=40, min=-0.99, max=0.99) / 400_000
    mid = ((edges[1:] + edges[:-1]) / 2)[:, None]
    marginal = tanh_gaussian_log_prob(torch.atanh(mid), mean[:, :1], log_std[:, :1]).exp()
    torch.testing.assert_close(counts, marginal * (edges[1] - edges[0]), atol=2e-3, rtol=0.05)


# ------------------------------------------------------------------ acting

@settings(max_examples=40, deadline=None)
@given(low=st.floats(-50, 10), width=st.floats(1e-3, 60), dim=st.integers(1, 4), sac=st.booleans(),
       mode=st.sampled_from(["greedy", "random", "gaussian", "ou"]), seed=st.integers(0, 2**31 - 1))
def test_actions_always_lie_within_the_box(low, width, dim, sac, mode, seed):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    lows = (low + rng.uniform(0, 5, dim)).astype(np.float32)
    space = gym.spaces.Box(lows, (lows + width * rng.uniform(0.5, 1.5, dim)).astype(np.float32))
    cfg = QpgAgentConfig(random_steps=100, noise="ou" if mode == "ou" else "gaussian", noise_scale=3.0)
    agent = (SacAgent if sac else DeterministicAgent)(OBS, space, MODEL, cfg)
    obs = torch.randn(257, 3) * 100
    ctx = EVALUATE if mode == "greedy" else StepContext(env_steps=0 if mode == "random" else 100)
    for _ in range(3):
        action, _ = agent.step(obs, ctx)
        assert action.shape == (257, dim) and action.dtype == torch.float32
        assert (action >= torch.as_tensor(space.low)).all() and (action <= torch.as_tensor(space.high)).all()


def test_random_warm_up_is_uniform_and_evaluation_is_deterministic():
    torch.manual_seed(0)
    agent = DeterministicAgent(OBS, box(-1.0, 3.0), MODEL, QpgAgentConfig(random_steps=1000, noise_scale=0.5))
    obs = torch.randn(20_000, 3)
    warm, _ = agent.step(obs, StepContext(env_steps=999))
    assert warm.mean().item() == pytest.approx(1.0, abs=0.05) and warm.var().item() == pytest.approx(16 / 12, rel=0.05)
    explored, _ = agent.step(obs, StepContext(env_steps=1000))
    mean_action = agent.to_env(agent.policy(obs)).detach()
    assert (explored - mean_action).abs().mean() > 0.1
    greedy1, _ = agent.step(obs, EVALUATE)
    greedy2, _ = agent.step(obs, EVALUATE)
    torch.testing.assert_close(greedy1, mean_action)
    torch.testing.assert_close(greedy1, greedy2)


def test_unit_and_env_actions_map_onto_each_other():
    agent = SacAgent(OBS, gym.spaces.Box(np.array([-1.0, 0.0], np.float32), np.array([3.0, 0.5], np.float32)), MODEL)
    env = torch.tensor([[-1.0, 0.0], [3.0, 0.5], [1.0, 0.25]])
    unit = agent.to_unit(env)
    torch.testing.assert_close(unit, torch.tensor([[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(agent.to_env(unit), env)


def test_ou_noise_is_per_env_independent_and_reset_at_episode_start():
    torch.manual_seed(0)
    cfg = QpgAgentConfig(noise="ou", noise_scale=0.3, ou_theta=0.15, ou_dt=1e-2)
    agent = DeterministicAgent(OBS, box(), MODEL, cfg)
    envs, steps = 64, 3000
    index = np.arange(envs)
    trace = []
    for _ in range(steps):
        trace.append(agent.ou_noise(StepContext(env_index=index, envs_total=envs), envs)[:, 0].clone())
    x = torch.stack(trace)  # [steps, envs]
    # Each env's process is strongly autocorrelated in time...
    lag1 = torch.corrcoef(torch.stack([x[1:, 0], x[:-1, 0]]))[0, 1]
    assert lag1 > 0.95
    # ...its increments are independent across envs...
    inc = (x[1:] - x[:-1] * (1 - cfg.ou_theta * cfg.ou_dt)).T  # [envs, steps-1] = the Gaussian kicks
    corr = torch.corrcoef(inc)
    off_diagonal = corr[~torch.eye(envs, dtype=torch.bool)]
    assert off_diagonal.abs().max() < 0.1
    assert inc.std().item() == pytest.approx(cfg.noise_scale * math.sqrt(cfg.ou_dt), rel=0.05)
    # ...and a row that starts an episode restarts from 0 while the others carry on.
    before = agent.ou_state.clone()
    first = np.zeros(envs, bool)
    first[:8] = True
    after = agent.ou_noise(StepContext(env_index=index, envs_total=envs, first=first), envs)
    kick = cfg.noise_scale * math.sqrt(cfg.ou_dt)
    assert (after[:8].abs() < 5 * kick).all()
    assert (after[8:] - before[8:] * (1 - cfg.ou_theta * cfg.ou_dt)).abs().max() < 5 * kick
    assert before[:8].abs().mean() > 4 * kick  # the reset is visible: the states had grown (stationary std 0.55)


def test_ou_state_follows_global_env_indices_of_several_samplers():
    """Two samplers' slots (envs 0-1 and 2-3) keep separate states in one action-server."""
    torch.manual_seed(0)
    agent = DeterministicAgent(OBS, box(), MODEL, QpgAgentConfig(noise="ou", noise_scale=1.0))
    a = agent.ou_noise(StepContext(env_index=np.array([2, 3]), envs_total=4), 2).clone()
    assert (agent.ou_state[:2] == 0).all()
    torch.testing.assert_close(agent.ou_state[2:], a)


# ------------------------------------------------------------------ losses

def test_polyak_moves_targets_by_tau():
    torch.manual_seed(0)
    agent = DeterministicAgent(OBS, box(), MODEL)
    algo = DDPG(agent, DDPGConfig(tau=0.1))
    before = {k: v.clone() for k, v in algo.target.state_dict().items()}
    with torch.no_grad():
        for p in agent.parameters():
            p.add_(1.0)
    algo.update_target(algo.cfg.tau)
    online = agent.state_dict()
    for k, t in algo.target.state_dict().items():
        torch.testing.assert_close(t, 0.1 * online[k] + 0.9 * before[k])


def test_td3_target_uses_clipped_smoothing_noise_and_the_smaller_critic():
    torch.manual_seed(0)
    agent = DeterministicAgent(OBS, box(), MODEL, critic=CriticConfig(n=2))
    algo = DDPG(agent, TD3Config(target_noise=10.0, target_noise_clip=0.3))
    s = torch.randn(5000, 3)
    mu = algo.target.policy(s).detach()
    smoothed = algo.target_action(s).detach()
    shift = smoothed - mu
    inside = mu.abs() < 0.6  # away from the [-1, 1] clamp
    assert shift[inside].abs().max() <= 0.3 + 1e-6
    assert (shift[inside].abs() > 0.299).float().mean() > 0.9  # noise of std 10 is nearly always clipped
    assert smoothed.abs().max() <= 1.0

    b = batch(8)
    torch.manual_seed(1)
    next_action = algo.target_action(b.bootstrap_observation)
    expected = b.return_ + b.bootstrap_discount * algo.target.q(b.bootstrap_observation, next_action).min(0).values
    torch.manual_seed(1)
    stats = algo.update(b, 0.0).stats
    assert stats["target_mean"] == pytest.approx(expected.mean().item(), rel=1e-5)


def test_ddpg_has_no_smoothing_and_td3_delays_actor_and_targets():
    torch.manual_seed(0)
    ddpg = DDPG(DeterministicAgent(OBS, box(), MODEL), DDPGConfig())
    s = torch.randn(10, 3)
    torch.testing.assert_close(ddpg.target_action(s), ddpg.target.policy(s))

    agent = DeterministicAgent(OBS, box(), MODEL, critic=CriticConfig(n=2))
    td3 = DDPG(agent, TD3Config(policy_delay=2))
    actor0 = [p.clone() for p in agent.actor_head.parameters()]
    target0 = [p.clone() for p in td3.target.parameters()]
    td3.update(batch(), 0.0)
    assert all(torch.equal(a, b) for a, b in zip(actor0, agent.actor_head.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(target0, td3.target.parameters()))
    td3.update(batch(seed=1), 0.0)
    assert not all(torch.equal(a, b) for a, b in zip(actor0, agent.actor_head.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(target0, td3.target.parameters()))


@pytest.mark.parametrize("target_entropy, direction", [(5.0, 1), (-20.0, -1)])
def test_sac_temperature_moves_towards_the_target_entropy(target_entropy, direction):
    """Entropy below the target raises alpha, above it lowers alpha."""
    torch.manual_seed(0)
    algo = SAC(SacAgent(OBS, box(dim=2), MODEL), SACConfig(target_entropy=target_entropy, alpha_lr=1e-2))
    alphas = [algo.update(batch(action_dim=2, seed=i), 0.0).stats["alpha"] for i in range(20)]
    assert np.sign(alphas[-1] - alphas[0]) == direction
    assert all(np.sign(np.diff(alphas)) == direction)


def test_sac_fixed_alpha_stays_and_default_target_entropy_is_minus_action_dims():
    algo = SAC(SacAgent(OBS, box(dim=3), MODEL), SACConfig(learn_alpha=False, init_alpha=0.2))
    assert algo.target_entropy == -3.0
    stats = [algo.update(batch(action_dim=3, seed=i), 0.0).stats for i in range(3)]
    assert all(s["alpha"] == pytest.approx(0.2) for s in stats)


def test_updates_return_priorities_and_checkpoints_round_trip():
    torch.manual_seed(0)
    for algo in (DDPG(DeterministicAgent(OBS, box(), MODEL), DDPGConfig()),
                 SAC(SacAgent(OBS, box(), MODEL), SACConfig())):
        stats, priorities = algo.update(batch(), 0.5)
        assert priorities.shape == (64,) and (priorities >= 0).all()
        assert stats["td_abs_mean"] == pytest.approx(float(priorities.mean()), rel=1e-5)
        assert all(math.isfinite(v) for v in stats.values())
        state = algo.state_dict()
        clone = type(algo)(type(algo.agent)(OBS, box(), MODEL, critic=algo.cfg.critic()), algo.cfg)
        clone.load_state_dict(state)
        assert clone.updates == algo.updates
        for a, b in zip(clone.target.parameters(), algo.target.parameters()):
            torch.testing.assert_close(a, b)


LRS = {"actor_lr": 1e-3, "critic_lr": 2e-3}  # distinct: they tell the saved optimizers apart
LAYOUT_CONFIGS = {
    "ddpg": DDPGConfig(**LRS), "td3": TD3Config(**LRS), "sac": SACConfig(**LRS, alpha_lr=3e-3),
    "tqc": TQCConfig(**LRS, alpha_lr=3e-3, n_critics=2, n_quantiles=5, drop_per_net=1),
    "crossq": CrossQConfig(**LRS, alpha_lr=3e-3, critic_hidden_sizes=(32, 32)),
}


def qpg_algo(name: str):
    cfg = LAYOUT_CONFIGS[name]
    if name in ("ddpg", "td3"):
        return DDPG(DeterministicAgent(OBS, box(), MODEL, critic=cfg.critic()), cfg)
    agent = SacAgent(OBS, box(), MODEL, critic=cfg.critic(), actor=cfg.actor())
    if name == "tqc":
        return SAC(agent, cfg, TruncatedQuantiles(cfg.drop_per_net))
    return SAC(agent, cfg)


@pytest.mark.parametrize("name", list(LAYOUT_CONFIGS))
def test_checkpoints_keep_the_layout_earlier_versions_wrote(name):
    """A learner checkpoint's "algo" entry keeps the layout earlier versions wrote, so that their
    checkpoints load: {"updates", "target" (not CrossQ), "optimizers": [the actor's, the
    critics', SAC's temperature's], "log_alpha" (SAC)}. A run resumed from one goes on as the
    original does, bit for bit."""
    torch.manual_seed(0)
    algo = qpg_algo(name)
    for i in range(5):  # actor steps in all; the sixth is one in all (TD3's delay 2, CrossQ's 3)
        algo.update(batch(seed=i), 0.0)
    state = algo.state_dict()
    sac = isinstance(algo, SAC)
    assert list(state) == ["updates", *(["target"] if name != "crossq" else []), "optimizers",
                           *(["log_alpha"] if sac else [])]
    agent, cfg = algo.agent, algo.cfg
    actor_params = len([*agent.actor_encoder.parameters(), *agent.actor_head.parameters()])
    roles = [(cfg.actor_lr, actor_params), (cfg.critic_lr, len(list(agent.critics.parameters())))]
    assert [(opt["param_groups"][0]["lr"], len(opt["param_groups"][0]["params"])) for opt in state["optimizers"]] \
        == roles + ([(cfg.alpha_lr, 1)] if sac else [])
    assert all(opt["state"] for opt in state["optimizers"])  # every optimizer has stepped

    buffer = io.BytesIO()
    torch.save({"agent": agent.state_dict(), "algo": state}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    torch.manual_seed(1)
    clone = qpg_algo(name)
    clone.agent.load_state_dict(saved["agent"])
    clone.load_state_dict(saved["algo"])
    stats = []
    for run in (algo, clone):  # an actor step: the loss reported between them is not checkpointed
        torch.manual_seed(2)
        stats.append(run.update(batch(seed=9), 0.0).stats)
    assert stats[0] == stats[1]
    for (k, a), b in zip(agent.state_dict().items(), clone.agent.state_dict().values()):
        assert torch.equal(a, b), k


def test_agents_refuse_discrete_and_unbounded_action_spaces():
    with pytest.raises(ValueError, match="need a Box"):
        SacAgent(OBS, gym.spaces.Discrete(3), MODEL)
    with pytest.raises(ValueError, match="finite bounds"):
        DeterministicAgent(OBS, gym.spaces.Box(-np.inf, np.inf, (2,), np.float32), MODEL)
