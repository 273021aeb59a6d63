"""Separate policies per agent group (``env.groups``, shared/agents/groups.py): each column carries
its agent's group index as the ``agent_group`` leaf (agents of different observation lengths
zero-padded to one column), each group's networks act and learn from their own rows only, a
recurrent member's state for a row is the one it would have alone, a setting that cannot work is
one config-error line, the numpy acting plan acts as the torch agent, two groups that must act
differently learn to in serial mode, and deploy/configs/simple_adversary_groups_ppo.toml trains
through the pipeline; an export takes the group (and a recurrent agent's state) as inputs and plays
the agent's actions. Each member runs on its own group's rows alone in eager mode (from
``groups.SPLIT_MIN_ROWS`` rows on the CPU) and on every row, routed by ``torch.where``, where the
shapes must stay fixed: both give the same outputs and gradients, and a trace or an export takes
the second whatever its rows."""

from __future__ import annotations

import copy
import io
import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("pettingzoo")
pytest.importorskip("mpe2")

from shared.agents import EVALUATE, StepContext
from shared.agents.acting import numpy_actor
from shared.agents.actor import acting_plan, state_arrays
from shared.agents import groups
from shared.agents.config import Memory, ModelConfig, QAgentConfig, QuantileHead, RnnState
from shared.agents.pg import PgAgent
from shared.agents.q import QAgent
from shared.config import loading
from shared.config.schema import ConfigError
from shared.data.namedarraytuple import leaves, map_leaves, torchify, zip_map
from shared.envs.backends import make_env_group
from shared.envs.group import EnvConfig
from shared.launch import api
from shared.runtime.runfiles import ACTING_FILE
from tests.pipeline import CONFIGS
from tests.test_envs import Buffers, step_beside_references
from tests.test_export import checkpointed_run, config, loaded, runners

torch.set_num_threads(1)

CONFIG = CONFIGS / "simple_adversary_groups_ppo.toml"
ADVERSARY = EnvConfig(id="pettingzoo:mpe2.simple_adversary_v3", groups={"adversaries": "adversary_*",
                                                                         "good": "agent_*"})
TWO_KINDS = ["env.id='pettingzoo:tests.groups_for_tests'", "env.kwargs=''",
             "env.groups={ left = 'left_*', right = 'right_*' }", "sampler.envs=12", "sampler.horizon=8"]


def test_each_column_carries_its_agents_group_and_its_observation_padded_to_the_longest():
    """2 simple_adversary envs x 3 agents (adversary_0: 8 numbers, agent_0 and agent_1: 10) against
    two envs stepped by hand with the same seeds and actions, through an episode end and the reset."""
    from mpe2 import simple_adversary_v3

    group = make_env_group(ADVERSARY, 6, 7)
    assert group.observation_space["observation"].shape == (10,) and group.observation_space["agent_group"].n == 2

    def check(buf, k, j, ref, own):
        np.testing.assert_array_equal(buf.obs.agent_group, [0, 1, 1, 0, 1, 1])
        np.testing.assert_array_equal(buf.obs.observation[3 * k + j, :len(own)], own)
        assert not buf.obs.observation[3 * k + j, len(own):].any()

    def check_final(buf, k, ref):
        np.testing.assert_array_equal(buf.final_obs.agent_group, [0, 1, 1, 0, 1, 1])

    step_beside_references(group, simple_adversary_v3.parallel_env, check, check_final)
    group.close()


AGENTS = {
    "pg": lambda example, act, space: PgAgent(example, act, obs_space=space),
    "pg_box": lambda example, act, space: PgAgent(example, act, obs_space=space),
    # eps_eval 0: the torch and the numpy agent draw their evaluation epsilon's coin from different
    # generators, so at the default 0.001 one row of six in ~1% of runs explored in one and not the other.
    "dqn": lambda example, act, space: QAgent(example, act, cfg=QAgentConfig(eps_eval=0.0), obs_space=space),
    "c51_dueling": lambda example, act, space: QAgent(example, act, cfg=QAgentConfig(distributional=True, dueling=True,
                                                                                   eps_eval=0.0), obs_space=space),
}


