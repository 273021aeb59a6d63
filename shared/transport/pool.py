"""The self-play pool: past parameter versions in the run directory, and how the opponent's is drawn.

The learner adds its policy every ``selfplay.snapshot_every`` updates (and version 0 at the
start) as ``pool/v<version>.npz``: the state's arrays by parameter-segment field
(``shared.transport.params.field_name``), written to a temporary name, synced and renamed, so a
kill leaves whole files only; it keeps the newest ``selfplay.size`` and removes older ones. The
files are the pool's checkpoint: a learner killed and restarted, or a run resumed, finds them
where they were. A sampler lists the folder, draws a version (``draw``) and loads its file into
its second copy of the agent (``load``: ``numpy.load`` with ``allow_pickle=False``; the arrays
must fit the agent's state, or the file is refused), so serving a past version costs no socket
and no pickle.

``pool/scores.json`` (the learner's, written whole with each snapshot and checkpoint) holds the
learner's games against each version (wins, draws, losses from the learner's seat) and Elo
ratings, the learner's and each version's; ``prioritised`` draws from it. This module does not
import torch.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import zipfile
from pathlib import Path

import numpy as np

from shared.runtime.files import publish
from shared.transport.params import state_fields

log = logging.getLogger(__name__)
POOL_DIR = "pool"
SCORES = "scores.json"
_SNAPSHOT = re.compile(r"v(\d{12})\.npz")
ELO_START = 1000.0
ELO_K = 16.0
"""The Elo update's step: a game moves a rating by at most this many points."""
OUTCOMES = ("win", "draw", "loss")


def snapshot_name(version: int) -> str:
    return f"v{version:012d}.npz"


