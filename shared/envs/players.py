"""Scripted players for two-player turn-based PettingZoo games (the AEC API with an
``action_mask``, e.g. the classic board games): a uniformly random player and a heuristic one
(win if you can, block if you must, else random), the fixed opponents a self-play policy is
measured against (``rlpipe evaluate RUN --opponent random|heuristic``).

A player is ``move(env, rng) -> action`` for the agent whose turn it is (``env.agent_selection``)
in a game that is not over. The heuristic knows no game's rules: it tries each legal move on a
copy of the env (``copy_game``), so it plays any such game whose state can be copied. For
Connect Four, where a self-play sampler asks it for many moves a second, the same two moves of
lookahead are read off the board instead (``FAST_TACTICS``): the same answer in ~0.1 ms a
position here, against ~3.7 ms on copies.
"""

from __future__ import annotations

import copy
from typing import Callable, NamedTuple

import numpy as np
from gymnasium.spaces import Space
from pettingzoo import AECEnv

Player = Callable[[AECEnv, np.random.Generator], int]


class NotCopyable(ValueError):
    """The game's state cannot be copied, so the heuristic player cannot look ahead in it."""


def legal_moves(env: AECEnv) -> np.ndarray:
    """The actions the agent to move may take (int64 [k]), from its observation's ``action_mask``."""
    return np.flatnonzero(env.observe(env.agent_selection)["action_mask"])


def random_move(env: AECEnv, rng: np.random.Generator) -> int:
    """A uniformly random legal move."""
    return int(rng.choice(legal_moves(env)))


def _game_name(env: AECEnv) -> str:
    return env.metadata.get("name", type(env.unwrapped).__name__)


def copy_game(env: AECEnv, check: bool = True) -> AECEnv:
    """An independent copy of ``env`` in its current state: the same agent to move and the same
    observations for every agent (``check`` compares them); stepping it leaves ``env`` as it is.

    ``copy.deepcopy`` alone does not do: PettingZoo's classic envs are ``EzPickle``s, whose copy
    is a new env built from the constructor's arguments, before its first reset. So each level of
    the wrapper chain is copied as its attributes, the levels pointing at each other's copies.
    Observation and action spaces are shared, not copied: they describe the game, not its state,
    and copying them is most of a copy's cost. NotCopyable (one line naming the game) where the
    copy fails or, checked, gives another state."""
    chain = [env]
    while isinstance(getattr(chain[-1], "env", None), AECEnv):
        chain.append(chain[-1].env)
    try:
        memo = {id(level): object.__new__(type(level)) for level in chain}
        for level in chain:
            for value in vars(level).values():
                for x in value.values() if isinstance(value, dict) else (value,):
                    if isinstance(x, Space):
                        memo[id(x)] = x
        for level in chain:
            memo[id(level)].__dict__.update(copy.deepcopy(vars(level), memo))
        clone = memo[id(env)]
        same = not check or clone.agent_selection == env.agent_selection and all(
            _same_observation(clone.observe(a), env.observe(a)) for a in env.agents)
    except Exception as e:  # noqa: BLE001 - whatever stops the copy, it is this game's limit
        raise NotCopyable(f"game {_game_name(env)!r}: the heuristic player cannot copy its state to try moves "
                          f"({type(e).__name__}: {e})") from None
    if not same:
        raise NotCopyable(f"game {_game_name(env)!r}: a copy of its state observes another position, so the "
                          "heuristic player cannot try moves on it")
    return clone