@pytest.mark.parametrize("which", list(AGENTS))
def test_a_groups_rows_reach_its_own_networks_only_and_no_network_reads_the_group(which):
    """pg_box: simple_adversary's continuous actions, whose log-std is each group's own too."""
    box = which == "pg_box"
    group = make_env_group(replace(ADVERSARY, kwargs='{"continuous_actions": true}') if box else ADVERSARY, 6, 0)
    buf = Buffers(group)
    group.reset(buf.obs)
    group.close()
    agent = AGENTS[which](group.example_observation(), group.action_space, group.observation_space)
    assert len(agent.members) == 2
    obs = torchify(buf.obs)
    rows = torch.as_tensor(buf.obs.agent_group)
    # The numpy acting plan (local-inference samplers) acts as the torch agent, row by row.
    fast = numpy_actor(acting_plan(agent), state_arrays(agent), getattr(agent, "cfg", None), np.random.default_rng(0))
    with torch.no_grad():
        action, info = agent.step(obs, EVALUATE)
    got_action, got_info = fast.step(buf.obs, EVALUATE)
    np.testing.assert_allclose(got_action, action.numpy(), atol=1e-5)
    for got, want in zip(got_info, info):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    if box:
        with torch.no_grad():
            agent.members[1].log_std.fill_(-1.0)
        action, info = agent.step(obs)
        log_prob, entropy, _ = agent.evaluate(obs, action)
        torch.testing.assert_close(log_prob, info.log_prob)
        assert entropy[rows == 1].max() < entropy[rows == 0].min()  # each row's own group's log-std
    for k in range(2):
        agent.zero_grad()
        if isinstance(agent, PgAgent):
            action = torch.full((6, 5), 0.5) if box else torch.zeros(6, dtype=torch.int64)
            log_prob, entropy, value = agent.evaluate(obs, action)
            out = log_prob + entropy + value
        else:
            out = agent.q_values(obs).sum(-1)
        out[rows == k].sum().backward()
        touched = [any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters()) for m in agent.members]
        assert touched == [j == k for j in range(2)], (k, touched)
    # A row's outputs are its group's member's, whatever the group leaf's value is as a number.
    with torch.no_grad():
        swapped = obs._replace(agent_group=1 - obs.agent_group)
        if isinstance(agent, PgAgent):
            for k, member in enumerate(agent.members):
                mine = rows == k
                assert torch.equal(agent.value(obs)[mine], member.value(obs)[mine])
                assert torch.equal(agent.value(swapped)[~mine], member.value(obs)[~mine])
        else:
            for k, member in enumerate(agent.members):
                assert torch.equal(agent.q_values(obs)[rows == k], member.q_values(obs)[rows == k])


RECURRENT_MODEL = ModelConfig(hidden_sizes=(32,), lstm_size=8, lstm_prev_action=True, lstm_prev_reward=True)
RECURRENT = {
    "ppo": lambda example, act, space: PgAgent(example, act, RECURRENT_MODEL, obs_space=space),
    "r2d1": lambda example, act, space: QAgent(example, act, RECURRENT_MODEL, QAgentConfig(eps_eval=0.0),
                                               obs_space=space),
}


def _stacked(trees: list):
    return zip_map(lambda *xs: torch.stack(xs), *trees)


