"""Two-player turn-based games against fixed opponents: the scripted players
(shared/envs/players.py) on tic-tac-toe and connect four, `rlpipe evaluate RUN --opponent`
(services/evaluator/matches.py) and `rlpipe play RUN` through a pseudo-terminal
(shared/launch/artefacts/terminal_game.py), on a short serial PPO self-play run of tic-tac-toe; and the
evaluator service's rates against the opponents during a pipeline run (``eval.opponents``)."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pettingzoo = pytest.importorskip("pettingzoo")

from pettingzoo.classic import connect_four_v3, tictactoe_v3

from services.evaluator import matches
from shared.runtime import runfiles
from shared.config import loading
from shared.agents.config import ModelConfig
from shared.agents.models import make_encoder
from shared.envs.players import (NotCopyable, copy_game, copied_tactics, heuristic_move, legal_moves, random_move,
                                 tactics)
from shared.launch import api
from shared.launch.artefacts import terminal_game
from shared.launch.artefacts.terminal_game import board_text
from shared.runtime import evaluation
from shared.runtime.runfiles import RUN_CONFIG
from tests import uncopyable_game_for_tests
from tests.pipeline import CONFIGS, metric_value, rlpipe_command, rlpipe_here
from tests.test_evaluator_service import checkpointed_run, tensorboard_scalars, untrained_agent

torch.set_num_threads(1)

def position(module, moves: list[int]):
    """``module``'s game after ``moves`` (first player's, second's, ...)."""
    env = module.env()
    env.reset(seed=0)
    for a in moves:
        env.step(a)
    return env


# ------------------------------------------------------------------ the scripted players


@pytest.mark.parametrize("module, moves, expected", [
    # X holds squares 0 and 1 of the line 0-1-2 (O threatens 3-4-5 too): it wins at 2.
    (tictactoe_v3, [0, 3, 1, 4], 2),
    # X holds 0 and 8 (no line left to finish); O threatens 3-4-5: X blocks at 5.
    (tictactoe_v3, [0, 3, 8, 4], 5),
    # Connect four: the first player has columns 0-2 of the bottom row; it wins in column 3.
    (connect_four_v3, [0, 6, 1, 6, 2, 5], 3),
    # The second player has columns 0-2 of the bottom row; the first blocks in column 3.
    (connect_four_v3, [6, 0, 6, 1, 5, 2], 3),
])
def test_the_heuristic_wins_if_it_can_and_blocks_if_it_must(module, moves, expected):
    env = position(module, moves)
    before = {a: env.observe(a)["observation"].copy() for a in env.agents}
    assert {heuristic_move(env, np.random.default_rng(seed)) for seed in range(8)} == {expected}
    for a in env.agents:  # it looked ahead on copies only
        np.testing.assert_array_equal(env.observe(a)["observation"], before[a])
    env.close()


@pytest.mark.parametrize("module, moves, winning, safe, must_block", [
    (tictactoe_v3, [0, 3, 1, 4], [2], [], False),  # a win: the safe moves are not looked at
    (tictactoe_v3, [0, 3, 8, 4], [], [5], True),
    (tictactoe_v3, [0, 4], [], [1, 2, 3, 5, 6, 7, 8], False),  # nothing threatens: every move is safe
    (tictactoe_v3, [0, 3, 8, 4, 5, 1, 7], [], [], False),  # O threatens 6 and 2 at once: every move loses
    (connect_four_v3, [0, 6, 1, 6, 2, 5], [3], [], False),
    (connect_four_v3, [6, 0, 6, 1, 5, 2], [], [3], True),
    # The first player holds columns 0-2 of the second row from the bottom, column 3 is empty: the
    # second player's disc there would let it win above; every other column is safe.
    (connect_four_v3, [2, 0, 0, 1, 1, 6, 2], [], [0, 1, 2, 4, 5, 6], True),
])
def test_tactics_finds_the_wins_at_once_and_the_moves_that_leave_none_to_the_opponent(module, moves, winning,
                                                                                       safe, must_block):
    t = tactics(position(module, moves))
    assert (t.winning, t.safe, t.must_block) == (winning, safe, must_block)


