"""The opponent seat of self-play against a pool of past versions (``[selfplay]``,
``shared.transport.pool``), in a sampler (local or server inference) or in serial mode.

Board b of the run (global columns 2b, 2b + 1) gives the learner one seat and the opponent the
other: the learner plays second on a ``selfplay.second_seat_share`` of the boards, spread evenly
(board b where ``floor((b + 1) s) > floor(b s)``: at 0.5 the odd boards, so the learner plays first
on half the boards and second on the rest).

A board's opponent is drawn when its game starts and holds until that game ends, so every move
of a game is one version's and the game's outcome scores that version. The versions in play act
from copies of the agent, one a version, made when first needed and at most ``selfplay.size``
(the pool's size bounds them): a version drawn that no copy holds is loaded from its snapshot
file into a copy that no game in progress uses (one of a version that left the pool first). A
step costs one batched forward pass a version in play, over that version's boards, or, where
the copies act in torch, one pass for all (``shared.agents.stacked``). The pool's
list of versions (and ``prioritised``'s scores) is read again every ``horizon`` steps, a
segment's worth, not at every draw. Until the pool holds a version (the learner's first
snapshot) a starting game's opponent keeps the current policy's actions, unscored.

With ``selfplay.scripted`` a starting game draws first whether a scripted player
(``shared.envs.players``) holds the opponent's seat, by the players' shares; such a game's moves
are the player's, chosen on the board's PettingZoo env (``PettingZooGroup.game``) at each of the
opponent's turns, and it is reported unscored like a game against the current policy.

What the sampler does with the columns (``Sampler.opponent``): it masks them out of every loss
(``Samples.failed``) unless ``selfplay.train_both_seats``, and reports the episodes of the
learner's columns only, each with the version its game was played against (``version_of``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from shared.config.schema import SelfPlayConfig
from shared.envs.players import PLAYERS
from shared.transport.pool import PoolFiles, draw


def opponent_columns(env_base: int, envs: int, second_seat_share: float = 0.5) -> np.ndarray:
    """bool [envs]: which of a sampler's columns (global ``env_base ..``) the opponent holds, where
    the learner is second on a ``second_seat_share`` of the run's boards."""
    cols = env_base + np.arange(envs)
    board = cols // 2
    learner_second = np.floor((board + 1) * second_seat_share) > np.floor(board * second_seat_share)
    return cols % 2 != learner_second