def _same_observation(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    return bool(np.array_equal(a, b))


def _after(env: AECEnv, action: int, check: bool = False) -> AECEnv:
    game = copy_game(env, check)
    game.step(action)
    return game


def _won(game: AECEnv, agent: str) -> bool:
    return game.rewards.get(agent, 0) > 0


def _over(game: AECEnv) -> bool:
    return not game.agents or game.terminations.get(game.agent_selection, True) or \
        game.truncations.get(game.agent_selection, False)


class Tactics(NamedTuple):
    """What two moves of lookahead say of a position (``tactics``)."""

    moves: np.ndarray
    """The legal moves."""
    winning: list[int]
    """The moves that win at once."""
    safe: list[int]
    """Where no move wins: the moves after which the opponent has no winning reply (the game
    drawn counts as safe); all of ``moves`` where nothing threatens, none where every move loses.
    Empty where a move wins (not looked at)."""

    @property
    def must_block(self) -> bool:
        """No move wins, some moves let the opponent win at once, and some do not."""
        return not self.winning and 0 < len(self.safe) < len(self.moves)


def tactics(env: AECEnv) -> Tactics:
    """The position of the agent to move in ``env``, two moves ahead: on the board for a game
    of ``FAST_TACTICS``, else on copies of the env (``copy_game``; NotCopyable for a game it
    cannot copy)."""
    fast = FAST_TACTICS.get(_game_name(env))
    return fast(env) if fast is not None else copied_tactics(env)


def copied_tactics(env: AECEnv) -> Tactics:
    """``tactics`` of any game whose state can be copied, by stepping copies of ``env``."""
    me = env.agent_selection
    moves = legal_moves(env)
    after = {int(a): _after(env, int(a), check=i == 0) for i, a in enumerate(moves)}
    winning = [a for a, game in after.items() if _won(game, me)]
    safe = []
    for a, game in () if winning else after.items():
        if _over(game):
            safe.append(a)  # a draw: nothing to block
            continue
        them = game.agent_selection
        if not any(_won(_after(game, int(b)), them) for b in legal_moves(game)):
            safe.append(a)
    return Tactics(moves, winning, safe)


_C4_ROWS, _C4_COLS = 6, 7
_C4_DIRECTIONS = ((0, 1), (1, 0), (1, 1), (1, -1))


def _c4_wins_at(board: list[list[int]], row: int, col: int, piece: int) -> bool:
    """Whether ``piece`` dropped at (row, col) makes a line of four through that cell (the only
    line a move can make: the game ends at the first); the board is not changed."""
    for dr, dc in _C4_DIRECTIONS:
        n = 1
        for sign in (1, -1):
            r, c = row + sign * dr, col + sign * dc
            while 0 <= r < _C4_ROWS and 0 <= c < _C4_COLS and board[r][c] == piece:
                n += 1
                r, c = r + sign * dr, c + sign * dc
        if n >= 4:
            return True
    return False


def _connect_four_tactics(env: AECEnv) -> Tactics:
    """``copied_tactics`` of PettingZoo's connect_four_v3 from its board (``raw_env.board``: 42
    cells row by row from the top, 0 empty, 1 and 2 the first and second agent's pieces): the same
    moves, wins and safe moves in the same order (tests/test_two_player_games.py compares them).
    Plain lists, not numpy: each lookup is one cell, where numpy's per-element cost dominates."""
    game = env.unwrapped
    board = [game.board[r * _C4_COLS:(r + 1) * _C4_COLS] for r in range(_C4_ROWS)]
    # The row a disc dropped into each column lands in (-1: the column is full); row 0 is the top.
    landing = [max((r for r in range(_C4_ROWS) if board[r][c] == 0), default=-1) for c in range(_C4_COLS)]
    me = game.agents.index(env.agent_selection) + 1
    moves = legal_moves(env)
    winning = [int(a) for a in moves if _c4_wins_at(board, landing[a], a, me)]
    safe = []
    for a in () if winning else moves.tolist():
        row = landing[a]
        board[row][a], landing[a] = me, row - 1
        if not any(landing[b] >= 0 and _c4_wins_at(board, landing[b], b, 3 - me) for b in range(_C4_COLS)):
            safe.append(a)  # with the board full (a draw) there is no reply: safe too
        board[row][a], landing[a] = 0, row
    return Tactics(moves, winning, safe)


FAST_TACTICS: dict[str, Callable[[AECEnv], Tactics]] = {"connect_four_v3": _connect_four_tactics}
"""``tactics`` read off the board, by the game's ``metadata["name"]``."""


def heuristic_move(env: AECEnv, rng: np.random.Generator) -> int:
    """A move that wins at once if one does; else a random one of those after which the opponent
    has no winning reply (the block), if any; else a random legal move (``tactics``)."""
    t = tactics(env)
    return int(rng.choice(t.winning or t.safe or t.moves))


PLAYERS: dict[str, Player] = {"random": random_move, "heuristic": heuristic_move}
"""The scripted opponents by the name ``rlpipe evaluate --opponent`` gives them."""