@pytest.mark.parametrize("which", list(RECURRENT))
def test_a_recurrent_members_state_for_a_row_is_its_own_and_a_groups_rows_train_its_member_only(which):
    """7 greedy steps of 6 simple_adversary columns: each row's action, value and stored state are
    those of its group's member acting alone on its group's columns (a copy stepped beside it);
    the learner's sequences from the stored state of step 1 (not zeros) replay the acting values,
    and a group's rows' gradients reach its member only."""
    group = make_env_group(ADVERSARY, 6, 0)
    buf = Buffers(group)
    group.reset(buf.obs)
    agent = RECURRENT[which](group.example_observation(), group.action_space, group.observation_space)
    with torch.no_grad():  # members far apart: a row given another member's state or outputs shows
        for p in agent.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    assert acting_plan(agent) is None  # recurrent agents act in torch
    rows = torch.as_tensor(buf.obs.agent_group).clone()
    alone = [copy.deepcopy(member) for member in agent.members]
    first, reward = np.ones(6, bool), np.zeros(6, np.float32)
    steps = []
    for _ in range(7):
        obs = torchify(map_leaves(np.copy, buf.obs))
        action, info = agent.step(obs, StepContext(first=first, reward=reward, greedy=True))
        for k, member in enumerate(alone):
            mine = torch.nonzero(rows == k)[:, 0]
            own = StepContext(env_index=mine.numpy(), first=first[mine], reward=reward[mine], envs_total=6, greedy=True)
            own_action, own_info = member.step(obs[mine], own)
            torch.testing.assert_close(own_action, action[mine])
            for (path, got), (_, want) in zip(leaves(own_info), leaves(info[mine])):
                torch.testing.assert_close(got, want, msg=f"group {k}'s {path}")
        steps.append((obs, action, info, torch.as_tensor(reward)))
        buf.actions[:] = action.numpy()
        buf.step(group)
        first, reward = buf.terminated | buf.truncated, buf.reward.copy()
    group.close()
    assert not first.any()  # no episode ended: the sequences have no resets
    obs, action, info, _ = (_stacked([step[j] for step in steps[1:-1]]) for j in range(4))
    reward = torch.stack([step[3] for step in steps[2:]])  # the reward of each sequence step
    assert info.memory.state.h[0].abs().min() > 0
    reset = torch.zeros(5, 6, dtype=torch.bool)
    if which == "ppo":
        log_prob, _, value = agent.evaluate(obs, action, info.memory, reset)
        torch.testing.assert_close(log_prob, info.log_prob)
        torch.testing.assert_close(value, info.value)
        samples = SimpleNamespace(observation=obs, agent_info=info, action=action, reward=reward, terminated=reset,
                                  truncated=reset, final_observation=obs)
        value, bootstrap, _ = agent.segment_values(samples, steps[-1][0], reset)
        torch.testing.assert_close(value, info.value)
        torch.testing.assert_close(bootstrap, steps[-1][2].value)
        trained = lambda: sum(agent.evaluate(obs, action, info.memory, reset))  # noqa: E731
    else:
        torch.testing.assert_close(agent.q_sequence(obs, info.memory, reset).max(-1).values, info.value)
        h, c = agent.last_state(obs, info.memory, reset)
        torch.testing.assert_close(h, steps[-1][2].memory.state.h[:, 0])
        torch.testing.assert_close(c, steps[-1][2].memory.state.c[:, 0])
        trained = lambda: agent.q_sequence(obs, info.memory, reset).sum(-1)  # noqa: E731
    for k in range(2):
        agent.zero_grad()
        trained()[:, rows == k].sum().backward()
        touched = [any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters()) for m in agent.members]
        assert touched == [j == k for j in range(2)], (k, touched)


SPLIT_ROWS = 96
"""Columns of the split-path checks: two feed-forward batches' worth of ``SPLIT_MIN_ROWS``, or
sequences [4, 24]."""
SPLIT = {
    **AGENTS,
    "iqn": lambda example, act, space: QAgent(example, act, obs_space=space,
                                              quantiles=QuantileHead(n_cosines=8, acting_samples=4)),
    **{f"{name}_sequences": make for name, make in RECURRENT.items()},
}


def _far_apart(agent) -> None:
    """Members far apart, so that a row given another member's outputs or gradient shows."""
    with torch.no_grad():
        for p in agent.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))


def _columns(box: bool, n: int):
    """The env group (for its example observation and spaces) and ``n`` columns' observations of
    simple_adversary (3 agents a world: groups 0, 1, 1, ...), each made its own by noise."""
    group = make_env_group(replace(ADVERSARY, kwargs='{"continuous_actions": true}') if box else ADVERSARY, n, 0)
    buf = Buffers(group)
    group.reset(buf.obs)
    group.close()
    obs = torchify(map_leaves(np.copy, buf.obs))
    noise = torch.randn(obs.observation.shape, generator=torch.Generator().manual_seed(1))
    return group, obs._replace(observation=obs.observation + noise)


