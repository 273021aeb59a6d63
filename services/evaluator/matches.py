"""Greedy games of a run's policy against an opponent in a two-player turn-based PettingZoo game
(`rlpipe evaluate RUN --opponent random|heuristic|latest`), as first and as second player.

The games are played on the run's env columns (``PettingZooGroup``, the held-out seeds of
``episodes.play``), so the policy sees what it was trained on; on board k the policy holds seat
``k % 2`` and the opponent's moves replace the other column's actions. The opponents:

- ``random``, ``heuristic``: the scripted players of ``shared.envs.players``, seeded with the
  held-out seed.
- ``latest``: the same checkpoint acting as the run's samplers did at its last checkpoint (a
  sample of its policy; a Q agent's exploration at the checkpoint's env steps). A greedy copy of
  a deterministic policy would play one game over and over.
- another run of the same game (`--opponent RUN2`): that run's latest checkpoint, greedy as the
  policy is, on the observations both runs were trained on (``check_opponent``).

An outcome is the sign of the policy seat's return (win > 0, draw 0, loss < 0), as the classic
games score +1 / 0 / -1.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch

from services.build import step_buffers
from shared.agents import EVALUATE, StepContext
from shared.config.schema import OPPONENTS, Experiment
from shared.config.topology import topology
from shared.data.namedarraytuple import numpify, torchify
from shared.envs.backends import make_env_group
from shared.envs.pettingzoo_backend import check_two_player_game, not_two_player_game
from shared.envs import players
from shared.runtime import heartbeat

SEATS = ("first", "second")
OUTCOMES = ("win", "draw", "loss")
_PLURALS = {"win": "wins", "draw": "draws", "loss": "losses"}


RIVAL_ENV_FIELDS = ("id", "kwargs", "wrappers", "max_episode_steps", "agent_id", "global_state", "groups")
"""The env settings two runs must share to play each other: the game, its rules and what a
policy observes of it (the backend and its threads may differ)."""


def check_opponent(exp: Experiment, opponent: str, rival: Experiment | None = None) -> None:
    """ValueError (one line naming ``--opponent``) for an unknown opponent, a run whose env is no
    two-player turn-based PettingZoo game, or (``rival``: the config of the run ``opponent``
    names) a run that plays another game or observes it otherwise."""
    if rival is None and opponent not in OPPONENTS:
        raise ValueError(f"--opponent {opponent!r}: unknown; give one of {', '.join(OPPONENTS)}, or a run of the "
                         "same game (its directory or id)")
    check_two_player_game(exp.env, f"--opponent {opponent}")
    for field in RIVAL_ENV_FIELDS if rival is not None else ():
        ours, theirs = getattr(exp.env, field), getattr(rival.env, field)
        # A table compares by order too: a group's index, the agent_group leaf, is its place in it.
        if ours != theirs or isinstance(ours, dict) and list(ours.items()) != list(theirs.items()):
            raise ValueError(f"--opponent {opponent}: that run has env.{field} = {theirs!r}, this one {ours!r}; "
                             "runs play each other on the same game and observations")


def service_opponents(exp: Experiment) -> tuple[str, ...]:
    """The opponents the evaluator service plays at each evaluation: ``eval.opponents`` in a
    two-player turn-based game, none in any other env."""
    if not exp.eval.opponents or not_two_player_game(exp.env) is not None:
        return ()
    return exp.eval.opponents


TACTICS = ("win_chances", "wins_missed", "must_blocks", "blocks_missed")
"""What ``play_games`` counts of the policy's moves with ``tactics``, per seat: positions where a
move won at once, those of them where the policy played another; positions where the policy had
to block (``Tactics.must_block``), those where it let the opponent win at once."""


class Games(NamedTuple):
    first: np.ndarray
    """The policy's returns as first player, float64 [games]."""
    second: np.ndarray
    """As second player."""
    tactics: np.ndarray | None
    """int64 [2 seats, len(TACTICS)] where asked for, else None."""


