"""Self-play against a pool of past versions (``[selfplay]``, shared/transport/pool.py,
services/sampler/opponent.py): a config that cannot have one is one config-error line; the pool's
files round-trip into an agent and refuse what does not fit; draws and Elo follow the scores; the
learner seat learns to beat a random player in serial mode and through the pipeline (server
inference), where the pool holds and serves its past versions after a learner ``kill -9`` and
after ``launch --resume``."""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

pytest.importorskip("pettingzoo")
mpe2 = pytest.importorskip("mpe2")

from services.build import agent_info, env_probe, make_agent
from services.sampler.local import LocalActions
from services.sampler.opponent import Opponent, ServedWithOpponent
from services.sampler.sampler import Sampler
from services.serial import opponent
from shared.config.topology import topology
from shared.agents.actor import Actor
from services.sampler.opponent import opponent_columns
from shared.config import loading
from shared.config.schema import SCRIPTED, ConfigError
from shared.envs.players import PLAYERS
from shared.launch import api
from shared.transport.params import ModuleState, field_name
from shared.runtime.files import read_csv
from shared.transport.pool import PoolFiles, Scores, draw
from tests.pipeline import CONFIGS, metric_value, rlpipe, rlpipe_here, wait_for
from tests.test_memory import FixedParams
from tests.test_pettingzoo import assert_beats_random

torch.set_num_threads(1)
POOL = ["selfplay.pool='uniform'", "selfplay.snapshot_every=10"]


@pytest.mark.parametrize("overrides, mentions", [
    (["env.id='CartPole-v1'", "model.action_mask=''"], "is a single-agent env"),
    (["env.id='pettingzoo:mpe2.simple_spread_v3'", "sampler.envs=6", "model.action_mask=''"], "has 3 agents"),
    (["env.id='pettingzoo:tests.cooperative_game_for_tests'"], "is not zero-sum"),
    (["model.lstm_size=32"], "model.lstm_size = 32"),
    (["selfplay.pool='best'"], "allowed: latest, uniform, prioritised"),
    (["selfplay.size=0"], "selfplay.size = 0"),
    (["selfplay.pool=''", "selfplay.scripted={ heuristic = 0.5 }"], "set selfplay.pool too"),
    (["selfplay.scripted={ best = 0.5 }"], "'best' is unknown; give some of random, heuristic"),
    (["selfplay.scripted={ heuristic = 0 }"], "selfplay.scripted.heuristic = 0.0: a share of the games"),
    (["selfplay.second_seat_share=1.5"], "selfplay.second_seat_share = 1.5: a share of the boards, from 0 to 1"),
    (["selfplay.scripted={ heuristic = 0.75, random = 0.5 }"], "the shares add up to more than 1"),
    (["selfplay.scripted={ heuristic = 0.5 }", "selfplay.train_both_seats=true"], "train the learner's seat only"),
    (["env.id='pettingzoo:tests.uncopyable_game_for_tests'", "selfplay.scripted={ heuristic = 0.5 }"],
     "selfplay.scripted: game 'tictactoe_v3': the heuristic player cannot copy its state"),
])
def test_a_pool_where_there_can_be_none_is_one_config_error_line(overrides, mentions):
    with pytest.raises(ConfigError) as e:
        loading.load(CONFIGS / "tictactoe_ppo.toml", POOL + overrides)
    assert mentions in str(e.value) and "\n" not in str(e.value), e.value


def test_pool_files_round_trip_into_an_agent_and_refuse_what_does_not_fit(tmp_path):
    exp = loading.load(CONFIGS / "tictactoe_ppo.toml", POOL)
    a, b = (make_agent(exp, env_probe(exp)) for _ in range(2))
    with torch.no_grad():
        for p in a.parameters():
            p.add_(1.0)
    pool = PoolFiles(tmp_path, size=2)
    for version in (3, 7, 12):
        pool.add(version, {field_name(k): t.numpy() for k, t in a.state_dict().items()})
    assert pool.versions() == [7, 12] and sorted(os.listdir(tmp_path / "pool")) == ["v000000000007.npz",
                                                                                     "v000000000012.npz"]
    assert pool.load(12, ModuleState(b))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not pool.load(3, ModuleState(b))  # dropped from the pool
    other = make_agent(loading.load(CONFIGS / "tictactoe_ppo.toml", POOL + ["model.hidden_sizes=[8]"]), env_probe(exp))
    assert not pool.load(7, ModuleState(other))  # another agent's state: refused, not loaded
    (tmp_path / "pool" / "v000000000007.npz").write_bytes(b"not a zip")
    assert not pool.load(7, ModuleState(b))