def sampler_opponent(exp, run_dir, sampler, make_copy: Callable[[], tuple], seed,
                     stack: Callable | None = None) -> "Opponent":
    """The opponent seat of ``sampler`` in run ``run_dir`` (a pipeline sampler or serial mode's)."""
    # Board j -> (its env group, its env in the group), once: the group's env object is looked up
    # at each move, as a recreated env replaces it.
    where = [(g, k) for g, cols in enumerate(sampler.groups) for k in range((cols.stop - cols.start) // 2)]

    def game_of(board: int):
        g, k = where[board]
        return sampler.envs[g].game(k)

    mask = opponent_columns(sampler.env_base, exp.sampler.envs, exp.selfplay.second_seat_share)
    return Opponent(exp.selfplay, PoolFiles(run_dir, exp.selfplay.size), make_copy, mask, exp.sampler.horizon, seed,
                    stack, game_of if exp.selfplay.scripted else None)


class Opponent:
    """The opponent's columns of one sampler and the past versions their games act with."""

    def __init__(self, cfg: SelfPlayConfig, files: PoolFiles, make_copy: Callable[[], tuple], mask: np.ndarray,
                 horizon: int, seed: np.random.SeedSequence, stack: Callable | None = None,
                 game_of: Callable | None = None):
        """``make_copy()``: a new copy of the agent as ``(act, target)``, an ``Actor`` or
        ``NumpyActor`` on it and its state (``params.ModuleState`` or ``StateArrays``) that the
        drawn versions load into; ``mask``: ``opponent_columns`` (one opponent column a board, so
        the sampler's board j holds opponent column j); ``stack(act)``: for the first copy's
        ``act``, what acts for all copies in one pass (``shared.agents.stacked.stacked_actor``),
        or None where each copy acts on its own boards (also where ``stack`` is None); ``game_of(j)``:
        board j's PettingZoo env, for the scripted players (``cfg.scripted``)."""
        self.cfg, self.files, self.make_copy, self.horizon, self.stack = cfg, files, make_copy, horizon, stack
        self.stacked = None
        self.mask = mask
        self.columns = np.flatnonzero(mask)
        self.train_both = cfg.train_both_seats
        self.rng = np.random.default_rng(seed)
        self.copies: list[tuple] = []
        self.loaded: list[int] = []
        """The version each copy holds."""
        self.copy_of = np.full(len(self.columns), -1)
        """The copy each board's game acts with (-1: the current policy's actions, no version yet)."""
        self.pool: list[int] = []
        self.scores: dict = {}
        self.steps = 0
        self.game_of = game_of
        self.players = [PLAYERS[name] for name in cfg.scripted]
        self.shares = np.cumsum(list(cfg.scripted.values()))
        self.player_of = np.full(len(self.columns), -1)
        """The scripted player each board's game is played against (an index of ``players``; -1: none)."""

    def version_of(self, column: int) -> int:
        """The version the game on ``column``'s board (a sampler column of either seat) is played
        against, -1 for none (the current policy)."""
        held = self.copy_of[column // 2]
        return self.loaded[held] if held >= 0 else -1

    def act(self, slot, cols: slice, env_index: np.ndarray, env_steps: int, envs_total: int) -> None:
        """Overwrite the opponent columns' actions and agent info in ``slot`` (the current policy
        acted for every column) with those of the versions their games hold; a board whose game
        starts at this step (``slot.first``) draws its version first. ``cols``: the sampler's
        columns ``slot`` holds (an env group's: whole boards)."""
        start = cols.start
        if start == 0:  # a step acts the group at column 0 once: the pool is read by steps, not by groups
            if self.steps % self.horizon == 0:
                self.pool = self.files.versions()
                self.scores = self.files.read_scores() if self.cfg.pool == "prioritised" and self.pool else {}
            self.steps += 1
        boards = slice(start // 2, (start + len(slot.first)) // 2)
        c = self.columns[boards] - start
        copy_of = self.copy_of[boards]  # a view: a draw here is the board's for ``_copy_for`` too
        player_of = self.player_of[boards]
        starting = np.flatnonzero(slot.first[c])
        if self.players:
            if starting.size:
                drawn = np.searchsorted(self.shares, self.rng.random(starting.size), side="right")
                scripted = drawn < len(self.players)  # beyond the shares: the pool's
                player_of[starting] = np.where(scripted, drawn, -1)
                copy_of[starting[scripted]] = -1
                starting = starting[~scripted]
            for board in np.flatnonzero(player_of >= 0):
                self._scripted_move(slot, c[board], boards.start + board, self.players[player_of[board]])
        if starting.size and self.pool:
            copy_of[starting] = -1  # their games ended: their copies may take another version
            for board in starting:
                copy_of[board] = self._copy_for(draw(self.cfg.pool, self.pool, self.scores, self.rng))
        versioned = copy_of >= 0
        if self.stacked is None:
            for held in np.unique(copy_of[versioned]):
                held_cols = c[copy_of == held]
                action, info = self.copies[held][0](slot.observation[held_cols], env_index[held_cols],
                                                    slot.first[held_cols], slot.reward[held_cols], env_steps,
                                                    envs_total)
                slot.action[held_cols] = action
                slot.agent_info[held_cols] = info
        elif versioned.any():
            rows = c[versioned]
            action, info = self.stacked([act for act, _ in self.copies], tuple(self.loaded), copy_of[versioned],
                                        slot.observation[rows], env_index[rows], slot.first[rows], slot.reward[rows],
                                        env_steps, envs_total)
            slot.action[rows] = action
            slot.agent_info[rows] = info

    def _scripted_move(self, slot, column: int, board: int, player) -> None:
        """The scripted player's move in ``slot``'s column ``column`` where it is the opponent's
        turn on the sampler's board ``board`` (elsewhere the column waits: the pass stays)."""
        game = self.game_of(board)
        if game.agents and game.agent_selection == game.possible_agents[self.columns[board] % 2]:
            slot.action[column] = player(game, self.rng)

    def _copy_for(self, version: int) -> int:
        """The copy that holds ``version``, loading it where none does; where it cannot be loaded
        (its file left the pool meanwhile, or does not fit: logged), a copy of another version
        still in play, else -1."""
        if version in self.loaded:
            return self.loaded.index(version)
        busy = set(self.copy_of[self.copy_of >= 0].tolist())
        free = [i for i in range(len(self.copies)) if i not in busy]
        # A copy of a version that left the pool goes first: no draw would ask for it again.
        free.sort(key=lambda i: self.loaded[i] in self.pool)
        if not free and len(self.copies) < self.cfg.size:
            self.copies.append(self.make_copy())
            self.loaded.append(-1)
            if len(self.copies) == 1 and self.stack is not None:
                self.stacked = self.stack(self.copies[0][0])
            free = [len(self.copies) - 1]
        if free and self.files.load(version, self.copies[free[0]][1]):
            self.loaded[free[0]] = version
            return free[0]
        return int(self.rng.choice(sorted(busy))) if busy else -1


class ServedWithOpponent:
    """ActionSource of a server-inference sampler that plays against the pool: the action-server
    answers every column with the current policy, as it does without a pool (it holds no past
    version and its wire knows no seats); once a group's actions are in its slot, the opponent
    seat overwrites its columns' (``Opponent.act``), as ``LocalActions`` does after its own
    forward pass. With two env groups one group's opponent acts while the other's request is
    at the action-server."""

    def __init__(self, served, opponent: Opponent, sampler, steps, envs_total: int):
        """``served``: the action-server's ActionSource (``transport.RemoteActions``); ``steps``:
        the run's env steps (``shared.transport.params.AnnouncedSteps``: ``poll``, ``env_steps``,
        ``close``), which a Q agent's exploration follows."""
        self.served, self.opponent, self.steps, self.envs_total = served, opponent, steps, envs_total
        self.slots, self.groups = sampler.slots, sampler.groups
        self.env_index = [np.arange(g.start, g.stop) + sampler.env_base for g in sampler.groups]

    def request(self, group: int) -> None:
        self.served.request(group)

    def wait(self, group: int) -> int:
        version = self.served.wait(group)
        self.steps.poll()
        self.opponent.act(self.slots[group], self.groups[group], self.env_index[group], self.steps.env_steps,
                          self.envs_total)
        return version

    def close(self) -> None:
        self.steps.close()
        self.served.close()