class PoolFiles:
    """The pool folder of one run (``<run>/pool``): snapshots in, versions listed, a version loaded."""

    def __init__(self, run_dir: Path, size: int):
        self.dir, self.size = Path(run_dir) / POOL_DIR, size

    def versions(self) -> list[int]:
        """The versions in the pool, oldest first (at most ``size``: the newest)."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        found = sorted(int(m.group(1)) for m in map(_SNAPSHOT.fullmatch, names) if m)
        return found[-self.size:]

    def add(self, version: int, arrays: dict[str, np.ndarray]) -> None:
        """Write ``arrays`` (state arrays by field) as ``version``'s snapshot and drop the
        snapshots older than the newest ``size``. OSError (a full disk) leaves the pool as it was."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / snapshot_name(version)
        tmp = self.dir / (path.name + ".tmp")
        try:
            with tmp.open("wb") as f:
                np.savez(f, **arrays)
            publish(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        kept = self.versions()
        for name in os.listdir(self.dir):
            m = _SNAPSHOT.fullmatch(name)
            if m and int(m.group(1)) not in kept:
                (self.dir / name).unlink(missing_ok=True)

    def drop_partial(self) -> None:
        """Remove the temporary files of snapshots a killed learner did not finish."""
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)

    def load(self, version: int, target) -> bool:
        """Load ``version``'s snapshot into ``target`` (``params.ModuleState`` or ``StateArrays``:
        ``spec`` and ``load(list)``); False (logged) where it is gone (dropped from the pool
        meanwhile) or does not fit the target's state."""
        fields = state_fields(target.spec)
        try:
            with np.load(self.dir / snapshot_name(version), allow_pickle=False) as z:
                if sorted(z.files) != sorted(f for f, _ in fields):
                    raise ValueError("its arrays are not this agent's state entries")
                staged = []
                for f, leaf in fields:
                    arr = z[f]
                    if list(arr.shape) != list(leaf["shape"][1:]) or arr.dtype != np.dtype(leaf["dtype"]):
                        raise ValueError(f"{f} has shape {arr.shape} {arr.dtype}, not {leaf['shape'][1:]} {leaf['dtype']}")
                    staged.append(arr)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:  # gone, torn by a full disk, not ours
            log.warning("self-play pool: cannot load version %d (%s); the opponent keeps the version it holds",
                        version, e)
            return False
        target.load(staged)
        return True

    # ------------------------------------------------------------ scores

    def read_scores(self) -> dict:
        """``{"learner_elo": x, "versions": {version: {"win", "draw", "loss", "elo"}}}`` as last
        written (empty where there is none or it cannot be read)."""
        try:
            data = json.loads((self.dir / SCORES).read_text())
            versions = {int(v): {k: float(s[k]) for k in (*OUTCOMES, "elo")} for v, s in data["versions"].items()}
            return {"learner_elo": float(data["learner_elo"]), "versions": versions}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def write_scores(self, scores: dict) -> None:
        """``scores`` (``read_scores``' form) as scores.json, whole (OSError: the old one stays)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / (SCORES + ".tmp")
        body = {"learner_elo": scores["learner_elo"], "versions": {str(v): s for v, s in scores["versions"].items()}}
        try:
            tmp.write_text(json.dumps(body, indent=1))
            publish(tmp, self.dir / SCORES)
        finally:
            tmp.unlink(missing_ok=True)


def draw(rule: str, versions: list[int], scores: dict, rng: np.random.Generator) -> int:
    """The opponent's version (``versions``: the pool's, oldest first, not empty) by ``rule``:
    ``latest`` the newest; ``uniform`` any; ``prioritised`` each with weight p^2, p being its score
    against the learner ((losses + draws / 2 + 1) / (games + 2) of the learner's games against
    it), AlphaStar's prioritised fictitious self-play with f(p) = p^2: the versions that still beat
    the learner are drawn most, one it always beats is drawn rarely but never never."""
    if rule == "latest":
        return versions[-1]
    if rule == "uniform":
        return int(rng.choice(versions))
    known = scores.get("versions", {})
    weights = np.array([opponent_score(known.get(v)) ** 2 for v in versions])
    return int(rng.choice(versions, p=weights / weights.sum()))


def opponent_score(record: dict | None) -> float:
    """A version's smoothed score against the learner (a loss of the learner is 1, a draw 1/2)."""
    if not record:
        return 0.5
    games = record["win"] + record["draw"] + record["loss"]
    return (record["loss"] + record["draw"] / 2 + 1) / (games + 2)


class Scores:
    """The learner's games against the pool's versions: counts and Elo ratings (``read_scores``' form)."""

    def __init__(self, saved: dict | None = None):
        saved = saved or {}
        self.learner_elo = saved.get("learner_elo", ELO_START)
        self.versions: dict[int, dict] = dict(saved.get("versions", {}))

    def enter(self, version: int) -> None:
        """A new snapshot starts at the learner's rating (it is the learner, as of now)."""
        self.versions.setdefault(version, {"win": 0.0, "draw": 0.0, "loss": 0.0, "elo": self.learner_elo})

    def keep(self, versions: list[int]) -> None:
        """Forget the versions no longer in the pool."""
        self.versions = {v: s for v, s in self.versions.items() if v in versions}

    def record(self, version: int, learner_return: float) -> str | None:
        """One game of the learner against ``version`` (outcome: the sign of the learner seat's
        return); the outcome, or None for a version the pool no longer holds (counted nowhere)."""
        s = self.versions.get(version)
        if s is None:
            return None
        outcome = "win" if learner_return > 0 else "draw" if learner_return == 0 else "loss"
        s[outcome] += 1
        expected = 1.0 / (1.0 + math.pow(10.0, (s["elo"] - self.learner_elo) / 400.0))
        delta = ELO_K * ({"win": 1.0, "draw": 0.5, "loss": 0.0}[outcome] - expected)
        self.learner_elo += delta
        s["elo"] -= delta
        return outcome

    def state(self) -> dict:
        return {"learner_elo": self.learner_elo, "versions": self.versions}
