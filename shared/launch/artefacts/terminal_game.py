"""`rlpipe play RUN`: a person plays a two-player turn-based PettingZoo game (tic-tac-toe,
connect four) against the greedy policy of the run's latest checkpoint, in the terminal.

The game is one board of the run's env columns (``PettingZooGroup``, on the first held-out
seed), so the policy sees what it was trained on. The board is drawn from the person's own
observation, the classic games' ``[H, W, 2]`` planes (own pieces, the other's): the first
player's pieces are X, the second's O. Where the game has an action a cell (tic-tac-toe: action
``i * W + j`` is the cell ``observation[i, j]``), empty cells show their move's number; where it
has one a column (connect four), the numbers stand under the columns.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from services.build import step_buffers
from services.evaluator.episodes import load_agent
from shared.agents import EVALUATE
from shared.config.schema import Experiment
from shared.config.topology import topology
from shared.data.namedarraytuple import numpify, torchify
from shared.envs.backends import make_env_group
from shared.envs.pettingzoo_backend import check_two_player_game

PIECES = "XO"
"""The first player's piece, the second's."""


def board_text(planes: np.ndarray, seat: int, n_actions: int) -> str:
    """The board of ``planes`` ([H, W, 2]: the pieces of the player in ``seat``, then the other's)
    as lines of text, with the move numbers (see the module docstring)."""
    H, W, _ = planes.shape
    mine, other = PIECES[seat], PIECES[1 - seat]
    width = len(str(n_actions - 1))
    rows = []
    for i in range(H):
        cells = []
        for j in range(W):
            if planes[i, j, 0]:
                cells.append(mine.rjust(width))
            elif planes[i, j, 1]:
                cells.append(other.rjust(width))
            else:
                cells.append(str(i * W + j).rjust(width) if n_actions == H * W else ".".rjust(width))
        rows.append(" ".join(cells))
    if n_actions == W:
        rows.append(" ".join(str(j).rjust(width) for j in range(W)))
    return "\n".join(rows)


def play(exp: Experiment, run_dir: Path, seat: int, stdin: TextIO, stdout: TextIO) -> int:
    """One game of a person (moves read from ``stdin``, a number a line) in ``seat`` (0 moves
    first) against the run's greedy policy, shown on ``stdout``. An illegal move is refused with a
    line and asked for again. Returns 0 when the game ends, 1 when ``stdin`` ends or the person
    types q first. ValueError (one line) for a game this cannot play."""
    check_two_player_game(exp.env, "play")
    torch.set_num_threads(1)
    agent, state = load_agent(exp, run_dir)
    group = make_env_group(exp.env, 2, topology(exp).eval_seed)
    try:
        slot, final_obs, reward, terminated, truncated, first = step_buffers(exp, group, 2)
        if not (hasattr(slot.observation, "observation") and slot.observation.observation.ndim == 4
                and slot.observation.observation.shape[-1] == 2):
            raise ValueError(f"play: env.id = {exp.env.id!r}: no board of [H, W, 2] planes to draw")
        n_actions = int(group.action_space.n)
        game = group.game(0)
        group.reset(slot.observation)
        print(f"You play {PIECES[seat]} ({('first', 'second')[seat]} player) against policy version "
              f"{state['version']} of {run_dir.name} ({state['env_steps']} env steps). Type a move's number; "
              "q quits.", file=stdout, flush=True)
        while True:
            print(board_text(slot.observation.observation[seat], seat, n_actions), file=stdout, flush=True)
            with torch.inference_mode():
                action, _ = agent.step(torchify(slot.observation), replace(EVALUATE, first=first, reward=reward))
            slot.action[:] = numpify(action)
            if game.agent_selection == game.possible_agents[seat]:
                move = _read_move(np.flatnonzero(slot.observation.action_mask[seat]), stdin, stdout)
                if move is None:
                    print("Game left unfinished.", file=stdout, flush=True)
                    return 1
                slot.action[seat] = move
            else:
                print(f"The policy plays {int(slot.action[1 - seat])}.", file=stdout, flush=True)
            ended = group.step(slot.action, slot.observation, reward, terminated, truncated, final_obs)
            np.logical_or(terminated, truncated, out=first)
            outcome = {i: ret for i, ret, _ in ended}
            if seat in outcome:
                print(board_text(final_obs.observation[seat], seat, n_actions), file=stdout)
                mine = outcome[seat]
                print("You won." if mine > 0 else "The policy won." if mine < 0 else "A draw.", file=stdout,
                      flush=True)
                return 0
    finally:
        group.close()


def _read_move(legal: np.ndarray, stdin: TextIO, stdout: TextIO) -> int | None:
    """A legal move read from ``stdin``, asked for until one is; None at the end of ``stdin`` or q."""
    while True:
        print("Your move: ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line or line.strip().lower() == "q":
            return None
        text = line.strip()
        if text.isdigit() and int(text) in legal:
            return int(text)
        print(f"{text!r} is not a legal move; legal moves: {' '.join(str(int(a)) for a in legal)}.", file=stdout,
              flush=True)
