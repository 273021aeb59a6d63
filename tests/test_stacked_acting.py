"""Copies of one agent acting in one stacked pass (shared/agents/stacked.py), as a self-play
opponent's past versions do: each row gets what its own copy alone computes (to float rounding)
and, from the same seed, the same action; a copy no row acts with changes nothing; the agents
that act in numpy or keep a memory are not stacked. (A Connect Four sampler's opponent seat
playing each board's own version through it: tests/test_selfplay_pool.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("pettingzoo")
pytest.importorskip("mpe2")

from services.build import env_probe, make_agent
from shared.agents import StepContext
from shared.agents.actor import Actor
from shared.agents.pg import PgAgent
from shared.agents.q import QAgent
from shared.agents.config import QAgentConfig
from shared.agents.stacked import StackedActor, stacked_actor
from shared.config import loading
from shared.data.namedarraytuple import leaves, map_leaves, numpify, torchify
from tests.pipeline import CONFIGS
from tests.test_agent_groups import _columns, _far_apart

torch.set_num_threads(1)
ROWS, COPIES = 24, 4


def config_copies(name: str):
    """COPIES agents of deploy/configs/``name`` far apart and ROWS random observations of its env."""
    exp = loading.load(CONFIGS / name, ["selfplay.pool='uniform'"])
    probe = env_probe(exp)
    agents = [_far_apart_copy(make_agent(exp, probe), k) for k in range(COPIES)]
    rng = np.random.default_rng(0)
    obs = map_leaves(lambda x: rng.integers(0, 2, (ROWS, *np.shape(x))).astype(np.asarray(x).dtype),
                     probe.example_observation())
    probe.close()
    return agents, obs


def group_copies(make, box: bool):
    """COPIES agents with two agent groups (simple_adversary) far apart, and ROWS columns of it."""
    group, obs = _columns(box, ROWS)
    return [_far_apart_copy(make(group), k) for k in range(COPIES)], numpify(obs)


def _far_apart_copy(agent, k: int):
    _far_apart(agent)
    with torch.no_grad():
        for p in agent.parameters():
            p.add_(0.2 * k * torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))
    return agent.eval()


CASES = {
    "connect_four_ppo": lambda: config_copies("connect_four_pool_ppo.toml"),  # a CNN and an action mask
    "tictactoe_dqn": lambda: config_copies("tictactoe_dqn.toml"),  # epsilon-greedy at its first env steps
    "groups_ppo": lambda: group_copies(lambda g: PgAgent(g.example_observation(), g.action_space,
                                                         obs_space=g.observation_space), False),
    "groups_ppo_box": lambda: group_copies(lambda g: PgAgent(g.example_observation(), g.action_space,
                                                             obs_space=g.observation_space), True),
    "groups_c51": lambda: group_copies(lambda g: QAgent(g.example_observation(), g.action_space,
                                                        cfg=QAgentConfig(distributional=True, dueling=True),
                                                        obs_space=g.observation_space), False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_row_acts_as_its_own_copy_alone_would_from_the_same_seed(case):
    """Rows acting with copies 0-2 of 4 (copy 3 with none): the stacked pass's discrete actions
    equal those chosen from each copy's own outputs on its own rows, joined in row order, from the
    same torch seed; log-probabilities, values and a Box policy's actions equal them to float
    rounding (the batched kernels add up in another order)."""
    agents, obs = CASES[case]()
    actors = [Actor(agent, np.random.SeedSequence(k)) for k, agent in enumerate(agents)]
    copy_of = np.random.default_rng(1).permutation(np.arange(ROWS) % (COPIES - 1))
    env_index, first, reward = np.arange(ROWS), np.zeros(ROWS, bool), np.zeros(ROWS, np.float32)
    torch.manual_seed(0)
    action, info = StackedActor()(actors, (0,), copy_of, obs, env_index, first, reward, 100, ROWS)

    tobs = torchify(obs)
    with torch.inference_mode():
        alone = {k: agents[k].acting_outputs(map_leaves(lambda x: x[copy_of == k], tobs)) for k in range(COPIES - 1)}
        joined = []
        for i, first_out in enumerate(alone[0]):
            out = torch.empty(ROWS, *first_out.shape[1:], dtype=first_out.dtype)
            for k, outs in alone.items():
                out[torch.from_numpy(copy_of == k)] = outs[i]
            joined.append(out)
        torch.manual_seed(0)
        want_action, want_info = agents[0].choose(tuple(joined), tobs,
                                                  StepContext(env_index=env_index, first=first, reward=reward,
                                                              env_steps=100, envs_total=ROWS))
    if np.issubdtype(action.dtype, np.integer):
        np.testing.assert_array_equal(action, numpify(want_action))
    else:  # a Box policy's mean plus its noise
        np.testing.assert_allclose(action, numpify(want_action), rtol=1e-5, atol=1e-5)
    for (path, got), (_, want) in zip(leaves(info), leaves(numpify(want_info))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=path)


def test_only_agents_that_act_in_torch_and_keep_no_memory_are_stacked():
    exp = loading.load(CONFIGS / "connect_four_pool_ppo.toml", [])
    probe = env_probe(exp)
    assert isinstance(stacked_actor(Actor(make_agent(exp, probe), np.random.SeedSequence(0))), StackedActor)
    tictactoe = loading.load(CONFIGS / "tictactoe_ppo.toml", [])
    assert stacked_actor(Actor(make_agent(tictactoe, env_probe(tictactoe)), np.random.SeedSequence(0))) is None
    recurrent = loading.load(CONFIGS / "connect_four_ppo.toml", ["model.lstm_size=16"])
    assert stacked_actor(Actor(make_agent(recurrent, probe), np.random.SeedSequence(0))) is None
    probe.close()