def play_games(exp: Experiment, agent: torch.nn.Module, opponent: str | torch.nn.Module, games: int,
               env_steps: int = 0, tactics: bool = False) -> Games:
    """Greedy games of ``agent`` against ``opponent`` (OPPONENTS, or another run's agent, greedy
    too), ``games`` in each seat, on ``exp.eval.envs`` boards (at least 2) side by side.
    ``env_steps``: the run's env steps at the checkpoint, for ``latest``'s exploration.
    ``tactics``: count the policy's missed wins and blocks (TACTICS; two moves of lookahead on
    copies of each position, ~5 ms a move on Connect Four). Each board plays a fixed share of its
    seat's games: taking the first ``games`` to end would favour short games. The callers have
    checked ``opponent`` and the game (``check_opponent``: the command line;
    ``service_opponents``: the evaluator at its start), so an evaluation builds no env for the check."""
    boards = 2 * max(1, min(exp.eval.envs, games) // 2)
    n = 2 * boards
    seed = topology(exp).eval_seed
    rng = np.random.default_rng(seed)
    group = make_env_group(exp.env, n, seed)
    ours = np.arange(boards) % 2  # the policy's seat on each board
    theirs_col = 2 * np.arange(boards) + 1 - ours
    quota = games // (boards // 2) + (np.arange(boards) // 2 < games % (boards // 2))
    played = np.zeros(boards, np.int64)
    player = players.PLAYERS.get(opponent) if isinstance(opponent, str) else None
    rival = None if isinstance(opponent, str) else opponent
    sampling = StepContext(env_steps=env_steps)
    results: tuple[list[float], list[float]] = ([], [])
    counts = np.zeros((2, len(TACTICS)), np.int64)
    try:
        slot, final_obs, reward, terminated, truncated, first = step_buffers(exp, group, n)
        group.reset(slot.observation)
        while (played < quota).any():
            heartbeat.beat()
            obs = torchify(slot.observation)
            with torch.inference_mode():
                action, _ = agent.step(obs, replace(EVALUATE, first=first, reward=reward))
                slot.action[:] = numpify(action)
                if rival is not None:
                    other, _ = rival.step(obs, replace(EVALUATE, first=first, reward=reward))
                    slot.action[theirs_col] = numpify(other)[theirs_col]
                elif player is None:  # latest
                    other, _ = agent.step(obs, replace(sampling, first=first, reward=reward))
                    slot.action[theirs_col] = numpify(other)[theirs_col]
            for k in range(boards) if player is not None or tactics else ():
                game = group.game(k)
                if game.agent_selection == game.possible_agents[1 - ours[k]]:
                    if player is not None:
                        slot.action[theirs_col[k]] = player(game, rng)
                elif tactics and played[k] < quota[k]:  # a move of a game that will count
                    counts[ours[k]] += _judge(players.tactics(game), int(slot.action[2 * k + ours[k]]))
            ended = group.step(slot.action, slot.observation, reward, terminated, truncated, final_obs)
            np.logical_or(terminated, truncated, out=first)
            for i, ret, _ in ended:
                k = i // 2
                if i % 2 == ours[k] and played[k] < quota[k]:
                    results[ours[k]].append(ret)
                    played[k] += 1
    finally:
        group.close()
    return Games(*(np.array(r, np.float64) for r in results), counts if tactics else None)


def _judge(t: players.Tactics, move: int) -> np.ndarray:
    """One move's TACTICS counts."""
    return np.array([bool(t.winning), bool(t.winning) and move not in t.winning,
                     t.must_block, t.must_block and move not in t.safe], np.int64)


def rates(first: np.ndarray, second: np.ndarray) -> dict:
    """``{outcome}_{seat}`` (win, draw, loss x first, second) rates of the policy seat's returns
    and ``{outcome}_{seat}_se``, their standard errors sqrt(p (1 - p) / games)."""
    row = {}
    for seat, returns in zip(SEATS, (first, second)):
        for outcome, hit in zip(OUTCOMES, (returns > 0, returns == 0, returns < 0)):
            p = float(hit.mean())
            row[f"{outcome}_{seat}"] = p
            row[f"{outcome}_{seat}_se"] = float(np.sqrt(p * (1 - p) / len(returns)))
    return row


def tactic_counts(counts: np.ndarray) -> dict:
    """``{count}_{seat}`` (TACTICS x first, second) of ``Games.tactics``, as ints."""
    return {f"{name}_{seat}": int(counts[i, j]) for i, seat in enumerate(SEATS) for j, name in enumerate(TACTICS)}


def describe(row: dict) -> str:
    """One line of a match's rates per seat, in percent with their standard errors, and where the
    row has them its missed wins and blocks (``tactic_counts``)."""
    seats = []
    for seat in SEATS:
        parts = [f"{_PLURALS[outcome]} {100 * row[f'{outcome}_{seat}']:.1f}% +- {100 * row[f'{outcome}_{seat}_se']:.1f}"
                 for outcome in OUTCOMES]
        if f"win_chances_{seat}" in row:
            parts += [f"missed {row[f'wins_missed_{seat}']} of {row[f'win_chances_{seat}']} wins at once",
                      f"{row[f'blocks_missed_{seat}']} of {row[f'must_blocks_{seat}']} blocks"]
        seats.append(f"as {seat} player {', '.join(parts)}")
    return f"against {row['opponent']}: " + "; ".join(seats)