def test_draws_follow_the_rule_and_elo_moves_towards_the_winner():
    scores = Scores()
    for v in (1, 2):
        scores.enter(v)
    for _ in range(20):
        scores.record(1, 1.0)  # the learner beats version 1...
        scores.record(2, -1.0)  # ...and loses to version 2
    assert scores.versions[1]["win"] == 20 and scores.versions[2]["loss"] == 20
    assert scores.versions[2]["elo"] > 1000 > scores.versions[1]["elo"]
    assert scores.record(9, 1.0) is None  # a version the pool does not hold counts nowhere
    rng = np.random.default_rng(0)
    assert draw("latest", [1, 2], {}, rng) == 2
    assert {draw("uniform", [1, 2], {}, rng) for _ in range(50)} == {1, 2}
    drawn = [draw("prioritised", [1, 2], scores.state(), rng) for _ in range(2000)]
    assert drawn.count(2) > 0.95 * len(drawn) > drawn.count(1) > 0  # weights (21/22)^2 : (1/22)^2


def test_opponent_columns_give_the_learner_first_seat_on_even_boards():
    assert opponent_columns(0, 8).tolist() == [False, True, True, False] * 2
    assert opponent_columns(8, 4).tolist() == [False, True, True, False]


@pytest.mark.parametrize("share, second", [(0.75, 24), (0.625, 20), (1.0, 32), (0.0, 0)])
def test_opponent_columns_give_the_learner_the_second_seat_on_its_share_of_the_boards(share, second):
    """32 boards over two samplers of 32 columns: one opponent column a board, the learner second
    (the opponent in the board's first column) on ``share`` of them, spread evenly."""
    mask = np.concatenate([opponent_columns(base, 32, share) for base in (0, 32)]).reshape(32, 2)
    assert (mask.sum(1) == 1).all()
    assert mask[:, 0].sum() == second
    assert abs(mask[:16, 0].sum() - second / 2) <= 1  # each sampler's half of the boards has its share


class Announced:
    def __init__(self):
        self.metas = []

    def announce(self, index: int, meta: dict) -> None:
        self.metas.append(meta)

    def acquire(self, index: int) -> None:
        pass


@pytest.mark.parametrize("both, inference", [(False, "local"), (True, "local"), (False, "server")])
def test_the_opponent_plays_the_pool_version_its_columns_train_nothing_and_games_name_it(tmp_path, both, inference):
    """A sampler of 4 boards: the pool's only version (5) always takes the centre where it may, the
    current policy is a fresh one. The opponent's columns play version 5's moves and are failed
    steps (no loss trains on them) unless train_both_seats; the learner seat's episodes alone are
    reported, each naming version 5. With server inference (two env groups of 2 boards) the
    current policy's actions come from another source (an action-server's stand-in) and the
    opponent overwrites its columns once they are in."""
    exp = loading.load(CONFIGS / "tictactoe_ppo.toml", POOL + ["sampler.envs=8", "sampler.horizon=16", "sampler.ring=2",
                                                               f"selfplay.train_both_seats={str(both).lower()}",
                                                               f"sampler.inference='{inference}'"])
    probe = env_probe(exp)
    current, centre, holder = (make_agent(exp, probe) for _ in range(3))
    probe.close()
    with torch.no_grad():
        centre.twin.weights[2][0].zero_()  # member 0 is the policy's head
        centre.twin.biases[2][0, 0].copy_(torch.eye(9)[4] * 50.0)
    files = PoolFiles(tmp_path, 8)
    files.add(5, {field_name(k): t.numpy() for k, t in centre.state_dict().items()})
    topo = topology(exp)
    sampler = Sampler(exp.sampler, exp.env, topo, 0, agent_info(exp), "pooltest", shared_memory=False)
    mask = opponent_columns(sampler.env_base, exp.sampler.envs)
    opponent = Opponent(exp.selfplay, files, lambda: (Actor(holder, np.random.SeedSequence(1)), ModuleState(holder)),
                        mask, exp.sampler.horizon, np.random.SeedSequence(2))
    sampler.opponent = opponent
    act = Actor(current, topo.acting_seed("sampler", 0))
    if inference == "local":
        actions = LocalActions(act, sampler, FixedParams(), topo.total_envs, opponent)
    else:
        assert len(sampler.groups) == 2
        served = LocalActions(act, sampler, FixedParams(), topo.total_envs)
        actions = ServedWithOpponent(served, opponent, sampler, FixedParams(), topo.total_envs)
    sink = Announced()
    sampler.start(actions)
    for _ in range(3):
        sampler.collect_segment(actions, sink)
    samples = sampler.ring[0].samples
    sampler.close()
    assert opponent.loaded == [5]
    assert (not samples.failed.any()) if both else (samples.failed[:, mask].all() and not samples.failed[:, ~mask].any())
    legal = samples.observation.action_mask
    moving = legal.sum(-1) > 1  # not a pass
    centre_free = moving & (legal[..., 4] == 1)
    assert (samples.action[:, mask][centre_free[:, mask]] == 4).all() and centre_free[:, mask].sum() >= 4
    assert (samples.action[:, ~mask][centre_free[:, ~mask]] != 4).any()  # the current policy plays elsewhere too
    episodes = [e for meta in sink.metas for e in meta["episodes"]]
    assert episodes and all(len(e) == 3 and e[2] == 5 for e in episodes)


LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]


def open_cells(board: np.ndarray, me: int) -> set[int]:
    """Tic-tac-toe cells that complete a line of plane ``me`` of ``board`` [3, 3, 2] (cell a is
    board[a // 3, a % 3])."""
    cells = board.reshape(9, 2)
    return {a for line in LINES if cells[list(line), me].sum() == 2 and not cells[list(line), 1 - me].any()
            for a in line if not cells[a, me]}


def test_the_configs_scripted_names_are_the_players_that_exist():
    """schema.SCRIPTED (what the config layer accepts, without importing PettingZoo) names exactly
    the players of shared.envs.players, which the samplers look the names up in."""
    assert set(SCRIPTED) == set(PLAYERS)


def test_scripted_players_hold_their_share_of_the_games_and_play_their_moves(tmp_path):
    """A uniform pool holding version 5 (valuing every position at 5) and the heuristic player for
    half the games. The opponent columns' values tell the pool's games from the heuristic's: about
    half are the heuristic's, reported without a version (the pool's name version 5); in them the
    opponent takes every win the board offers and blocks every single threat, as the heuristic
    does and the pool's untrained version does not."""
    exp = loading.load(CONFIGS / "tictactoe_ppo.toml", POOL + ["sampler.envs=8", "sampler.horizon=16", "sampler.ring=12",
                                                               "selfplay.scripted={ heuristic = 0.5 }"])
    probe = env_probe(exp)
    current, past = make_agent(exp, probe), make_agent(exp, probe)
    probe.close()
    value_at(5)(past)
    files = PoolFiles(tmp_path, 8)
    files.add(5, {field_name(k): t.numpy() for k, t in past.state_dict().items()})
    topo = topology(exp)
    sampler = Sampler(exp.sampler, exp.env, topo, 0, agent_info(exp), "pooltest", shared_memory=False)
    sampler.opponent = opponent(exp, tmp_path, sampler, make_agent(exp, env_probe(exp)))
    actions = LocalActions(Actor(current, topo.acting_seed("sampler", 0)), sampler, FixedParams(), topo.total_envs,
                           sampler.opponent)
    sink = Announced()
    sampler.start(actions)
    for _ in range(exp.sampler.ring):
        sampler.collect_segment(actions, sink)
    samples = sampler.ring.samples
    episodes = [e for meta in sink.metas for e in meta["episodes"]] + sampler.pending[3]
    sampler.close()
    B, mask = exp.sampler.envs, sampler.opponent.mask
    scripted = (samples.agent_info.value.reshape(-1, B)[:, mask] != 5.0)  # [steps, boards]
    board = samples.observation.observation.reshape(-1, B, 3, 3, 2)[:, mask]
    legal = samples.observation.action_mask.reshape(-1, B, 9)[:, mask]
    action = samples.action.reshape(-1, B)[:, mask]
    counts = collections.Counter()
    for t, j in np.ndindex(*action.shape):
        if not np.array_equal(legal[t, j], board[t, j].sum(-1).reshape(9) == 0):
            continue  # a pass: its one legal action is no free cell
        wins, threats = open_cells(board[t, j], 0), open_cells(board[t, j], 1)
        if wins:
            counts["scripted" if scripted[t, j] else "pool", "win", int(action[t, j]) in wins] += 1
        elif len(threats) == 1:
            counts["scripted" if scripted[t, j] else "pool", "block", int(action[t, j]) in threats] += 1
    assert counts["scripted", "win", True] >= 5 and counts["scripted", "win", False] == 0, counts
    assert counts["scripted", "block", True] >= 5 and counts["scripted", "block", False] == 0, counts
    assert counts["pool", "win", False] + counts["pool", "block", False] > 0, counts
    versions = collections.Counter(e[2] if len(e) == 3 else None for e in episodes)
    assert set(versions) == {5, None} and len(episodes) >= 60, versions
    assert 0.3 <= versions[None] / len(episodes) <= 0.7, versions


