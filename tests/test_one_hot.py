"""Discrete and MultiDiscrete observation leaves reach the network one-hot (issue 26), as
SB3's preprocess_obs does: a Discrete(16) state is a unit vector, not the scalar 0..15."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch

from services.build import env_probe, make_agent
from shared.agents.actor import acting_plan
from shared.agents.config import ModelConfig, QAgentConfig
from shared.agents.models import OneHot, make_encoder
from shared.agents.q import QAgent
from shared.algos.dqn import DQN, DQNConfig
from shared.config import loading
from shared.data.batches import Transition
from shared.envs.group import space_example

torch.set_num_threads(1)


def _experiment(algo: str):
    table = "queue" if algo == "ppo" else "uniform"
    return loading.from_dict(loading.apply_overrides({}, [
        "env.id='FrozenLake-v1'", f"algo.name='{algo}'", f"replay.table='{table}'", "sampler.envs=2",
        "sampler.count=2", "replay.capacity=" + ("2" if algo == "ppo" else "10000")]))


def _trunk_input(module: torch.nn.Module, run) -> torch.Tensor:
    """What ``module`` receives while ``run()`` runs."""
    seen = []
    handle = module.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach().clone()))
    try:
        run()
    finally:
        handle.remove()
    return seen[0]


def test_a_frozenlake_observation_reaches_the_network_one_hot():
    for algo in ("dqn", "ppo"):
        exp = _experiment(algo)
        probe = env_probe(exp)
        try:
            assert isinstance(probe.observation_space, gym.spaces.Discrete) and probe.observation_space.n == 16
            agent = make_agent(exp, probe)
        finally:
            probe.close()
        obs = torch.tensor([5, 0, 15])  # EnvGroup's int64 states
        encoder = agent.encoder if algo == "dqn" else agent.pi_encoder
        assert isinstance(encoder.parts[0], OneHot) and encoder.parts[0].out_dim == 16
        if algo == "dqn":
            seen = _trunk_input(encoder.trunk, lambda: agent.q_values(obs))
        else:
            seen = _trunk_input(agent.twin, lambda: agent.evaluate(obs, torch.zeros(3, dtype=torch.long)))[0]
        torch.testing.assert_close(seen, torch.eye(16)[[5, 0, 15]])
        # The numpy acting path flattens one float vector: it does not claim this agent (torch acts).
        assert acting_plan(agent) is None


def test_multidiscrete_and_discrete_with_start_in_a_dict():
    space = gym.spaces.Dict({"pos": gym.spaces.MultiDiscrete([3, 2]), "room": gym.spaces.Discrete(4, start=-1),
                             "x": gym.spaces.Box(-1, 1, (2,), np.float32)})
    example = space_example(space, "Observation", "Observation")  # as EnvGroup lays it out
    encoder, width = make_encoder(example, ModelConfig(hidden_sizes=()), space)
    assert width == 3 + 2 + 4 + 2
    obs = type(example)(pos=torch.tensor([[2, 1], [0, 0]]), room=torch.tensor([-1, 2]),
                        x=torch.tensor([[0.5, -0.5], [0.0, 1.0]]))
    want = torch.tensor([[0, 0, 1, 0, 1, 1, 0, 0, 0, 0.5, -0.5],
                         [1, 0, 0, 1, 0, 0, 0, 0, 1, 0.0, 1.0]])
    torch.testing.assert_close(encoder(obs), want)
    # without the space (an agent built from an example alone) ints stay numbers, as before
    assert make_encoder(example, ModelConfig(hidden_sizes=()))[1] == 2 + 1 + 2


def test_a_linear_q_agent_learns_frozenlake_from_one_hot_states():
    """With one-hot states a linear Q-network is a Q-table: DQN on random transitions of the
    deterministic 4x4 lake finds the 6-step path to the goal (on raw state numbers 0..15 a
    linear Q cannot represent it)."""
    env = gym.make("FrozenLake-v1", is_slippery=False)
    rng = np.random.default_rng(0)
    rows = []
    obs, _ = env.reset(seed=0)
    for _ in range(3000):
        a = int(rng.integers(4))
        nxt, r, term, trunc, _ = env.step(a)
        rows.append((obs, a, r, nxt, 0.0 if term else 0.9))
        obs = env.reset()[0] if term or trunc else nxt
    o, a, r, n, d = (np.array(x) for x in zip(*rows))
    space = env.observation_space
    torch.manual_seed(0)
    agent = QAgent(np.zeros((), np.int64), env.action_space, ModelConfig(hidden_sizes=()), QAgentConfig(), obs_space=space)
    algo = DQN(agent, DQNConfig(lr=0.05, batch_size=256, double=False, huber_delta=0.0, target_update_period=20))
    for step in range(600):
        i = rng.integers(len(rows), size=256)
        batch = Transition(observation=torch.as_tensor(o[i]), action=torch.as_tensor(a[i]),
                           return_=torch.as_tensor(r[i], dtype=torch.float32), bootstrap_observation=torch.as_tensor(n[i]),
                           bootstrap_discount=torch.as_tensor(d[i], dtype=torch.float32), is_weight=torch.ones(256),
                           policy_version=torch.zeros(256, dtype=torch.int64), steps=None)
        algo.update(batch, step / 600)
    obs, _ = env.reset(seed=0)
    for t in range(20):
        with torch.no_grad():
            action = int(agent.q_values(torch.tensor([obs])).argmax(-1))
        obs, reward, term, trunc, _ = env.step(action)
        if term or trunc:
            break
    assert reward == 1.0 and t + 1 == 6