def _split_outputs(which: str, agent, obs) -> tuple[torch.Tensor, ...]:
    """Every grouped method of the agent on ``obs`` [SPLIT_ROWS] (as sequences [4, 24] for a
    recurrent one), each result once."""
    gen = torch.Generator().manual_seed(2)
    seq = map_leaves(lambda x: x.reshape(4, -1, *x.shape[1:]), obs)  # [T, B]
    if not which.endswith("_sequences"):
        if isinstance(agent, QAgent):
            if which == "iqn":
                values, _ = agent.quantiles(obs, torch.rand(len(obs.observation), 6, generator=gen))
                return (values,)
            return (agent.q_values(obs),) + ((agent.dist(obs),) if which == "c51_dueling" else ())
        action, info = agent.step(obs, EVALUATE)
        return (*agent.evaluate(obs, action), agent.policy_output(obs), agent.value(seq), action, *info)
    B = seq.observation.shape[1]
    cores = agent.acting.cores
    memory = Memory(prev_action=torch.randint(0, 5, (4, B), generator=gen),
                    prev_reward=torch.randn(4, B, generator=gen),
                    state=RnnState(h=torch.randn(4, B, cores, 8, generator=gen),
                                   c=torch.randn(4, B, cores, 8, generator=gen)))
    reset = torch.rand(4, B, generator=gen) < 0.2
    step = map_leaves(lambda x: x.flatten(0, 1), memory)  # an acting step of all 96 columns
    if isinstance(agent, QAgent):
        return (agent.q_sequence(seq, memory, reset), *agent.last_state(seq, memory, reset),
                *agent.core_step(obs, step))
    action = torch.randint(0, 5, (4, B), generator=gen)
    truncated = torch.rand(4, B, generator=gen) < 0.2
    samples = SimpleNamespace(observation=seq, agent_info=SimpleNamespace(memory=memory), action=action,
                              reward=torch.randn(4, B, generator=gen), terminated=torch.zeros_like(truncated),
                              truncated=truncated, final_observation=map_leaves(lambda x: x.flip(0), seq))
    return (*agent.evaluate(seq, action, memory, reset),
            *agent.segment_values(samples, map_leaves(lambda x: x[-1], seq), truncated), *agent.core_step(obs, step))


def _with_gradients(agent, outputs) -> tuple[list[torch.Tensor], dict]:
    """``outputs()`` and every parameter's gradient of a fixed weighting of those with grad."""
    agent.zero_grad(set_to_none=True)
    outs = outputs()
    loss = sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in outs if o.requires_grad)
    loss.backward()
    return [o.detach() for o in outs], {name: p.grad for name, p in agent.named_parameters()}


@pytest.mark.parametrize("empty", [False, True], ids=["both_groups", "a_group_without_rows"])
@pytest.mark.parametrize("which", list(SPLIT))
def test_running_each_member_on_its_groups_rows_alone_gives_what_routing_every_members_rows_gives(which, empty,
                                                                                                   monkeypatch):
    """96 simple_adversary columns: each method of the agent with groups (PPO's evaluate, values,
    acting step and Box log-std; Q-values, C51 distribution, IQN quantiles at the same fractions;
    recurrent PPO's and R2D1's sequences, recomputed values with bootstrap and final observations,
    burn-in state and acting step) and each parameter's gradient, with the rows split by group
    (eager, on the CPU: what the learner runs) and with every member on every row (the shapes an
    export keeps), agree to float rounding. Also where a group has no rows in the batch: its
    member's gradient is zero, not None, on both paths (Adam still moves it by its moments, and
    data-parallel ranks all-reduce the same tensors)."""
    torch.manual_seed(0)
    group, obs = _columns(which == "pg_box", SPLIT_ROWS)
    if empty:
        obs = obs._replace(agent_group=torch.ones_like(obs.agent_group))
    agent = SPLIT[which](group.example_observation(), group.action_space, group.observation_space)
    _far_apart(agent)
    splits = []
    split_rows = groups._rows_by_group
    monkeypatch.setattr(groups, "_rows_by_group", lambda *a: splits.append(a) or split_rows(*a))
    split, split_grads = _with_gradients(agent, lambda: _split_outputs(which, agent, obs))
    assert splits, "the rows were not split"
    splits.clear()
    with groups.split_min_rows(math.inf):
        where, where_grads = _with_gradients(agent, lambda: _split_outputs(which, agent, obs))
    assert not splits
    for k, (got, want) in enumerate(zip(split, where)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"output {k}")
    for name, want in where_grads.items():
        if want is None:
            assert split_grads[name] is None, name
        else:  # a sum over the rows, added up in another order: rounding scales with the gradient's size
            torch.testing.assert_close(split_grads[name], want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max()),
                                       msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("fmt", ["torchscript", "exported"])