def value_at(version: int):
    """Make an agent value every position at ``version`` (tictactoe_ppo's twin MLP, whose member 1
    is the value head; connect_four_pool_ppo's value head)."""
    def set_value(agent) -> None:
        with torch.no_grad():
            weight, bias = (agent.twin.weights[2][1], agent.twin.biases[2][1]) if agent.twin is not None else \
                (agent.v_head.net[0].weight, agent.v_head.net[0].bias)
            weight.zero_()
            bias.fill_(float(version))
    return set_value


@pytest.mark.parametrize("config, overrides", [
    ("tictactoe_ppo.toml", ["sampler.envs=8", "sampler.horizon=4", "sampler.ring=12"]),  # copies act in numpy
    ("connect_four_pool_ppo.toml", ["sampler.envs=16", "sampler.horizon=4", "sampler.ring=16"]),  # stacked, in torch
])
def test_a_board_keeps_the_version_it_drew_until_its_game_ends_and_its_games_score_that_version(tmp_path, config,
                                                                                                overrides):
    """Versions 3, 5 and 7 in a uniform pool, each valuing every position at its own number, so
    the opponent columns' values name the version that acted. Segments of 4 steps, shorter than a
    game: each game's opponent moves are one version's, several versions play, the games the
    learner seat reports name the versions their boards played, and they score once each. So too
    where the copies act in one stacked pass (Connect Four's CNN acts in torch)."""
    exp = loading.load(CONFIGS / config, POOL + overrides)
    probe = env_probe(exp)
    current, past = make_agent(exp, probe), make_agent(exp, probe)
    probe.close()
    files = PoolFiles(tmp_path, 8)
    for version in (3, 5, 7):
        value_at(version)(past)
        files.add(version, {field_name(k): t.numpy() for k, t in past.state_dict().items()})
    topo = topology(exp)
    sampler = Sampler(exp.sampler, exp.env, topo, 0, agent_info(exp), "pooltest", shared_memory=False)
    serial_opponent = opponent(exp, tmp_path, sampler, make_agent(exp, env_probe(exp)))
    sampler.opponent = serial_opponent
    actions = LocalActions(Actor(current, topo.acting_seed("sampler", 0)), sampler, FixedParams(), topo.total_envs,
                           serial_opponent)
    sink = Announced()
    sampler.start(actions)
    for _ in range(exp.sampler.ring):
        sampler.collect_segment(actions, sink)
    samples = sampler.ring.samples  # [ring, T, B]: the segments in order
    episodes = [e for meta in sink.metas for e in meta["episodes"]] + sampler.pending[3]  # the last one's too
    sampler.close()
    stacked = serial_opponent.stacked
    assert (stacked is not None and stacked.key is not None) == config.startswith("connect_four")
    B, mask = exp.sampler.envs, serial_opponent.mask
    value = samples.agent_info.value.reshape(-1, B)[:, mask]
    ended = (samples.terminated | samples.truncated).reshape(-1, B)[:, mask]
    played = []  # the version of each game that ended, by board
    for board in range(B // 2):
        game = []
        for v, end in zip(value[:, board], ended[:, board]):
            game.append(v)
            if end:
                assert len(set(game)) == 1, f"board {board}: one game against versions {sorted(set(game))}"
                played.append(int(game[0]))
                game = []
    assert set(played) == {3, 5, 7} and len(played) >= 12
    reported = [e[2] for e in episodes]
    assert sorted(reported) == sorted(played)  # each board's learner seat ends its games with the opponent's
    scores = Scores()
    for v in (3, 5, 7):
        scores.enter(v)
    for ret, _, version in episodes:
        scores.record(version, ret)
    assert {v: sum(s[o] for o in ("win", "draw", "loss")) for v, s in scores.versions.items()} == \
        {v: reported.count(v) for v in (3, 5, 7)}


# ------------------------------------------------------------------ server inference, real sockets


def fixed_move(agent, cell: int, value: float) -> None:
    """Make ``agent`` (tictactoe_ppo's) play ``cell`` wherever it is legal and value every position at ``value``."""
    with torch.no_grad():
        agent.twin.weights[2].zero_()  # member 0 is the policy's head, member 1 the value's
        agent.twin.biases[2][0, 0].copy_(torch.eye(9)[cell] * 50.0)
        agent.twin.biases[2][1].fill_(value)


@contextlib.contextmanager
def served_sampler(tmp_path, run_id: str, env_steps: int, slow_forwards_s=()):
    """Sampler 0 of a run (4 envs, one group, server inference, the pool holding version 5, which
    takes the centre and values every position at 5) wired by ``served_actions`` as the sampler
    process wires it, to a real ``ActionServer`` in a thread (its ROUTER socket, the doorbell, the
    sampler's step slot in shared memory) whose policy takes the corner (cell 0) and values every
    position at -5; the learner's parameter segment holds version 3 at ``env_steps`` and its PUB
    socket announces nothing. The action-server's forward passes take ``slow_forwards_s`` more
    seconds each, in order. Yields (actions, sampler, served): ``served`` gets a True each time the
    action-server has answered a batch (written the slot and replied)."""
    from services.action_server.server import ActionServer
    from services.build import example_step
    from services.learner.transport import PublishedParams
    from services.sampler.__main__ import served_actions
    from shared.agents.acting import write_acting_file
    from shared.agents.actor import acting_plan
    from shared.config.endpoints import endpoint, socket_dir
    from shared.data.layout import slot_spec
    from shared.data.namedarraytuple import drop_leading_dims
    from shared.launch.rundirs import make_private_dir
    from shared.runtime import metrics
    from shared.transport import shm, wire
    from shared.transport.auth import read_secret, write_secret
    from shared.transport.params import ParamWriter
    from shared.transport.sockets import Endpoint

    exp = loading.load(CONFIGS / "tictactoe_ppo.toml", POOL + ["sampler.envs=4", "sampler.alternating=false",
                                                               "sampler.inference='server'", "sampler.timeout_ms=100"])
    run_dir = tmp_path / run_id
    run_dir.mkdir()
    write_secret(run_dir)
    make_private_dir(socket_dir(run_dir))
    probe = env_probe(exp)
    learner, centre, corner = (make_agent(exp, probe) for _ in range(3))
    fixed_move(centre, 4, 5.0)
    fixed_move(corner, 0, -5.0)
    PoolFiles(run_dir, exp.selfplay.size).add(5, {field_name(k): t.numpy() for k, t in centre.state_dict().items()})
    ctx = zmq.Context()
    params = PublishedParams(ctx, endpoint(exp, run_dir, "params"),
                             ParamWriter(learner, shm.segment_name(run_id, "learner", 0, "params")))
    params.writer.write(3, env_steps)  # the learner's state before the sampler (re)started: no announcement since
    write_acting_file(run_dir, params.writer.descriptor["spec"], acting_plan(learner))
    topo = topology(exp)
    router = Endpoint(ctx, zmq.ROUTER, endpoint(exp, run_dir, "action_server0"), bind=True, name="action_server0")
    sub = Endpoint(ctx, zmq.SUB, endpoint(exp, run_dir, "params"), bind=False, name="action_server0",
                   subscribe=wire.topic("params"))
    server = ActionServer(exp.action_server, corner, router, sub, metrics.for_service("action_server", 7),
                          socket_dir(run_dir), run_id, read_secret(run_dir),
                          drop_leading_dims(slot_spec(example_step(exp, probe), 1), 1), exp.sampler.envs,
                          topo.total_envs, np.random.SeedSequence(3))
    probe.close()
    forward, delays = server.act, list(slow_forwards_s)

    def slow_forward(*args):
        time.sleep(delays.pop(0) if delays else 0.0)
        return forward(*args)

    server.act = slow_forward
    serve_batch, served = server.serve_batch, []
    server.serve_batch = lambda: served.append(serve_batch() or True)
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(stop.is_set,), daemon=True)
    thread.start()
    sampler = Sampler(exp.sampler, exp.env, topo, 0, agent_info(exp), run_id,
                      metrics=metrics.for_service("sampler", 7))
    actions = None
    try:
        actions = served_actions(exp, topo, sampler, run_dir, ctx, time.time_ns(), read_secret(run_dir))
        yield actions, sampler, served
    finally:
        if actions is not None:
            actions.close()
        stop.set()
        thread.join(5)
        server.close()
        router.close()
        sampler.close()
        params.close()
        ctx.destroy(linger=0)
        shutil.rmtree(socket_dir(run_dir), ignore_errors=True)