def test_connect_fours_tactics_off_the_board_are_those_of_its_copies_in_every_kind_of_position():
    """The board's two moves of lookahead (``FAST_TACTICS``) against stepping copies of the env, on
    every position of games between the heuristic and either player: the same moves, wins and safe
    moves in the same order (so the heuristic draws the same move from the same generator), in
    positions with a win, a block to make, every move lost, nothing at stake and a drawing last move."""
    env, rng = connect_four_v3.env(), np.random.default_rng(0)
    kinds = {"win": 0, "block": 0, "lost": 0, "quiet": 0, "last move": 0}
    for i in range(30):
        env.reset(seed=i)
        players = (heuristic_move, heuristic_move if i % 2 else random_move)
        while not all(env.terminations.values()):
            board, copied = tactics(env), copied_tactics(env)
            assert (board.moves.tolist(), board.winning, board.safe) == \
                (copied.moves.tolist(), copied.winning, copied.safe), env.unwrapped.board
            kinds["win" if board.winning else "block" if board.must_block else "quiet" if board.safe else "lost"] += 1
            kinds["last move"] += env.unwrapped.board.count(0) == 1
            env.step(players[env.possible_agents.index(env.agent_selection)](env, rng))
    env.close()
    assert min(kinds.values()) > 0, kinds


@pytest.mark.parametrize("module", [tictactoe_v3, connect_four_v3])
def test_without_a_win_or_a_threat_the_heuristic_moves_at_random(module):
    env = position(module, [])
    moves = {heuristic_move(env, np.random.default_rng(seed)) for seed in range(30)}
    assert len(moves) > 3 and moves <= set(legal_moves(env).tolist())
    env.close()


def test_the_board_cnn_sees_a_line_of_four_from_each_of_its_cells():
    """``model.encoder = "board_cnn"`` on Connect Four's board: 32 features a cell, and a corner
    cell's features depend on the 4x4 cells of every line of four through it, on nothing further."""
    obs = position(connect_four_v3, []).observe("player_0")["observation"]  # [6, 7, 2]: own discs, the other's
    encoder, width = make_encoder(obs, ModelConfig(encoder="board_cnn", hidden_sizes=()))
    assert width == 32 * 6 * 7
    board = torch.tensor(np.random.default_rng(0).integers(0, 2, (1, 6, 7, 2)), dtype=torch.float32,
                         requires_grad=True)
    features = encoder(board).reshape(32, 6, 7)
    features[:, 0, 0].sum().backward()
    seen = board.grad[0].abs().sum(-1) > 0
    assert seen[:4, :4].all() and not seen[4:].any() and not seen[:, 4:].any(), seen


def games(module, players, n: int, seed: int) -> np.ndarray:
    """The first player's returns in ``n`` games of ``players`` (first, second)."""
    rng = np.random.default_rng(seed)
    env = module.env()
    returns = []
    for i in range(n):
        env.reset(seed=seed + i)
        while not all(env.terminations.values()):
            env.step(players[env.possible_agents.index(env.agent_selection)](env, rng))
        returns.append(env.rewards[env.possible_agents[0]])  # the classic games score the end only
    env.close()
    return np.array(returns, np.float64)


@pytest.mark.parametrize("module, n", [(tictactoe_v3, 200), (connect_four_v3, 100)])
def test_the_heuristic_beats_a_random_player_in_either_seat(module, n):
    """Its win rate is 3 standard errors (of the difference) or more above a random player's in the
    same seat against the same random opponent (chance, measured over 2000 games)."""
    chance = games(module, (random_move, random_move), 2000, 1)
    first = games(module, (heuristic_move, random_move), n, 2) > 0
    second = games(module, (random_move, heuristic_move), n, 3) < 0
    for won, chance_won in ((first, chance > 0), (second, chance < 0)):
        p, p0 = won.mean(), chance_won.mean()
        se = np.sqrt(p * (1 - p) / len(won) + p0 * (1 - p0) / len(chance_won))
        assert p - p0 >= 3 * se, (p, p0, se)


