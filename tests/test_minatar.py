"""MinAtar (Young & Tian 2019): the paper's network as ``model.encoder = "minatar_cnn"`` for every
agent family, each game's shipped configs through the real pipeline, and a short learning check."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

from shared.agents.config import Memory, ModelConfig, PgAgentConfig, RnnState
from shared.agents.models import make_encoder
from shared.agents.pg import PgAgent
from shared.agents.q import QAgent
from tests.pipeline import maps_library, metric_value

pytest.importorskip("minatar")

PAPER = ModelConfig(encoder="minatar_cnn", hidden_sizes=(128,), activation="relu", uint8_scale=1.0)
CHANNELS = {"Breakout": 4, "SpaceInvaders": 6, "Asterix": 4, "Freeway": 7, "Seaquest": 10}  # [10, 10, C]
ACTIONS = {"Breakout": 3, "SpaceInvaders": 4, "Asterix": 5, "Freeway": 3, "Seaquest": 6}  # the v1 ids' minimal sets


def paper_network(channels: int, n_out: int) -> nn.Sequential:
    """The MinAtar paper's Q-network as its code writes it, on channels-first input [N, C, 10, 10]."""
    return nn.Sequential(nn.Conv2d(channels, 16, 3, stride=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, n_out))


def maps(n: int, channels: int, seed: int = 0) -> np.ndarray:
    """Random channels-last 0/1 maps [n, 10, 10, C] as EnvGroup writes them (uint8)."""
    return np.random.default_rng(seed).integers(0, 2, (n, 10, 10, channels), dtype=np.uint8)


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("game", sorted(CHANNELS))
def test_q_agent_is_the_papers_network_parameter_for_parameter_on_channels_last_maps(game):
    """Same parameter count as the paper's network, and with its weights copied in, the same
    Q-values: the [10, 10, C] map is read channels last (Seaquest's C = 10 included, where
    the shape alone cannot tell), its conv output flattened in the paper's order."""
    c, a = CHANNELS[game], ACTIONS[game]
    agent = QAgent(np.zeros((10, 10, c), np.uint8), gym.spaces.Discrete(a), PAPER)
    paper = paper_network(c, a)
    assert n_params(agent) == n_params(paper) == (9 * c * 16 + 16) + (1024 * 128 + 128) + (128 * a + a)
    conv, trunk, head = agent.encoder.parts[0].conv, agent.encoder.trunk.net[0], agent.advantage.net[0]
    with torch.no_grad():
        for ours, theirs in zip((conv, trunk, head), (paper[0], paper[3], paper[5])):
            theirs.weight.copy_(ours.weight)
            theirs.bias.copy_(ours.bias)
        x = maps(32, c)
        q = agent.q_values(x)
        assert q.shape == (32, a) and q.dtype == torch.float32
        expected = paper(torch.as_tensor(x).permute(0, 3, 1, 2).float())
    torch.testing.assert_close(q, expected)
    assert not torch.allclose(q, paper(torch.as_tensor(x).float().reshape(32, c, 10, 10)))  # the layout matters


def test_encoder_keeps_leading_dims_and_its_width_follows_hidden_sizes():
    obs = np.zeros((10, 10, 4), np.uint8)
    encoder, width = make_encoder(obs, PAPER)
    assert width == 128 and encoder(torch.as_tensor(maps(15, 4)).reshape(3, 5, 10, 10, 4)).shape == (3, 5, 128)
    bare, width = make_encoder(obs, ModelConfig(encoder="minatar_cnn", hidden_sizes=()))
    assert width == 16 * 8 * 8 and bare(torch.as_tensor(maps(2, 4))).shape == (2, 1024)


def test_policy_gradient_agent_with_one_torso_has_the_papers_actor_critic_and_acts():
    """PPO/A2C with ``agent.shared_encoder``: the paper's AC(lambda) network (one torso, a
    policy head of A and a value head of 1); without it, two such torsos."""
    obs, space = np.zeros((10, 10, 6), np.uint8), gym.spaces.Discrete(4)
    torso = (9 * 6 * 16 + 16) + (1024 * 128 + 128)
    shared = PgAgent(obs, space, PAPER, PgAgentConfig(shared_encoder=True))
    assert n_params(shared) == torso + (128 * 4 + 4) + (128 + 1)
    assert n_params(PgAgent(obs, space, PAPER, PgAgentConfig())) == 2 * torso + (128 * 4 + 4) + (128 + 1)
    action, info = shared.step(maps(8, 6))
    assert action.shape == (8,) and int(action.min()) >= 0 and int(action.max()) < 4
    assert np.isfinite(np.asarray(info.value)).all() and np.isfinite(np.asarray(info.log_prob)).all()


def test_recurrent_q_agent_runs_its_lstm_on_the_minatar_torso():
    """R2D1: the LSTM core after the 128 units; whole sequences [T, B] in, Q [T, B, A] out."""
    cfg = ModelConfig(encoder="minatar_cnn", hidden_sizes=(128,), activation="relu", uint8_scale=1.0, lstm_size=32)
    agent = QAgent(np.zeros((10, 10, 10), np.uint8), gym.spaces.Discrete(6), cfg)
    T, B = 5, 3
    obs = torch.as_tensor(maps(T * B, 10)).reshape(T, B, 10, 10, 10)
    zeros = torch.zeros(T, B, 1, 32)
    memory = Memory(prev_action=torch.zeros(T, B, dtype=torch.int64), prev_reward=torch.zeros(T, B),
                    state=RnnState(h=zeros, c=zeros))
    q = agent.q_sequence(obs, memory)
    assert q.shape == (T, B, 6) and torch.isfinite(q).all()
    q.sum().backward()
    assert agent.encoder.parts[0].conv.weight.grad.abs().sum() > 0  # the gradient reaches the conv