def test_a_late_action_server_reply_never_lands_over_the_opponents_moves(tmp_path, run_id):
    """The action-server's first forward pass outlasts the sampler's timeout_ms: the sampler says
    hello again and rings again while the action-server, slow and not dead, still writes its
    actions for the first ring into the step slot and replies. Whatever the order, the slot the
    sampler steps its envs with holds the pool version's moves and agent info in the opponent's
    columns, and keeps them: no write of the current policy lands after the opponent's."""
    with served_sampler(tmp_path, run_id, 0, slow_forwards_s=(0.4, 0.05)) as (actions, sampler, served):
        slot = sampler.slots[0]
        sampler.start(actions)  # resets the boards and rings
        actions.wait(0)
        # Both rings answered (the first, given up on, and the one made again), however slow the
        # machine: a write of the action-server's that would land after the opponent's has landed.
        wait_for(lambda: len(served) >= 2, 60, "the action-server to answer the ring given up on and the new one")
        mask = opponent_columns(sampler.env_base, 4)
        legal = slot.observation.action_mask
        to_move = mask & (legal.sum(-1) > 1) & (legal[:, 4] == 1)  # the opponent moves first on board 1
        assert to_move.any()
        assert (slot.action[to_move] == 4).all(), slot.action  # the pool version's centre, not the corner
        assert (slot.agent_info.value[mask] == 5.0).all(), slot.agent_info.value
        assert (slot.action[~mask & (legal.sum(-1) > 1)] == 0).all()  # the learner seat's: the action-server's