def test_a_trace_or_an_export_routes_every_row_by_where_whatever_its_rows(fmt):
    """A greedy policy with groups traced (TorchScript) or exported (torch.export) on 96 rows, as
    many as split in eager mode, keeps no split: fed the rows with their groups swapped (each row
    now another member's), it plays what the agent plays on them."""
    from shared.launch.artefacts.export import GreedyPolicy

    group, obs = _columns(False, SPLIT_ROWS)
    agent = PgAgent(group.example_observation(), group.action_space, obs_space=group.observation_space)
    _far_apart(agent)
    policy = GreedyPolicy(agent, group.example_observation()).eval()
    inputs = (obs.agent_group, obs.observation)
    assert policy.signature.inputs == ("agent_group", "observation")
    with torch.no_grad():
        if fmt == "torchscript":
            graph = torch.jit.trace(policy, inputs, check_trace=False)
        else:
            batch = torch.export.Dim("batch")
            graph = torch.export.export(policy, inputs, dynamic_shapes=(({0: batch}, {0: batch}),)).module()
        swapped = obs._replace(agent_group=1 - obs.agent_group)
        action, info = agent.step(swapped, EVALUATE)
        got_action, got_value = graph(swapped.agent_group, swapped.observation)
    torch.testing.assert_close(got_action, action)
    torch.testing.assert_close(got_value, info.value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides, line", [
    (["env.groups={ x = 'x_*', good = 'agent_*' }"],
     "env.groups: 'x_*' matches no agent of 'pettingzoo:mpe2.simple_adversary_v3' (agents: adversary_0, agent_0, "
     "agent_1)"),
    (["env.groups={ adversaries = 'adversary_*' }"],
     "env.groups: agent 'agent_0' of 'pettingzoo:mpe2.simple_adversary_v3' is in no group; every agent must be in "
     "exactly one group"),
    (["env.groups={ all = '*', good = 'agent_*' }"],
     "env.groups: agent 'agent_0' of 'pettingzoo:mpe2.simple_adversary_v3' is in all ('*') and good ('agent_*'); "
     "every agent must be in exactly one group"),
    (["env.groups={ all = '*' }"],
     "env.groups: 'adversary_0' and 'agent_0' of 'pettingzoo:mpe2.simple_adversary_v3' are both in group 'all' but "
     "observe Box(-inf, inf, (8,), float32) and Box(-inf, inf, (10,), float32); one group's network reads one "
     "observation layout: give them groups of their own"),
    (["env.id='CartPole-v1'", "env.kwargs=''", "sampler.envs=4"],
     "env.groups: 'CartPole-v1' is a single-agent env; agent groups are for 'pettingzoo:<module>' envs (leave it "
     "out)"),
    (["env.groups='adversary_*'"],
     "env.groups = 'adversary_*': expected a table, e.g. { name = \"value\" }, got str"),
    (["env.id='pettingzoo:pettingzoo.classic.tictactoe_v3'", "env.kwargs=''", "sampler.envs=4",
      "env.groups={ first = 'player_1', second = 'player_2' }", "selfplay.pool='uniform'", "model.lstm_size=16"],
     "model.lstm_size = 16: the self-play pool's opponent keeps no recurrent state; use a feed-forward agent with "
     "selfplay.pool"),
    (["model.encoder='tests.extending_for_tests:LayerNormEncoder'"],
     "model.encoder = 'tests.extending_for_tests:LayerNormEncoder': with env.groups no network may read the "
     "agent_group leaf, which only the built-in encoders leave out"),
])
def test_groups_that_cannot_work_are_one_config_error_line(overrides, line):
    with pytest.raises(ConfigError) as e:
        loading.load(CONFIG, overrides)
    assert str(e.value) == line


def test_groups_for_agents_without_per_group_networks_are_one_config_error_line():
    with pytest.raises(ConfigError) as e:
        loading.load(CONFIGS / "pendulum_sac.toml", [f"env.id='{ADVERSARY.id}'", "env.kwargs='{\"continuous_actions\": true}'",
                                                     "env.groups={ a = 'adversary_*', g = 'agent_*' }",
                                                     "sampler.envs=3"])
    assert str(e.value) == ("env.groups: sac's agent has no networks per agent group; groups are for policy-gradient "
                            "(ppo, a2c, impala) and DQN-family algorithms")


@pytest.mark.learning
def test_two_groups_that_must_act_differently_learn_to_in_serial_mode(tmp_path):
    """Left agents earn 1 a step for action 0, the right agent for action 1, on identical
    observations (tests/groups_for_tests.py): one shared policy earns at most 16 / 3 of the 8 points
    an agent's episode holds on average; a policy per group all 8."""
    exp = loading.load(CONFIG, [*TWO_KINDS, f"run.runs_dir='{tmp_path}'", "run.max_env_steps=4800", "algo.epochs=4",
                                "algo.lr=3e-3"])
    result = api.train_serial(exp, out=io.StringIO())
    assert result["reason"] == "budget" and result["skipped_updates"] == 0, result
    assert result["mean_return"] > 7.0, result
    one = loading.load(CONFIG, [*TWO_KINDS, "env.groups={ all = '*' }", f"run.runs_dir='{tmp_path}'",
                                "run.max_env_steps=4800", "algo.epochs=4", "algo.lr=3e-3"])
    assert api.train_serial(one, out=io.StringIO())["mean_return"] <= 16 / 3 + 1e-6  # the routing is what learns

    from services.evaluator.episodes import load_agent, play

    agent, _ = load_agent(exp, Path(result["run_dir"]))
    assert (play(exp, agent, episodes=6, envs=6).returns == 8).all()  # rlpipe evaluate's greedy episodes: every point
    group = make_env_group(exp.env, 3, 0)
    buf = Buffers(group)
    group.reset(buf.obs)
    group.close()
    action, _ = agent.step(torchify(buf.obs), EVALUATE)
    assert action.tolist() == [0, 0, 1]


