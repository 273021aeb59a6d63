"""A two-player game whose state cannot be copied (``env.id = "pettingzoo:tests.uncopyable_game_for_tests"``):
tic-tac-toe holding a lock, for the heuristic player's one-line refusal."""

from __future__ import annotations

import threading

from pettingzoo.classic import tictactoe_v3
from pettingzoo.utils import BaseWrapper


class Locked(BaseWrapper):
    """A game holding a lock, which cannot be copied."""

    def __init__(self, env):
        super().__init__(env)
        self.lock = threading.Lock()


def env(**kwargs):
    return Locked(tictactoe_v3.env(**kwargs))