def test_a_restarted_server_inference_sampler_starts_its_opponent_at_the_runs_env_steps(tmp_path, run_id):
    """A sampler (re)started into a run at 123456 env steps, with no announcement from the learner
    since: its opponent copies act at the run's env steps (a Q agent's epsilon), not at 0."""
    with served_sampler(tmp_path, run_id, 123_456) as (actions, sampler, _):
        assert actions.steps.env_steps == 123_456
        sampler.start(actions)
        actions.wait(0)
        assert actions.steps.env_steps == 123_456


def test_a_server_inference_sampler_on_another_node_than_the_learner_starts_at_its_first_announcement(run_id,
                                                                                                      tmp_path):
    """Where the learner's parameter segment is on another node, the sampler waits for the
    learner's next announcement (it re-announces every REANNOUNCE_MS while it waits for batches)
    and starts its opponent at those env steps."""
    from services.sampler.__main__ import announced_steps
    from tests.test_params import announcing, make_net

    exp = loading.load(CONFIGS / "tictactoe_ppo.toml", POOL + ["sampler.inference='server'", "network.transport='tcp'",
                                                               "placement.sampler='b'", "placement.action_server='b'"])
    assert exp.placement.crosses("sampler", "learner")
    ctx, writer, pub, sub = announcing(make_net(0), run_id, tmp_path)
    stop = threading.Event()

    def learner():
        while not stop.wait(0.05):
            pub.publish(4, 77_000)

    thread = threading.Thread(target=learner)
    thread.start()
    try:
        steps = announced_steps(exp, tmp_path, sub, None)  # no acting.json needed: nothing of the segment is read
        assert steps.env_steps == 77_000
    finally:
        stop.set()
        thread.join(5)
        sub.close()
        pub.ep.close()
        writer.close()
        ctx.destroy(linger=0)


def test_progress_rows_name_the_pools_best_version_and_its_elo():
    from services.learner.progress import Progress

    scores = Scores()
    progress = Progress(10, None, scores=scores)
    assert np.isnan(progress.pool_columns()["pool_best_elo"])  # no version yet
    for v in (1, 2):
        scores.enter(v)
    progress.record_batch({"env_steps": 9, "episodes": [[1.0, 5, 1], [-1.0, 5, 2], [-1.0, 6, 2]]})
    row = progress.pool_columns()
    assert row["pool_best_version"] == 2 and row["pool_best_elo"] == round(scores.versions[2]["elo"], 1) > 1000
    assert row["pool_win"] == 0.333


def pool_learner(exp, run_dir: Path, m):
    from services.build import make_algo
    from services.learner.learner import Learner

    probe = env_probe(exp)
    agent = make_agent(exp, probe)
    probe.close()
    return Learner(exp, agent, make_algo(exp, agent), torch.device("cpu"), run_dir, m)