def test_a_copy_of_a_game_is_independent_of_it():
    env = position(connect_four_v3, [3, 3])
    clone = copy_game(env)
    clone.step(4)
    assert env.agent_selection == "player_0" and clone.agent_selection == "player_1"
    assert env.observe("player_0")["observation"].sum() == 2 and clone.observe("player_0")["observation"].sum() == 3
    env.close()


def test_a_game_that_cannot_be_copied_is_a_one_line_error_naming_it():
    env = uncopyable_game_for_tests.env()
    env.reset(seed=0)
    with pytest.raises(NotCopyable) as e:
        heuristic_move(env, np.random.default_rng(0))
    assert str(e.value).startswith("game 'tictactoe_v3': the heuristic player cannot copy its state") and \
        "\n" not in str(e.value), e.value


def test_the_board_shows_pieces_by_seat_and_move_numbers():
    ttt = position(tictactoe_v3, [4, 0])
    assert board_text(ttt.observe("player_2")["observation"], 1, 9) == "O 1 2\n3 X 5\n6 7 8"
    c4 = position(connect_four_v3, [3, 3, 0])
    lines = board_text(c4.observe("player_0")["observation"], 0, 7).splitlines()
    assert lines[-3:] == [". . . O . . .", "X . . X . . .", "0 1 2 3 4 5 6"] and len(lines) == 7