def test_minatar_cnn_on_an_observation_without_a_map_is_one_error_naming_the_encoder():
    with pytest.raises(ValueError, match="encoder='minatar_cnn' needs a 3-D image leaf"):
        QAgent(np.zeros(4, np.float32), gym.spaces.Discrete(2), PAPER)


# ---------------------------------------------------------------- the shipped configs, through the pipeline

SMOKE = {  # each game once (Breakout: the learning check below), each algorithm's config on two
    "SpaceInvaders": "minatar_space_invaders_dqn", "Asterix": "minatar_asterix_ppo",
    "Freeway": "minatar_freeway_dqn", "Seaquest": "minatar_seaquest_ppo",
}
SMALL = {  # the configs' algorithms and networks, at a budget of a few segments
    "dqn": ("sampler.envs=4", "sampler.horizon=16", "replay.min_size_to_sample=256", "replay.samples_per_insert=1"),
    "ppo": ("sampler.count=1", "learner.batch_segments=1", "sampler.envs=8", "sampler.horizon=32", "algo.minibatches=2"),
}
BREAKOUT_FAST = (  # the paper's network; a replay ratio, schedule and targets that learn within seconds
    "sampler.envs=8", "replay.min_size_to_sample=1000", "replay.samples_per_insert=4", "replay.n_step=3",
    "algo.batch_size=64", "algo.lr=1e-3", "algo.double=true", "algo.target_update_period=200",
    "agent.eps_decay_steps=10000", "agent.eps_end=0.05",
)


def random_return(game: str, episodes: int, seed: int = 0, n_envs: int = 8) -> float:
    """Mean return of a uniformly random policy over ``episodes`` episodes of ``game`` with
    the configs' sticky actions (Breakout: ~0.4, about 7 steps an episode)."""
    from shared.envs.group import EnvConfig, EnvGroup

    group = EnvGroup(EnvConfig(id=f"MinAtar/{game}-v1", kwargs='{"sticky_action_prob": 0.1}'), n_envs, seed)
    example = group.example_observation()
    obs, final = np.zeros((2, n_envs, *example.shape), example.dtype)
    reward, terminated, truncated = np.zeros(n_envs, np.float32), np.zeros(n_envs, bool), np.zeros(n_envs, bool)
    rng, returns = np.random.default_rng(seed), []
    group.reset(obs)
    try:
        while len(returns) < episodes:
            actions = rng.integers(group.action_space.n, size=n_envs)
            returns += [ret for _, ret, _ in group.step(actions, obs, reward, terminated, truncated, final)]
    finally:
        group.close()
    return float(np.mean(returns[:episodes]))


def ran_cleanly(run, result: dict, steps: int) -> None:
    """What every run here must show: its budget or target reached with learner updates,
    episodes ended and their returns reported, segments shipped, no env error, no traceback."""
    assert result["env_steps"] >= steps and result["updates"] >= 1, result
    assert result["episodes"] >= 1 and 0 <= result["mean_return"] < math.inf, result
    page = run.metrics()
    assert metric_value(page, "rlpipe_sampler_segments_total") > 0
    assert metric_value(page, "rlpipe_sampler_env_errors_total") == 0
    assert "Traceback" not in run.logs()


@pytest.mark.learning
@pytest.mark.parametrize("game", sorted(SMOKE))
def test_each_games_config_runs_through_the_pipeline(runs, game):
    """1.5k env steps of the shipped config. Episodes are cut at 100 steps (Freeway's last
    2500) so that some end within the budget."""
    config = SMOKE[game]
    run = runs(f"{config}.toml", "run.max_env_steps=1500", "env.max_episode_steps=100", "sampler.inference=local",
               *SMALL[config.rsplit("_", 1)[1]])
    assert run.config().env.id == f"MinAtar/{game}-v1"
    result = run.wait_result(60)
    assert result["reason"] == "budget", result
    ran_cleanly(run, result, 1500)


@pytest.mark.learning
def test_breakout_dqn_with_the_papers_network_beats_a_random_policy_sixfold_within_40k_steps(runs):
    """The shipped Breakout DQN config (the paper's network, sticky actions) made faster by
    BREAKOUT_FAST, through the pipeline: the mean return of the last 100 training episodes,
    epsilon-greedy, reaches 6x a random policy's, measured here (in serial mode seeds 0-2
    reached 8x at 21-22k env steps). Only the processes that step or probe the env import MinAtar,
    whose renderer's matplotlib and seaborn cost ~1.5 s of each process's start."""
    target = 6 * random_return("Breakout", 500)
    assert 0.2 < target / 6 < 0.6
    run = runs("minatar_breakout_dqn.toml", f"run.target_return={target}", "run.max_env_steps=40000",
               "sampler.inference=local", *BREAKOUT_FAST)
    run.wait_steps(2_000)
    pids = {name: pid for name, (_, pid) in run.status().items() if pid is not None}
    assert {name for name, pid in pids.items() if maps_library(pid, "matplotlib")} == {"learner0", "sampler0", "sampler1"}
    result = run.wait_result(60)
    assert result["reason"] == "target" and result["mean_return"] >= target, result
    ran_cleanly(run, result, 1000)