def test_each_pool_versions_elo_goes_to_pool_elo_csv_tensorboard_and_a_gauge_that_drops_a_version_gone(
        tmp_path, monkeypatch):
    """A learner with a pool of 2 (versions 0 and 5), games against both, a progress row; version 9
    pushes version 0 out, a row; a learner resumed from the checkpoint, a row. pool_elo.csv has a
    row per version the pool held at each progress row, under one header; TensorBoard a scalar per
    version; the Prometheus gauge the versions the pool holds, version 0's series gone with it; the
    row on the terminal the learner's Elo and the best version's."""
    from prometheus_client import REGISTRY

    from services.learner.progress import Progress
    from shared.launch import follow, rundirs
    from shared.runtime import metrics

    def gauge() -> dict[str, float]:
        return {s.labels["version"]: s.value for family in REGISTRY.collect()
                if family.name == "rlpipe_learner_pool_version_elo" for s in family.samples
                if s.labels["instance"] == "91"}

    tensorboard = []
    monkeypatch.setattr(Progress, "_tensorboard", lambda self, scalars: tensorboard.append(scalars))
    exp = loading.load(CONFIGS / "tictactoe_ppo.toml", POOL + ["selfplay.size=2"])
    m = metrics.for_service("learner", 91)  # an instance of this test's own in the process's registry
    learner = pool_learner(exp, tmp_path, m)
    learner.pool.start(0)
    learner.pool.add(5)
    # [return, length, opponent version] of the learner seat's games: it beats 0, loses to 5 and draws
    learner.progress.record_batch({"env_steps": 9, "episodes": [[1.0, 5, 0], [-1.0, 6, 5], [0.0, 9, 5]]})
    learner.maybe_report(force=True)
    first = dict(learner.pool.scores.versions)
    assert gauge() == {"0": round(first[0]["elo"], 1), "5": round(first[5]["elo"], 1)}
    assert first[5]["elo"] > 1000 > first[0]["elo"]
    learner.pool.add(9)
    learner.progress.record_batch({"env_steps": 9, "episodes": [[1.0, 5, 9]]})
    learner.maybe_report(force=True)
    assert set(gauge()) == {"5", "9"}  # version 0 left the pool, and the endpoint
    learner.maybe_checkpoint(force=True)
    resumed = pool_learner(exp, tmp_path, m)
    assert resumed.resume()
    resumed.maybe_report(force=True)

    rows = [(r["env_steps"], r["version"], r["games"], r["score"]) for r in read_csv(tmp_path / "pool_elo.csv")]
    assert rows == [("9", "0", "1", "0.0"), ("9", "5", "2", "0.75"),
                    ("18", "5", "2", "0.75"), ("18", "9", "1", "0.0"),
                    ("18", "5", "2", "0.75"), ("18", "9", "1", "0.0")]
    assert (tmp_path / "pool_elo.csv").read_text().count("version") == 1  # the resumed learner added no header
    assert read_csv(tmp_path / "pool_elo.csv")[1]["elo"] == str(round(first[5]["elo"], 1))
    assert [sorted(tag for tag in scalars if tag.startswith("pool/elo/")) for scalars in tensorboard] == [
        ["pool/elo/v0", "pool/elo/v5"], ["pool/elo/v5", "pool/elo/v9"], ["pool/elo/v5", "pool/elo/v9"]]
    row = rundirs.read_progress(tmp_path)[0]
    assert f"elo {float(row['pool_elo']):.0f} (best v5 {first[5]['elo']:.0f})" in follow.format_row(row)


# ------------------------------------------------------------------ learning


def pool_rows(run_dir: Path) -> list[dict]:
    from shared.launch import rundirs

    return [r for r in rundirs.read_progress(run_dir) if r.get("pool_win") not in (None, "", "nan")]


def scores_versions(run_dir: Path) -> list[int]:
    """The versions pool/scores.json has rated: the pool's now and, for a row written a moment
    earlier, those it held then."""
    return [int(v) for v in scores(run_dir)]


def scores(run_dir: Path) -> dict:
    return json.loads((run_dir / "pool" / "scores.json").read_text())["versions"]