# ------------------------------------------------------------------ evaluate --opponent, play


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A short serial PPO self-play run of tic-tac-toe (deploy/configs/tictactoe_ppo.toml, a fifth
    of its budget): ~5 s."""
    runs_dir = tmp_path_factory.mktemp("runs")
    exp = loading.load(CONFIGS / "tictactoe_ppo.toml", [f"run.runs_dir='{runs_dir}'", "run.max_env_steps=20000"])
    return Path(api.train_serial(exp, out=io.StringIO())["run_dir"])


@pytest.mark.parametrize("opponent", ["random", "heuristic", "latest"])
def test_evaluate_against_an_opponent_reports_and_records_rates_per_seat(trained, opponent):
    out = rlpipe_here("evaluate", str(trained), "--opponent", opponent, "--episodes", "61")
    assert out.returncode == 0, out.stderr
    recorded = evaluation.latest(trained)
    assert recorded["opponent"] == opponent and recorded["episodes"] == 62
    assert re.search(r"62 greedy games \(31 a seat\) of policy version \d+", out.stdout), out.stdout
    for seat in ("first", "second"):
        rates = [recorded[f"{outcome}_{seat}"] for outcome in ("win", "draw", "loss")]
        assert sum(rates) == pytest.approx(1) and all(r * 31 == pytest.approx(round(r * 31)) for r in rates)
        for outcome, p in zip(("win", "draw", "loss"), rates):
            assert recorded[f"{outcome}_{seat}_se"] == pytest.approx(np.sqrt(p * (1 - p) / 31))
    assert recorded["mean_return"] == pytest.approx(
        (recorded["win_first"] - recorded["loss_first"] + recorded["win_second"] - recorded["loss_second"]) / 2)
    p, se = recorded["win_first"], recorded["win_first_se"]
    assert f"against {opponent}: as first player wins {100 * p:.1f}% +- {100 * se:.1f}" in out.stdout
    row = evaluation.read_rows(trained)[-1]
    assert row["opponent"] == opponent and float(row["loss_second"]) == recorded["loss_second"]


def test_evaluate_with_tactics_counts_the_wins_and_blocks_each_seat_missed(trained, tmp_path):
    """A trained policy misses fewer of its wins at once than an untrained one, whose greedy moves
    follow its random initial preferences; the counts are recorded and printed per seat."""
    missed = {}
    for name, run in [("trained", trained), ("untrained", checkpointed_run(tmp_path, "pettingzoo:pettingzoo.classic.tictactoe_v3"))]:
        out = rlpipe_here("evaluate", str(run), "--opponent", "random", "--episodes", "100", "--tactics")
        assert out.returncode == 0, out.stderr
        row = evaluation.latest(run)
        for seat in ("first", "second"):
            assert 0 <= row[f"wins_missed_{seat}"] <= row[f"win_chances_{seat}"]
            assert 0 <= row[f"blocks_missed_{seat}"] <= row[f"must_blocks_{seat}"]
            assert (f"missed {row[f'wins_missed_{seat}']} of {row[f'win_chances_{seat}']} wins at once, "
                    f"{row[f'blocks_missed_{seat}']} of {row[f'must_blocks_{seat}']} blocks") in out.stdout
        chances = row["win_chances_first"] + row["win_chances_second"]
        assert chances >= 30, row
        missed[name] = (row["wins_missed_first"] + row["wins_missed_second"]) / chances
    assert missed["trained"] < missed["untrained"] - 0.2, missed
    out = rlpipe_here("evaluate", str(trained), "--tactics")
    assert (out.returncode, out.stderr.strip()) == (2, "rlpipe: --tactics without --opponent: missed wins and blocks "
                                                       "are counted in games against an opponent"), out


@pytest.fixture(scope="module")
def rival(tmp_path_factory) -> Path:
    """Another serial run of tic-tac-toe, shorter (4,096 env steps, ~2 s), with another network."""
    runs_dir = tmp_path_factory.mktemp("rival")
    exp = loading.load(CONFIGS / "tictactoe_ppo.toml", [f"run.runs_dir='{runs_dir}'", "run.max_env_steps=4096",
                                                        "model.hidden_sizes=[32]"])
    return Path(api.train_serial(exp, out=io.StringIO())["run_dir"])


def test_evaluate_against_another_run_plays_its_greedy_checkpoint_in_both_seats(trained, rival):
    """Greedy against greedy in a game without chance: what one run scores as first player the other
    scores as second, with the signs swapped, and both evaluations are recorded in their runs."""
    out = rlpipe_here("evaluate", str(trained), "--opponent", str(rival), "--episodes", "20")
    assert out.returncode == 0, out.stderr
    ours = evaluation.latest(trained)
    theirs_version = torch.load(rival / runfiles.CHECKPOINT, weights_only=False)["version"]
    assert (ours["opponent"], ours["opponent_version"], ours["episodes"]) == (rival.name, theirs_version, 20)
    assert f"against {rival.name}: as first player wins {100 * ours['win_first']:.1f}%" in out.stdout
    assert evaluation.read_rows(trained)[-1]["opponent"] == rival.name
    out = rlpipe_here("evaluate", str(rival), "--opponent", str(trained), "--episodes", "20")
    assert out.returncode == 0, out.stderr
    theirs = evaluation.latest(rival)
    for outcome, mirrored in (("win", "loss"), ("draw", "draw"), ("loss", "win")):
        assert ours[f"{outcome}_first"] == theirs[f"{mirrored}_second"]
        assert ours[f"{outcome}_second"] == theirs[f"{mirrored}_first"]


def test_evaluate_plays_the_same_games_on_the_held_out_seeds(trained):
    """Seeded: the random opponent's games repeat exactly."""
    rows = []
    for _ in range(2):
        assert rlpipe_here("evaluate", str(trained), "--opponent", "random", "--episodes", "40").returncode == 0
        rows.append({k: v for k, v in evaluation.latest(trained).items() if k not in ("wall_time", "eval_s")})
    assert rows[0] == rows[1]


def test_the_evaluator_plays_the_opponents_only_in_two_player_games():
    tictactoe = {"id": "pettingzoo:pettingzoo.classic.tictactoe_v3"}
    assert matches.service_opponents(loading.from_dict({"env": tictactoe})) == ("random", "heuristic")
    assert matches.service_opponents(loading.from_dict({"env": tictactoe, "eval": {"opponents": []}})) == ()
    assert matches.service_opponents(loading.from_dict({"env": {"id": "CartPole-v1"}})) == ()


