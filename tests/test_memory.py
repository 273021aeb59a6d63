"""Recurrent agents: each env's state stays its own, resets at episode starts, and the
learner replays stored sequences to exactly what the actor computed."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.sampler.local import LocalActions
from services.sampler.sampler import Sampler
from shared.config import loading, schema
from shared.agents.config import AgentInfo, Memory, ModelConfig, PgAgentConfig, QAgentConfig, RecurrentAgentInfo, RecurrentQAgentInfo, RnnState, info_example
from shared.agents import StepContext
from shared.agents.actor import Actor
from shared.agents.memory import core_memory, sequence_reset
from shared.agents.pg import PgAgent
from shared.agents.q import QAgent
from shared.envs.group import EnvConfig, make_env
from services.build import agent_info, env_probe, make_agent
from shared.data.namedarraytuple import torchify
from shared.config.topology import topology

MODEL = ModelConfig(hidden_sizes=(16,), lstm_size=8, lstm_prev_action=True, lstm_prev_reward=True)


class FixedParams:
    version, env_steps = 0, 0

    def poll(self) -> bool:
        return False

    def close(self) -> None:
        pass


class KeepAll:
    def announce(self, index: int, meta: dict) -> None:
        pass

    def acquire(self, index: int) -> None:
        pass


def local_segments(exp, segments: int, name: str):
    """(agent, the first ``segments`` segments as torch trees) of one local sampler of ``exp``
    (``sampler.ring`` of at least ``segments``) acting with a fresh agent, in this process."""
    probe = env_probe(exp)
    agent = make_agent(exp, probe)
    probe.close()
    topo = topology(exp)
    sampler = Sampler(exp.sampler, exp.env, topo, 0, agent_info(exp), name, shared_memory=False)
    actions = LocalActions(Actor(agent, topo.acting_seed("sampler", 0)), sampler, FixedParams(), topo.total_envs)
    sampler.start(actions)
    for _ in range(segments):
        sampler.collect_segment(actions, KeepAll())
    out = [torchify(sampler.ring[k]) for k in range(segments)]  # heap arrays: they outlive close()
    sampler.close()
    return agent, out


def test_recurrent_info_carries_the_memory_of_a_step():
    assert isinstance(info_example("pg"), AgentInfo)
    info = info_example("pg", MODEL, np.int64(0))
    assert isinstance(info, RecurrentAgentInfo)
    assert info.memory.state.h.shape == info.memory.state.c.shape == (2, 8)  # policy and value cores
    assert info.memory.prev_action.dtype == np.int64 and info.memory.prev_reward.dtype == np.float32
    q = info_example("q", MODEL, np.int64(0))
    assert isinstance(q, RecurrentQAgentInfo) and q.value.dtype == np.float32
    with pytest.raises(ValueError, match="pg .* and q"):
        info_example("qpg", MODEL, np.zeros(2, np.float32))


def test_cartpole_without_velocities_keeps_position_and_angle():
    full, _ = make_env(EnvConfig(id="CartPole-v1"))
    novel, _ = make_env(EnvConfig(id="rlpipe/CartPoleNoVel-v1"))
    a, _ = full.reset(seed=3)
    b, _ = novel.reset(seed=3)
    for t in range(20):
        np.testing.assert_array_equal(b, a[[0, 2]])
        a, ra, ta, _, _ = full.step(t % 2)
        b, rb, tb, _, _ = novel.step(t % 2)
        assert (ra, ta) == (rb, tb)
    assert novel.spec.max_episode_steps == 500 and novel.observation_space.shape == (2,)


def _q_agent() -> QAgent:
    torch.manual_seed(0)
    return QAgent(np.zeros(3, np.float32), gym.spaces.Discrete(4), MODEL, QAgentConfig(eps_eval=0.0))


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_the_state_of_one_env_never_reaches_another(data):
    """Envs acting in random subsets and orders, with random episode starts, get exactly what
    each would get acting alone: nothing of env i's state leaks into env j's."""
    n_envs, steps = 5, 12
    shared = _q_agent()
    alone = [_q_agent() for _ in range(n_envs)]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    for t in range(steps):
        rows = data.draw(st.permutations(range(n_envs)))[: data.draw(st.integers(1, n_envs))]
        index = np.array(rows)
        first = rng.random(len(rows)) < 0.3 if t else np.ones(len(rows), bool)
        obs = torch.as_tensor(rng.standard_normal((len(rows), 3)), dtype=torch.float32)
        reward = rng.standard_normal(len(rows)).astype(np.float32)
        ctx = StepContext(env_index=index, first=first, reward=reward, envs_total=n_envs, greedy=True)
        action, info = shared.step(obs, ctx)
        for k, env in enumerate(rows):
            one = StepContext(env_index=np.array([0]), first=first[k:k + 1], reward=reward[k:k + 1], envs_total=1,
                              greedy=True)
            a1, i1 = alone[env].step(obs[k:k + 1], one)
            assert int(action[k]) == int(a1[0])
            torch.testing.assert_close(info.value[k:k + 1], i1.value)
            torch.testing.assert_close(info.memory.state.h[k:k + 1], i1.memory.state.h)
        # An episode start begins from zeros, whatever the env did before.
        assert torch.all(info.memory.state.h[torch.as_tensor(first)] == 0)
        assert torch.all(info.memory.prev_action[torch.as_tensor(first)] == 0)


def _recurrent_segment(*overrides: str):
    """(experiment, agent, the second of three segments collected by one local sampler)."""
    exp = loading.load("deploy/configs/cartpole_novel_ppo_lstm.toml", [
        "sampler.count=1", "sampler.envs=6", "sampler.horizon=40", "sampler.ring=3", "learner.batch_segments=1",
        "model.lstm_prev_reward=true", "algo.minibatches=2", *overrides])
    agent, segs = local_segments(exp, 3, "memtest")
    return exp, agent, segs[1]  # the second segment: it starts from a state, and its bootstrap is in


def test_the_learner_replays_stored_sequences_to_what_the_actor_computed():
    """Segments with episode ends inside: evaluating them from their stored memory gives the
    actor's log-probs and values exactly, and the bootstrap value too."""
    _, agent, seg = _recurrent_segment()
    s = seg.samples
    assert bool((s.terminated | s.truncated)[:-1].any()), "no episode ended inside the segment"
    with torch.no_grad():
        log_prob, _, value = agent.evaluate(s.observation, s.action, s.agent_info.memory,
                                            sequence_reset(s.terminated, s.truncated))
        v, bootstrap, _ = agent.segment_values(s, seg.bootstrap_observation, torch.zeros_like(s.terminated))
    torch.testing.assert_close(log_prob, s.agent_info.log_prob, rtol=0, atol=1e-5)
    torch.testing.assert_close(value, s.agent_info.value, rtol=0, atol=1e-5)
    torch.testing.assert_close(v, s.agent_info.value, rtol=0, atol=1e-5)
    last_done = (s.terminated | s.truncated)[-1]
    torch.testing.assert_close(bootstrap[~last_done], seg.bootstrap_value[~last_done], rtol=0, atol=1e-5)
    # Without the stored state the replay differs: the test can tell.
    zeroed = s.agent_info.memory._replace(state=RnnState(*(torch.zeros_like(x) for x in s.agent_info.memory.state)))
    with torch.no_grad():
        other, _, _ = agent.evaluate(s.observation, s.action, zeroed, sequence_reset(s.terminated, s.truncated))
    started = s.agent_info.memory.state.h[0].abs().sum((-2, -1)) > 0
    assert started.any() and not torch.allclose(other[:, started], s.agent_info.log_prob[:, started])


