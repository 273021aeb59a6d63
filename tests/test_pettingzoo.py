"""PettingZoo envs in samplers (shared/envs/pettingzoo_backend.py): one batch column per (env,
agent) over random actions, for a Parallel env (MPE's simple_spread) and a turn-based AEC game
(tic-tac-toe): columns, returns and lengths per agent, final observations, seeding, the pass of
a waiting seat, padding for agents that left (failed steps in the sampler's segments, in no
batch); a wrong env is one config-error line; PPO and DQN self-play on tic-tac-toe with one shared
policy beat a random player in serial mode and through the pipeline."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("pettingzoo")
mpe2 = pytest.importorskip("mpe2")

from services.evaluator.episodes import load_agent
from shared.agents import EVALUATE
from shared.algos.gae import pg_targets
from shared.config import loading
from shared.config.schema import ConfigError
from shared.data.namedarraytuple import numpify, torchify
from shared.envs.backends import make_env_group
from shared.envs.group import EnvConfig
from shared.launch import api
from tests.pipeline import CONFIGS
from tests.pettingzoo_for_tests import LIFETIMES
from tests.test_envs import Buffers
from tests.test_memory import local_segments

torch.set_num_threads(1)

SPREAD = EnvConfig(id="pettingzoo:mpe2.simple_spread_v3")
TICTACTOE = EnvConfig(id="pettingzoo:pettingzoo.classic.tictactoe_v3")
LEAVING = EnvConfig(id="pettingzoo:tests.pettingzoo_for_tests")
PASS_MASK = np.eye(9, dtype=np.int8)[0]


def test_parallel_env_columns_follow_each_agent_with_its_seed_returns_and_final_observation():
    """2 simple_spread envs x 3 agents = 6 columns, against two PettingZoo envs stepped by hand
    with the same seeds and actions, through an episode end (25 steps) and the auto-reset."""
    from mpe2 import simple_spread_v3

    group = make_env_group(SPREAD, 6, 7)
    refs = [simple_spread_v3.parallel_env() for _ in range(2)]
    agents = refs[0].possible_agents
    buf = Buffers(group)
    group.reset(buf.obs)
    ref_obs = [refs[0].reset(seed=7)[0], refs[1].reset(seed=10)[0]]  # env k: the seed + its first column
    rng = np.random.default_rng(0)
    returns = np.zeros(6)
    for t in range(30):
        for k in range(2):
            for j, a in enumerate(agents):
                np.testing.assert_array_equal(buf.obs[3 * k + j], ref_obs[k][a])
        buf.actions[:] = rng.integers(0, 5, 6)
        ended = buf.step(group)
        assert not group.padding.any()
        for k, ref in enumerate(refs):
            obs, rew, term, trunc, _ = ref.step({a: int(buf.actions[3 * k + j]) for j, a in enumerate(agents)})
            for j, a in enumerate(agents):
                i = 3 * k + j
                assert buf.reward[i] == np.float32(rew[a]) and buf.truncated[i] == trunc[a] and not buf.terminated[i]
                returns[i] += rew[a]
            if t == 24:  # max_cycles: every agent's episode ends together
                for j, a in enumerate(agents):
                    np.testing.assert_array_equal(buf.final_obs[3 * k + j], obs[a])
                obs, _ = ref.reset()
            ref_obs[k] = obs
        if t == 24:
            assert sorted(ended) == [(i, pytest.approx(returns[i]), 25) for i in range(6)]
            returns[:] = 0
        else:
            assert ended == []
    other = make_env_group(SPREAD, 6, 8)
    b2 = Buffers(other)
    other.reset(b2.obs)
    assert not np.array_equal(b2.obs[0], ref_obs[0]["agent_0"])  # another seed, another start
    for g in (group, other):
        g.close()


def test_agents_that_leave_are_padding_until_their_env_resets():
    """Agent 0 leaves after 2 steps, agent 1 after 5: column 0 is padding (truncated, reward 0,
    final observation = observation) for steps 3-5, then both start the next episode."""
    group = make_env_group(LEAVING, 4, 3)
    buf = Buffers(group)
    group.reset(buf.obs)
    buf.actions[:] = 1
    for t in range(1, 7):
        ended = buf.step(group)
        pad = 2 < t <= LIFETIMES[1]
        assert group.padding.tolist() == [pad, False, pad, False]
        if pad:
            assert buf.truncated[0] and not buf.terminated[0] and buf.reward[0] == 0
            np.testing.assert_array_equal(buf.final_obs[0], [2, 0, 3])  # taken in its last observation
            if t < LIFETIMES[1]:
                np.testing.assert_array_equal(buf.obs[0], [2, 0, 3])
        else:
            assert buf.reward[0] == 1
        assert buf.reward[1] == 11
        if t == LIFETIMES[0]:
            assert buf.terminated.tolist() == [True, False, True, False]
            assert sorted(ended) == [(0, 2.0, 2), (2, 2.0, 2)]
            np.testing.assert_array_equal(buf.final_obs[0], [2, 0, 3])
        if t == LIFETIMES[1]:
            assert buf.terminated.tolist() == [False, True, False, True]
            assert sorted(ended) == [(1, 55.0, 5), (3, 55.0, 5)]
            np.testing.assert_array_equal(buf.final_obs[3], [5, 1, 5])  # env 1's seed: 3 + its first column
            np.testing.assert_array_equal(buf.obs[:2], [[0, 0, 3], [0, 1, 3]])  # the next episode
    group.close()


def test_turn_based_game_the_waiting_seat_passes_and_gets_the_other_seats_reply():
    """Tic-tac-toe, 3 boards x 2 seats, random legal moves for the seat to move and arbitrary
    actions for the waiting one (which the env never sees: no game ends on an illegal move,
    which would take fewer than 5 moves)."""
    group = make_env_group(replace(TICTACTOE, agent_id=True), 6, 0)
    buf = Buffers(group)
    group.reset(buf.obs)
    rng = np.random.default_rng(1)
    mover = np.zeros(3, int)  # seat to move on each board
    games = []
    for _ in range(200):
        masks = buf.obs.action_mask.reshape(3, 2, 9)
        np.testing.assert_array_equal(buf.obs.agent_id, np.tile(np.eye(2, dtype=np.float32), (3, 1)))
        for k in range(3):
            np.testing.assert_array_equal(masks[k, 1 - mover[k]], PASS_MASK)
            assert masks[k, mover[k]].sum() >= 1
        buf.actions[:] = rng.integers(0, 9, 6)
        for k in range(3):
            buf.actions[2 * k + mover[k]] = rng.choice(np.flatnonzero(masks[k, mover[k]]))
        ended = buf.step(group)
        assert not group.padding.any()
        by_board = {}
        for i, ret, length in ended:
            by_board.setdefault(i // 2, {})[i % 2] = (ret, length)
        for k in range(3):
            if k in by_board:
                (r0, n0), (r1, n1) = by_board[k][0], by_board[k][1]
                assert r0 + r1 == 0 and r0 in (-1, 0, 1) and n0 - n1 == 1 - (r1 == 1) and n0 + n1 >= 5
                assert buf.reward[2 * k] == r0 and buf.reward[2 * k + 1] == r1  # the loser's -1 on its wait
                assert buf.terminated[2 * k] and buf.terminated[2 * k + 1]
                games.append(n0 + n1)
                mover[k] = 0
            else:
                assert buf.reward[2 * k: 2 * k + 2].tolist() == [0, 0] and not buf.terminated[2 * k: 2 * k + 2].any()
                mover[k] = 1 - mover[k]
    assert len(games) >= 20
    group.close()


def test_the_sampler_marks_padding_failed_and_no_ppo_batch_trains_on_it():
    T, B = 8, 4
    exp = loading.load(CONFIGS / "cartpole_ppo.toml", [f"env.id='{LEAVING.id}'", "sampler.count=1",
                                                       f"sampler.envs={B}", f"sampler.horizon={T}", "sampler.ring=2",
                                                       "sampler.inference='local'"])
    agent, (seg, _) = local_segments(exp, 2, "pztest")
    pad = torch.tensor([2 <= t % 5 < 5 for t in range(T)])  # agent 0 gone from its 3rd step to its env's reset
    assert torch.equal(seg.samples.failed[:, 0], pad) and torch.equal(seg.samples.failed[:, 2], pad)
    assert not seg.samples.failed[:, 1::2].any()
    ends = [t for t in range(T) if seg.samples.terminated[t, 0]], [t for t in range(T) if seg.samples.terminated[t, 1]]
    assert ends == ([1, 6], [4])  # agent 0's 2nd and 7th steps, agent 1's 5th
    targets = pg_targets(agent, seg, exp.algo)
    assert len(targets.returns) == T * B - int(pad.sum()) * 2
    assert (targets.observation[:, 1] == 0).sum() == T * 2 - int(pad.sum()) * 2  # agent 0's real steps only


@pytest.mark.parametrize("overrides, mentions", [
    (["env.id='pettingzoo:pettingzoo.classic.tictactoe_v9'"], "cannot import module"),
    (["env.id='pettingzoo:json'"], "neither parallel_env() nor env()"),
    (["sampler.envs=15"], "multiple of 2"),
    (["sampler.inference='server'", "sampler.alternating=true", "sampler.envs=6"], "multiple of 4"),
    (["env.id='CartPole-v1'", "env.agent_id=true", "model.action_mask=''"], "env.agent_id"),
    (["env.max_episode_steps=9"], "env.max_episode_steps"),
])
def test_a_wrong_pettingzoo_setting_is_one_config_error_line(overrides, mentions):
    with pytest.raises(ConfigError) as e:
        loading.load(CONFIGS / "tictactoe_ppo.toml", overrides)
    assert mentions in str(e.value) and "\n" not in str(e.value), e.value


# ------------------------------------------------------------------ learning


def against_random(exp, agent, seat: int, games: int = 300, seed: int = 1000) -> tuple[float, float]:
    """(win rate, loss rate) of ``agent``'s greedy moves in tic-tac-toe seat ``seat`` (0 moves
    first) against uniformly random legal moves, over ``games`` games on 50 boards."""
    group = make_env_group(exp.env, 100, seed)
    buf = Buffers(group)
    first = np.ones(100, bool)
    rng = np.random.default_rng(seed)
    theirs = np.arange(100) % 2 != seat
    results: list[float] = []
    group.reset(buf.obs)
    while len(results) < games:
        with torch.inference_mode():
            action, _ = agent.step(torchify(buf.obs), replace(EVALUATE, first=first, reward=buf.reward))
        buf.actions[:] = numpify(action)
        buf.actions[theirs] = [rng.choice(np.flatnonzero(m)) for m in buf.obs.action_mask[theirs]]
        results += [ret for i, ret, _ in buf.step(group) if i % 2 == seat]
        np.logical_or(buf.terminated, buf.truncated, out=first)
    group.close()
    r = np.array(results)
    return float((r > 0).mean()), float((r < 0).mean())


def assert_beats_random(exp, run_dir: Path, first_win: float = 0.75, first_loss: float = 0.15,
                        second_win: float = 0.4) -> None:
    """Wins far more often than a random player would in either seat: random against random wins
    58% as first player (loses 29%) and 29% as second (loses 58%); over 300 games a rate's
    standard error is under 3 points, so 40% as second player is 4 of them above chance. The
    second seat is the harder one to learn in a short asynchronous run, hence no bar on its losses."""
    agent, _ = load_agent(exp, run_dir)
    first, second = against_random(exp, agent, 0), against_random(exp, agent, 1)
    assert first[0] >= first_win and first[1] <= first_loss and second[0] >= second_win, (first, second)


@pytest.mark.learning
@pytest.mark.parametrize("config", ["tictactoe_ppo.toml", "tictactoe_dqn.toml"])
def test_self_play_with_a_shared_policy_beats_a_random_player_in_serial_mode(tmp_path, config):
    exp = loading.load(CONFIGS / config, [f"run.runs_dir='{tmp_path}'"])
    result = api.train_serial(exp, out=io.StringIO())
    assert result["reason"] == "budget" and result["mean_return"] == 0  # zero-sum: both seats' returns
    assert_beats_random(exp, Path(result["run_dir"]))


@pytest.mark.learning
@pytest.mark.parametrize("config, inference, steps", [("tictactoe_ppo.toml", "local", None),
                                                      ("tictactoe_dqn.toml", "server", 80_000)])
def test_self_play_beats_a_random_player_through_the_pipeline(runs, config, inference, steps):
    """PPO with a local-inference sampler (numpy acting), DQN with an action-server (torch).
    DQN at 80k env steps, not its config's 50k: at 50k one CI run's policy won 66% as first player
    (6 runs here, two at a time: 82-94%); at 80k 6 runs won 82-95% (docs/benchmarks.md)."""
    run = runs(config, f"sampler.inference={inference}", *([f"run.max_env_steps={steps}"] if steps else []))
    result = run.wait_result(120)
    assert result["reason"] == "budget", result
    # An asynchronous run's policy differs from run to run (the serial checks hold the tight bar):
    # still above chance in both seats by 3 standard errors or more (random: 58% and 29% wins,
    # 29% losses as first player). A DQN run through the action-server lost 19% as first player.
    assert_beats_random(loading.load(CONFIGS / config), run.dir, first_win=0.68, first_loss=0.22,
                        second_win=0.36)