def test_the_evaluator_reports_rates_against_the_opponents_during_training(runs):
    """A tic-tac-toe pipeline run with the evaluator on: every evaluation's games against the random
    player and the heuristic (``eval.opponents``' default) reach eval.csv, TensorBoard and the metrics
    endpoint, while eval.json keeps the evaluation's own row (the learner's progress rows read it)."""
    run = runs("tictactoe_ppo.toml", "eval.every_s=1.0", "eval.episodes=8", "eval.envs=4")

    def evaluated_on_the_endpoint():
        """The eval.csv rows of the version the endpoint shows, once its 2 x 6 gauges match them."""
        page = run.metrics()
        if page.count("rlpipe_evaluator_outcome_ratio{") != 2 * len(evaluation.MATCH_FIELDS):
            return None
        version = metric_value(page, "rlpipe_evaluator_policy_version")
        rows = [r for r in evaluation.read_rows(run.dir) if r["opponent"] and int(r["policy_version"]) == version]
        if sorted(r["opponent"] for r in rows) != ["heuristic", "random"]:
            return None
        for r in rows:
            for field in evaluation.MATCH_FIELDS:
                outcome, seat = field.split("_")
                shown = metric_value(page, "rlpipe_evaluator_outcome_ratio", opponent=r["opponent"], seat=seat,
                                     outcome=outcome)
                if shown != float(r[field]):
                    return None
        return rows

    rows = run.wait_for(evaluated_on_the_endpoint, 60, "an evaluation against both opponents on the endpoint")
    for row in rows:
        assert int(row["episodes"]) == 8 and float(row["eval_s"]) > 0
        for seat in matches.SEATS:
            rates = [float(row[f"{outcome}_{seat}"]) for outcome in matches.OUTCOMES]
            assert sum(rates) == pytest.approx(1) and all(r * 4 == pytest.approx(round(r * 4)) for r in rates), row
    assert not evaluation.latest(run.dir).get("opponent")
    step = int(rows[0]["env_steps"])
    for opponent in ("random", "heuristic"):
        assert step in dict(tensorboard_scalars(run.dir, f"eval/{opponent}/win_first"))
    print(f"\nversion {rows[0]['policy_version']}: " + "; ".join(
        f"{r['opponent']}: first {r['win_first']}/{r['draw_first']}/{r['loss_first']}, second "
        f"{r['win_second']}/{r['draw_second']}/{r['loss_second']} in {r['eval_s']} s" for r in rows))


def test_a_wrong_opponent_is_one_error_line(tmp_path, trained):
    single = checkpointed_run(tmp_path, "CartPole-v1")
    other_game = checkpointed_run(tmp_path / "c4", "pettingzoo:pettingzoo.classic.connect_four_v3")
    unplayed = tmp_path / "unplayed"
    unplayed.mkdir()
    (unplayed / RUN_CONFIG).write_text((trained / RUN_CONFIG).read_text())
    for run, opponent, message in [
        (single, "random", "rlpipe: --opponent random: needs a two-player turn-based PettingZoo game; "
                           "env.id = 'CartPole-v1' is a single-agent env"),
        (trained, "champion", "rlpipe: --opponent 'champion': unknown; give one of random, heuristic, latest, "
                              "or a run of the same game (its directory or id)"),
        (trained, str(other_game), f"rlpipe: --opponent {other_game}: that run has env.id = "
                                   "'pettingzoo:pettingzoo.classic.connect_four_v3', this one "
                                   "'pettingzoo:pettingzoo.classic.tictactoe_v3'; runs play each other on the same "
                                   "game and observations"),
        (trained, str(unplayed), f"rlpipe: --opponent unplayed: no checkpoint at {unplayed.resolve() / runfiles.CHECKPOINT}: "
                                 "the learner writes one every 10 s"),
    ]:
        out = rlpipe_here("evaluate", str(run), "--opponent", opponent)
        assert (out.returncode, out.stderr.strip(), out.stdout) == (2, message, ""), out
    out = rlpipe_here("play", str(single))
    assert (out.returncode, out.stderr.strip()) == (2, "rlpipe: play: needs a two-player turn-based PettingZoo game; "
                                                       "env.id = 'CartPole-v1' is a single-agent env")
    assert not (single / runfiles.EVAL_LATEST).exists() and not (single / runfiles.EVAL_CSV).exists()


