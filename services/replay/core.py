"""The replay core: a table and the books it keeps for the learner's next batch.

The replay service and serial mode both move segments into the table and batches out of it
through this, so the two modes keep the same books: env steps and finished episodes the
inserted segments brought, items dropped for policy lag, observation moments
(``model.normalize_observations``), and, for prioritized tables, the keys the learner sends
priorities back for.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from shared.data.obs_stats import NO_MOMENTS, Moments
from shared.replay.tables import Table
from shared.transport.wire import MAX_EPISODES

log = logging.getLogger(__name__)

MAX_UNREPORTED_EPISODES = MAX_EPISODES
"""Finished episodes held for the learner's next batch: the most one reply carries. More come
only while the learner is away (or asks less often than episodes end); the oldest go, counted."""


class ReplayCore:
    def __init__(self, table: Table, observation_moments: bool = False,
                 on_episodes_dropped: Callable[[int], None] = lambda n: None):
        """``observation_moments``: sum up inserted observations for the learner's normaliser;
        ``on_episodes_dropped(n)``: told when n finished episodes go unreported (a metric)."""
        self.table = table
        self.observation_moments = observation_moments
        self.on_episodes_dropped = on_episodes_dropped
        self.moments: Moments | None = None  # made at the first insert, from the observations' shape
        self.steps = 0
        self.episodes: list = []
        self.dropped = 0
        self.episodes_dropped = 0  # finished episodes never reported: more than MAX_UNREPORTED_EPISODES waited

    def insert(self, writer_id: int, segment, steps: int, episodes: list, serial: int | None = None) -> np.ndarray:
        """Copy ``segment`` (OnPolicyBatch, samples [T, B_w]) of ``writer_id`` into the table and
        book its ``steps`` env steps and ``episodes`` ([return, length] each); the keys of the
        items it made samplable. ``serial``: the writer's number for the segment (None: not
        numbered); one that does not follow the last inserted is a seam, since the segments
        between were lost and no n-step window may span the gap."""
        if serial is not None and serial != self.table.last_serial(writer_id) + 1:
            self.table.reset_writer(writer_id)
        keys = self.table.insert(writer_id, segment.samples, segment.bootstrap_value, segment.bootstrap_observation,
                                 serial=serial)
        self.steps += steps
        self._hold_episodes(episodes)
        if self.observation_moments:
            if self.moments is None:
                self.moments = Moments(segment.samples.observation.shape[2:])
            self.moments.add(segment.samples.observation)
        return keys

    def sample(self, dest, n: int, min_version: int, lag_bound: bool):
        """One learner request: drop items past the on-policy lag bound (``lag_bound``), then
        fill ``dest`` with ``n`` items if the table can serve them now. Returns (sample info
        or None, keys dropped for lag)."""
        table = self.table
        dropped = table.drop_older_than(min_version) if lag_bound else np.empty(0, np.int64)
        self.dropped += len(dropped)
        if not table.can_sample(n):
            return None, dropped
        return table.sample_into(dest, n), dropped

    def report(self) -> dict:
        """What the next batch reply tells the learner (env_steps, episodes, dropped, replay_size,
        observation moments), taken off the books."""
        meta = {"env_steps": self.steps, "episodes": self.episodes, "dropped": self.dropped,
                "replay_size": self.table.size, **(NO_MOMENTS if self.moments is None else self.moments.take())}
        self.steps, self.episodes, self.dropped = 0, [], 0
        return meta

    def priority_keys(self, info: dict) -> dict:
        """The keys and generations of a sample, for the learner to send priorities back with;
        nothing where the table keeps no priorities."""
        if not self.table.selector.prioritized:
            return {}
        return {"keys": info["keys"], "generations": info["generations"]}

    def _hold_episodes(self, episodes: list) -> None:
        self.episodes.extend(episodes)
        excess = len(self.episodes) - MAX_UNREPORTED_EPISODES
        if excess <= 0:
            return
        del self.episodes[:excess]
        before, self.episodes_dropped = self.episodes_dropped, self.episodes_dropped + excess
        self.on_episodes_dropped(excess)
        if before.bit_length() != self.episodes_dropped.bit_length():  # at each power of two: a log that cannot flood
            log.warning("%d finished episodes not reported to the learner so far: more ended before its next batch "
                        "than one reply carries (%d); the oldest went", self.episodes_dropped, MAX_UNREPORTED_EPISODES)