def test_evaluate_gives_each_groups_return_from_its_agents_episodes():
    """A player that always takes action 0 earns every point as a left agent, none as the right
    one: `rlpipe evaluate`'s return per group (eval.json's ``group_returns``) keeps them apart,
    where the mean over all agents (16 / 3) would hide both."""
    from services.evaluator.episodes import by_group, play

    class ActionZero:
        def step(self, obs, ctx):
            return torch.zeros(len(ctx.first), dtype=torch.int64), None

    exp = loading.load(CONFIG, TWO_KINDS)
    played = play(exp, ActionZero(), episodes=12, envs=6)
    assert sorted(played.returns.tolist()) == [0.0] * 4 + [8.0] * 8
    assert by_group(exp, played) == {"group_returns": {"left": {"mean_return": 8.0, "episodes": 8},
                                                       "right": {"mean_return": 0.0, "episodes": 4}}}
    spread = loading.load(CONFIGS / "simple_spread_ppo.toml")
    played = play(spread, ActionZero(), episodes=3, envs=3)
    assert played.group is None and by_group(spread, played) == {}


EXPORTS = {
    "ppo": config("simple_adversary_groups_ppo.toml"),
    "ppo_global_state": config("simple_adversary_groups_ppo.toml", env={"global_state": True}),
    "dqn": config("cartpole_dqn.toml", env={"id": ADVERSARY.id, "kwargs": '{"continuous_actions": false}',
                                            "groups": ADVERSARY.groups}, sampler={"envs": 6}, agent={"eps_eval": 0.0}),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_an_export_routes_each_row_by_its_agent_group_input_as_the_agent_does(tmp_path, name):
    """The export (every format) of an agent with groups moved off its initialisation plays the
    agent's greedy actions (and values, Q-values) on 300 simple_adversary columns; with a
    centralised value the graph is the policy alone, without the state."""
    run_dir = checkpointed_run(tmp_path / "run", EXPORTS[name])
    exp, agent = loaded(run_dir)
    group = make_env_group(exp.env, 6, 0)
    buf = Buffers(group)
    group.reset(buf.obs)
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(50):
        steps.append({k: np.array(getattr(buf.obs, k)) for k in buf.obs._fields})
        buf.actions[:] = rng.integers(0, 5, 6)
        buf.step(group)
    group.close()
    batch = {k: np.concatenate([step[k] for step in steps]) for k in steps[0]}
    with torch.inference_mode():
        tree = torchify(type(buf.obs)(**batch))
        action, info = agent.step(tree, EVALUATE)
        head = agent.q_values(tree) if name == "dqn" else None if name == "ppo_global_state" else info.value
    inputs = [k for k in batch if k != "global_state"]
    assert inputs == ["agent_group", "observation"] and len(np.unique(action.numpy())) > 1
    for fmt, run in runners(run_dir, tmp_path / "out").items():
        got = run([batch[k] for k in inputs])
        np.testing.assert_array_equal(got[0], action.numpy(), err_msg=fmt)
        if head is None:
            assert len(got) == 1, fmt
        else:
            np.testing.assert_allclose(got[1], head.numpy(), rtol=1e-4, atol=1e-4, err_msg=fmt)


RECURRENT_EXPORTS = {
    "ppo": config("simple_adversary_groups_ppo.toml", model={"lstm_size": 16, "lstm_prev_action": True,
                                                             "lstm_prev_reward": True}),
    "r2d1": config("cartpole_novel_r2d1.toml", env={"id": ADVERSARY.id, "kwargs": '{"continuous_actions": false}',
                                                    "groups": ADVERSARY.groups}, sampler={"envs": 6},
                   model={"lstm_size": 16, "lstm_prev_action": True, "lstm_prev_reward": True},
                   agent={"eps_eval": 0.0}),
}


@pytest.mark.parametrize("name", list(RECURRENT_EXPORTS))
def test_a_recurrent_export_with_groups_carries_each_rows_own_members_state(tmp_path, name):
    """The export (every format) of a recurrent agent with groups, fed the agent's stored state at
    each of 10 greedy steps of 6 simple_adversary columns, plays its actions and values and returns
    the state each row's group's member moves on to."""
    run_dir = checkpointed_run(tmp_path / "run", RECURRENT_EXPORTS[name])
    exp, agent = loaded(run_dir)
    group = make_env_group(exp.env, 6, 0)
    buf = Buffers(group)
    group.reset(buf.obs)
    first, reward = np.ones(6, bool), np.zeros(6, np.float32)
    steps = []
    with torch.inference_mode():
        for _ in range(10):
            obs = map_leaves(np.copy, buf.obs)
            action, info = agent.step(torchify(obs), replace(EVALUATE, first=first, reward=reward))
            memory = info.memory
            inputs = [obs.agent_group, obs.observation, *(x.numpy() for x in (memory.state.h, memory.state.c,
                                                                              memory.prev_action, memory.prev_reward))]
            steps.append((inputs, action.numpy(), info.value.numpy()))
            buf.actions[:] = action.numpy()
            buf.step(group)
            first, reward = buf.terminated | buf.truncated, buf.reward.copy()
    group.close()
    assert len(np.unique(np.concatenate([a for _, a, _ in steps]))) > 1
    for fmt, run in runners(run_dir, tmp_path / "out").items():
        for t, (inputs, action, value) in enumerate(steps):
            got_action, head, h, c = run(inputs)
            np.testing.assert_array_equal(got_action, action, err_msg=fmt)
            np.testing.assert_allclose(head if name == "ppo" else head.max(-1), value, rtol=1e-4, atol=1e-4,
                                       err_msg=fmt)
            if t + 1 < len(steps):
                np.testing.assert_allclose(h, steps[t + 1][0][2], rtol=1e-4, atol=1e-5, err_msg=fmt)
                np.testing.assert_allclose(c, steps[t + 1][0][3], rtol=1e-4, atol=1e-5, err_msg=fmt)


SERIAL = {
    "dqn": ("cartpole_dqn.toml", [*TWO_KINDS, "sampler.envs=6", "run.max_env_steps=2000"]),
    "rainbow": ("cartpole_rainbow.toml", [*TWO_KINDS, "sampler.envs=6", "run.max_env_steps=2000"]),
    "iqn": ("cartpole_iqn.toml", [*TWO_KINDS, "sampler.envs=6", "run.max_env_steps=2000"]),
    "ppo_box": ("simple_adversary_groups_ppo.toml", ["env.kwargs='{\"continuous_actions\": true}'", "sampler.envs=6",
                                                     "run.max_env_steps=1200", "algo.epochs=2"]),
    "ppo_lstm": ("simple_adversary_groups_ppo.toml", ["model.lstm_size=16", "model.lstm_prev_action=true",
                                                      "sampler.envs=6", "run.max_env_steps=1200", "algo.epochs=2"]),
    "r2d1": ("cartpole_novel_r2d1.toml", [f"env.id='{ADVERSARY.id}'", "env.kwargs='{\"continuous_actions\": false}'",
                                          "env.groups={ adversaries = 'adversary_*', good = 'agent_*' }",
                                          "model.lstm_size=16", "sampler.envs=6", "replay.min_size_to_sample=60",
                                          "run.max_env_steps=1200"]),
}


@pytest.mark.parametrize("name", list(SERIAL))
def test_other_agents_with_groups_train_in_serial_mode(tmp_path, name):
    """The DQN family's agents (IQN: one draw of fractions for all groups), PPO on continuous
    actions (a log-std a group), and recurrent PPO and R2D1 on simple_adversary (an LSTM a group)."""
    config, overrides = SERIAL[name]
    exp = loading.load(CONFIGS / config, [*overrides, f"run.runs_dir='{tmp_path}'"])
    result = api.train_serial(exp, out=io.StringIO())
    assert result["reason"] == "budget" and result["updates"] > 0 and result["skipped_updates"] == 0, result


def test_a_policy_per_seat_plays_against_a_pool_of_its_past_versions_in_serial_mode(tmp_path):
    """Tic-tac-toe with a group a seat against a pool: the past versions' files load into the
    opponent's copies (each holding both seats' networks) and their games are scored."""
    exp = loading.load(CONFIGS / "tictactoe_ppo.toml", ["env.groups={ first = 'player_1', second = 'player_2' }",
                                                        "selfplay.pool='uniform'", "selfplay.snapshot_every=2",
                                                        "run.max_env_steps=4000", f"run.runs_dir='{tmp_path}'"])
    result = api.train_serial(exp, out=io.StringIO())
    assert result["reason"] == "budget" and result["skipped_updates"] == 0, result
    scores = json.loads((Path(result["run_dir"]) / "pool" / "scores.json").read_text())["versions"]
    played = [v for v, s in scores.items() if s["win"] + s["draw"] + s["loss"] > 0]
    assert len(played) >= 2, scores


@pytest.mark.parametrize("inference", ["local", "server"])
def test_the_shipped_groups_config_trains_through_the_pipeline(runs, inference):
    """Local inference: the sampler acts in numpy from the learner's plan of plans; server
    inference: the action-server routes the columns of a step slot by their group leaf."""
    run = runs("simple_adversary_groups_ppo.toml", "run.max_env_steps=3000", "sampler.envs=6", "algo.epochs=2",
               f"sampler.inference='{inference}'")
    result = run.wait_result(120)
    assert result["reason"] == "budget" and result["updates"] >= 10 and np.isfinite(result["mean_return"]), result
    assert json.loads((run.dir / ACTING_FILE).read_text())["plan"]["family"] == "groups"  # numpy where local


def test_a_rival_run_whose_groups_come_in_another_order_is_refused():
    """A group's index is its place in the config's table, and a rival's agent routes our env's
    ``agent_group`` leaf by its own order: the same groups in another order would hand each
    seat's columns to the other seat's networks, so the runs do not observe the game alike."""
    from services.evaluator.matches import check_opponent

    ours = loading.load(CONFIGS / "tictactoe_ppo.toml", ["env.groups={ first = 'player_1', second = 'player_2' }"])
    same = loading.load(CONFIGS / "tictactoe_ppo.toml", ["env.groups={ first = 'player_1', second = 'player_2' }"])
    swapped = loading.load(CONFIGS / "tictactoe_ppo.toml", ["env.groups={ second = 'player_2', first = 'player_1' }"])
    check_opponent(ours, "rival", same)
    with pytest.raises(ValueError, match="env.groups"):
        check_opponent(ours, "rival", swapped)


def _own_pg(obs_example, action_space, model_cfg, agent_cfg, algo_cfg, obs_space=None):
    """An out-of-tree actor-critic as docs/extending.md describes one: built on ``make_encoder``
    (here PgAgent's, without groups), knowing nothing of ``env.groups``."""
    return PgAgent(obs_example, action_space, model_cfg, agent_cfg, obs_space, groups=0)


def _own_ppo_spec():
    from shared.agents.registry import AgentSpec, PG
    from shared.algos.registry import ALGOS

    return replace(ALGOS["ppo"], name="own_ppo", agent=AgentSpec("own_pg", PG.config, "pg", _own_pg))


OWN_PPO = _own_ppo_spec()


def test_groups_with_an_agent_that_has_no_networks_per_group_are_a_config_error_before_the_run():
    """An agent of the user's own of the pg family that holds no ``members`` would train one
    network for every agent, its encoder leaving the group leaf out: the run would not be the one
    its config names. Building it (as every service does, and the launcher before anything
    starts) is one config-error line instead."""
    from services.build import check_buildable

    own = [*TWO_KINDS, "algo.name='tests.test_agent_groups:OWN_PPO'"]
    with pytest.raises(ConfigError, match="env.groups: the own_ppo agent"):
        check_buildable(loading.load(CONFIG, own))
    check_buildable(loading.load(CONFIG, [*own, "env.groups={}"]))  # without groups it is any agent


def test_a_rival_run_that_observes_the_global_state_otherwise_is_refused():
    """env.global_state adds a leaf to every column's observation: a rival whose agent was built
    without it (or with it, where ours has none) cannot act on our env's observations (its
    encoder counts the leaves; its value reads the state), so check_opponent names the field
    first, as for env.agent_id. (No shipped two-player game has a state(); an env of one's own may.)"""
    from services.evaluator.matches import check_opponent

    ours = loading.load(CONFIGS / "tictactoe_ppo.toml")
    rival = replace(ours, env=replace(ours.env, global_state=True))
    with pytest.raises(ValueError, match="env.global_state"):
        check_opponent(ours, "rival", rival)