class Terminal:
    """``rlpipe ARGS`` on a pseudo-terminal: what it prints is read as a person would see it."""

    def __init__(self, *args: str):
        master, slave = pty.openpty()
        self.fd, self.text = master, ""
        self.proc = subprocess.Popen(**rlpipe_command(*args), stdin=slave, stdout=slave, stderr=slave)
        os.close(slave)

    def read_until(self, pattern: str, timeout: float = 60) -> re.Match:
        """The first match of ``pattern`` in what was printed since the last match."""
        deadline = time.monotonic() + timeout
        while not (found := re.search(pattern, self.text)):
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"no {pattern!r} within {timeout} s; the terminal shows:\n{self.text}"
            try:
                chunk = os.read(self.fd, 4096).decode()
            except OSError:  # the process ended and closed the terminal
                chunk = ""
            assert chunk, f"the terminal closed before {pattern!r}; it shows:\n{self.text}"
            self.text += chunk.replace("\r\n", "\n")
        self.text = self.text[found.end():]
        return found

    def type(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            os.close(self.fd)


BOARD_THEN_PROMPT = r"((?:[XO0-9] [XO0-9] [XO0-9]\n){3})Your move: "
END = r"(You won|The policy won|A draw)\.\n"


@pytest.mark.parametrize("seat", ["--first", "--second"])
def test_a_person_plays_tic_tac_toe_against_the_policy_in_a_terminal(trained, seat):
    """Scripted moves: the lowest free square each turn, after an illegal one (an occupied
    square or none) that is refused with a line and asked again."""
    term = Terminal("play", str(trained), seat)
    try:
        piece = "X" if seat == "--first" else "O"
        term.read_until(rf"You play {piece} \({seat[2:]} player\) against policy version \d+")
        if seat == "--second":
            term.read_until(r"The policy plays [0-8]\.")
        moves = 0
        while True:
            board = term.read_until(rf"{BOARD_THEN_PROMPT}|{END}")
            if board.group(2):
                break
            cells = board.group(1).split()
            free = [int(c) for c in cells if c.isdigit()]
            taken = next((i for i, c in enumerate(cells) if not c.isdigit()), 9)
            term.type(str(taken))
            term.read_until(rf"'{taken}' is not a legal move; legal moves: {' '.join(map(str, free))}\.\nYour move: ")
            term.type(str(free[0]))
            moves += 1
        assert term.close() == 0
        assert 2 <= moves <= 5
    finally:
        if term.proc.poll() is None:
            term.close()


def test_connect_four_is_played_by_columns(tmp_path):
    """An untrained policy's checkpoint: moves are columns, numbered under the board; a full
    column is refused and the game goes on to its end."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    exp = loading.from_dict({"env": {"id": "pettingzoo:pettingzoo.classic.connect_four_v3"},
                             "model": {"action_mask": "auto"}})
    (run_dir / RUN_CONFIG).write_text(loading.dumps(exp))
    torch.save({"agent": untrained_agent(exp).state_dict(), "version": 0, "env_steps": 0},
               run_dir / "checkpoints" / "latest.pt")
    moves = "".join(f"{c}\n" * 7 for c in range(7))  # each column until it is full, then the next
    out = io.StringIO()
    assert terminal_game.play(exp, run_dir, 0, io.StringIO(moves), out) == 0
    text = out.getvalue()
    assert "0 1 2 3 4 5 6\nYour move: " in text and re.search(END + r"$", text), text
    refused = re.findall(r"'(\d)' is not a legal move; legal moves: ([\d ]+)\.", text)
    assert all(column not in legal.split() for column, legal in refused)
    assert refused or "You won." in text  # the moves fill a column unless four in one win first