@pytest.mark.parametrize("ends_inside", [False, True])
def test_the_last_state_in_one_fused_call_is_the_step_loops_last(ends_inside):
    """R2D1's burn-in asks only for the state after its last step: one nn.LSTM call when no
    episode ends inside, the step loop (with its resets) otherwise; both equal the loop's last row."""
    _, agent, seg = _recurrent_segment()
    s = seg.samples
    core, memory = agent.core, core_memory(s.agent_info.memory, 0)
    reset = sequence_reset(s.terminated, s.truncated) if ends_inside else None
    with torch.no_grad():
        features = agent.pi_encoder(s.observation)
        hs, cs = core.run(features, memory, reset)
        h, c = core.run(features, memory, reset, last_only=True)
    assert h.shape == c.shape == (1, *hs.shape[1:])
    torch.testing.assert_close(h[0], hs[-1], rtol=0, atol=1e-6)
    torch.testing.assert_close(c[0], cs[-1], rtol=0, atol=1e-6)
    if ends_inside:  # the resets matter: without them the last state differs
        assert not torch.allclose(core.run(features, memory, None, last_only=True)[1], c)


@pytest.mark.parametrize("algo", ["ppo", "a2c"])
def test_ppo_and_a2c_update_a_recurrent_agent_on_whole_sequences(algo):
    from shared.algos.a2c import A2C
    from shared.algos.ppo import PPO

    exp, agent, seg = _recurrent_segment()
    before = [p.detach().clone() for p in agent.parameters()]
    stats = (PPO(agent, exp.algo) if algo == "ppo" else A2C(agent)).update(seg, 0.0).stats
    assert all(np.isfinite(v) for v in stats.values())
    assert any(not torch.equal(b, p) for b, p in zip(before, agent.parameters()))


@pytest.mark.parametrize("shared", [False, True])
def test_a_recurrent_pg_agent_has_a_value_core_unless_it_shares_its_encoder(shared):
    agent = PgAgent(np.zeros(2, np.float32), gym.spaces.Discrete(2), MODEL, PgAgentConfig(shared_encoder=shared))
    cores = 1 if shared else 2
    assert (agent.v_core is None) == shared and info_example("pg", MODEL, np.int64(0), PgAgentConfig(
        shared_encoder=shared)).memory.state.h.shape == (cores, 8)
    memory = Memory(prev_action=torch.zeros(3, 2, dtype=torch.int64), prev_reward=torch.zeros(3, 2),
                    state=RnnState(torch.zeros(3, 2, cores, 8), torch.zeros(3, 2, cores, 8)))
    log_prob, entropy, value = agent.evaluate(torch.zeros(3, 2, 2), torch.zeros(3, 2, dtype=torch.int64), memory)
    assert log_prob.shape == entropy.shape == value.shape == (3, 2)
    _, info = agent.step(torch.zeros(4, 2))
    assert info.memory.state.h.shape == (4, cores, 8)


def test_recurrent_agents_are_refused_where_no_algorithm_trains_them():
    with pytest.raises(schema.ConfigError, match="model.lstm_size = 8: dqn has no recurrent agent"):
        loading.load("deploy/configs/cartpole_dqn.toml", ["model.lstm_size=8"])
    with pytest.raises(schema.ConfigError, match="algo.minibatches = 64: .*whole env sequences"):
        loading.load("deploy/configs/cartpole_novel_ppo_lstm.toml", ["algo.minibatches=64"])