@pytest.mark.learning
def test_the_learner_seat_beats_a_random_player_against_a_pool_in_serial_mode(tmp_path):
    exp = loading.load(CONFIGS / "tictactoe_ppo.toml", [f"run.runs_dir='{tmp_path}'", "run.max_env_steps=40000",
                                                        "selfplay.pool='prioritised'"])
    result = api.train_serial(exp, out=io.StringIO())
    assert result["reason"] == "budget", result
    run_dir = Path(result["run_dir"])
    held = PoolFiles(run_dir, 8).versions()
    assert held == list(range(0, 20 * len(held), 20)) and len(held) >= 3  # version 0, then one every 20 updates
    assert set(scores(run_dir)) == set(map(str, held))
    row = pool_rows(run_dir)[-1]
    assert sum(float(row[f"pool_{o}"]) for o in ("win", "draw", "loss")) == pytest.approx(1, abs=0.01), row
    assert float(row["pool_elo"]) > 1000  # it beat its past versions more often than it lost
    assert_beats_random(exp, run_dir)


@pytest.mark.learning
def test_pool_self_play_through_the_pipeline_survives_a_learner_kill_and_a_resume(runs):
    """Server inference (the action-server acts for the learner seat, the samplers' copies for the
    opponent's; local inference's pool runs through the pipeline in
    tests/test_prometheus_real.py, and in serial mode above), a snapshot every 10 updates,
    uniform draws over the last 8. The learner is
    killed with SIGKILL once the pool holds 3 versions: the restarted one finds them, and the
    samplers go on playing them (their games against versions of before the kill still count).
    Stopped, then resumed with ``launch --resume``: the pool is there, the run ends at its budget,
    and the learner seat beats a random player; pool_elo.csv has one header and at most the pool's
    8 versions at each progress row."""
    run = runs("tictactoe_ppo.toml", *POOL, "learner.checkpoint_interval_s=1.0", "sampler.inference=server")
    pool = PoolFiles(run.dir, 8)
    run.wait_for(lambda: len(pool.versions()) >= 3 and (run.dir / "checkpoints" / "latest.pt").exists()
                 and pool_rows(run.dir), 60, "3 pool versions, a checkpoint and a row of games against the pool")
    run.wait_for(lambda: "rlpipe_learner_pool_outcome_ratio" in run.metrics(), 10, "the pool outcome gauge")
    assert metric_value(run.metrics(), "rlpipe_learner_pool_outcome_ratio", outcome="win") > 0
    assert metric_value(run.metrics(), "rlpipe_learner_pool_best_version") in scores_versions(run.dir)
    before = pool.versions()
    played = scores(run.dir)
    learner_pid = run.pid("learner0")
    os.kill(learner_pid, signal.SIGKILL)
    run.wait_for(lambda: run.status().get("learner0", ("", None))[1] not in (None, learner_pid), 30,
                 "supervisord to restart the learner")
    run.wait_for(lambda: "self-play pool: " in run.logs("learner0") and "version(s) held" in run.logs("learner0"),
                 30, "the restarted learner to find the pool")

    def old_versions_played_again() -> bool:
        now = scores(run.dir)
        return any(str(v) in now and sum(now[str(v)][o] for o in ("win", "draw", "loss")) >
                   sum(played[str(v)][o] for o in ("win", "draw", "loss")) for v in before if str(v) in played)
    run.wait_for(old_versions_played_again, 60, "games against versions of before the kill")

    out = rlpipe("stop", str(run.dir))
    assert out.returncode == 0, out.stdout + out.stderr
    held = pool.versions()
    out = rlpipe_here("launch", "--resume", str(run.dir), "--detach")
    assert out.returncode == 0, out.stdout + out.stderr
    result = run.wait_result(120)
    assert result["reason"] == "budget", result
    assert run.logs("learner0").count("version(s) held") >= 2
    assert pool.versions()[-1] > held[-1]  # it went on adding versions after those it held
    assert (run.dir / "pool_elo.csv").read_text().count("version") == 1  # no header again after the restart or the resume
    elo_rows = read_csv(run.dir / "pool_elo.csv")
    at_row = collections.Counter((r["wall_s"], r["env_steps"]) for r in elo_rows)
    assert max(at_row.values()) <= 8 and len({r["version"] for r in elo_rows}) > 8, at_row
    # Against its own recent versions a learner that wins as first player wins about half its games.
    last = pool_rows(run.dir)[-1]
    assert sum(float(last[f"pool_{o}"]) for o in ("win", "draw", "loss")) == pytest.approx(1, abs=0.01), last
    assert_beats_random(loading.load(CONFIGS / "tictactoe_ppo.toml"), run.dir, first_win=0.68, first_loss=0.22,
                        second_win=0.36)
