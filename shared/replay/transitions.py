"""Transition storage: items are n-step transitions, one per (step, env column) of a ``ColumnRing``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.data.batches import Transition, WindowSteps
from shared.data.namedarraytuple import leaves, map_leaves, spec_field, with_leading_dims
from shared.replay.arena import HEAP, Arena, Cells
from shared.replay.nstep import nstep_targets
from shared.replay.ring import RingStorage
from shared.replay.storage import F32, NO_KEYS, StorageConfig, check_dest, take_into


@dataclass(frozen=True)
class TransitionStorageConfig:
    """What a transition is (its size is the ``StorageConfig``'s)."""
    n_step: int = 1
    """Off-policy: rewards summed per transition before bootstrapping."""
    gamma: float = 0.99
    """Off-policy: discount per step used for n-step returns."""
    store_steps: bool = False
    """Transitions (uniform, prioritized): a batch also carries each step of its n-step window
    (Transition.steps: WindowSteps [n, n_step] of observation, action, reward and discount of every
    step, docs/extending.md), for corrections at every step rather than the first; n_step times the
    observation bytes a batch. Nothing more is stored: the steps are gathered from the ring at sample time."""
    final_frames: int = 0
    """frame_store: final-observation frames kept for done steps; 0 = capacity // 32 (at least
    one segment's steps). When they wrap, items bootstrapping from a dropped one leave early."""


def transition_batch_spec(step_spec, n: int, window: int = 0) -> Any:
    """Spec of a Transition batch of ``n`` items for steps laid out as ``step_spec`` (Samples),
    with ``steps`` WindowSteps [n, window] if ``window`` (the n-step length), else None."""
    obs = with_leading_dims(spec_field(step_spec, "observation"), [n])
    scalar = {"dtype": F32, "shape": [n]}
    steps = None
    if window:
        per_step = {"observation": spec_field(step_spec, "observation"), "action": spec_field(step_spec, "action"),
                    "reward": {"dtype": F32, "shape": []}, "discount": {"dtype": F32, "shape": []}}
        steps = with_leading_dims({"type": "WindowSteps", "fields": [[f, per_step[f]] for f in WindowSteps._fields]},
                                  [n, window])
    by_field = {
        "observation": obs,
        "action": with_leading_dims(spec_field(step_spec, "action"), [n]),
        "return_": scalar,
        "bootstrap_observation": obs,
        "bootstrap_discount": scalar,
        "is_weight": scalar,
        "policy_version": with_leading_dims(spec_field(step_spec, "policy_version"), [n]),
        "steps": steps,
    }
    return {"type": "Transition", "fields": [[f, by_field[f]] for f in Transition._fields]}


class TransitionStorage(RingStorage):
    """Items are n-step transitions, one per (step, env column), keyed as in ``ColumnRing``.

    n-step targets are computed once, when the steps they need arrive (nstep.py): an item
    becomes live when observation[t + n] is written or a done inside [t, t + n) closes its
    window, so the newest n steps of each writer wait for the next segment. The return,
    discount and the key of the bootstrap observation are kept per key; a sample gathers
    observation, action and bootstrap observation from the ring. A live item's bootstrap
    step is never older than its own, so it is overwritten no earlier than the item.

    Writer restarts (``reset_writer``) are seams: items of the last n steps before a seam
    that no done had closed never become live, since their windows would cross it.

    Memory: the whole Samples structure is stored per step, final_observation included
    (it is only valid on done steps), unless ``storage.frame_store``: then the ring keeps one
    frame per step and final frames of done steps only, and rebuilds the stacks (frames.py);
    an item becomes live only if its stacks rebuild exactly, and leaves when the final frame
    it bootstraps from is dropped.
    """

    def __init__(
        self,
        segment_spec,
        columns_per_writer: dict[int, int],
        storage: StorageConfig = StorageConfig(),
        config: TransitionStorageConfig = TransitionStorageConfig(),
        arena: Arena = HEAP,
    ):
        """segment_spec: spec of a Samples segment (leaves lead with [T, B]; B is ignored,
        ``columns_per_writer`` gives each writer's). arena: where the state lives
        (shared/replay/arena.py: shared memory that outlives the process, or the heap)."""
        if config.n_step < 1 or not 0 <= config.gamma <= 1:
            raise ValueError(f"TransitionStorageConfig: need n_step >= 1 and 0 <= gamma <= 1, got {config}")
        super().__init__(segment_spec, columns_per_writer, storage, config.n_step, "TransitionStorageConfig.n_step",
                         arena, config.final_frames or storage.capacity // 32)
        for name in ("observation", "action", "reward", "terminated", "truncated",
                     "final_observation", "policy_version", "failed"):
            spec_field(self.step_spec, name)
        self.config = config
        self.return_ = arena.array("return", self.num_slots, np.float32)
        self.discount = arena.array("discount", self.num_slots, np.float32)
        self.bootstrap_key = arena.array("bootstrap_key", self.num_slots, np.int64)
        self.bootstrap_final = arena.array("bootstrap_final", self.num_slots, bool)
        # frame_store: items never made live because a stack did not rebuild exactly (the K - 1
        # steps after a seam that cut an episode; all episode starts if the padding is not
        # FrameStackObservation's "reset"), and items dropped with a final frame.
        self.counts = Cells(arena, "transitions", unrebuilt=0, final_frame_evictions=0)

    def metrics(self) -> dict[str, float]:
        return {"frames_unrebuilt_items": float(self.counts.unrebuilt),
                "final_frame_evictions": float(self.counts.final_frame_evictions)}

    def make_batch_spec(self, n: int) -> Any:
        return transition_batch_spec(self.step_spec, n, self.config.n_step if self.config.store_steps else 0)

    def items_per_write(self, writer_id: int) -> int:
        return self.T * self.ring.width(writer_id)

    def write(self, writer_id: int, samples, bootstrap_value=None, bootstrap_observation=None) -> tuple[np.ndarray, np.ndarray]:
        """Append one segment [T, B_w] (T <= rows - n_step); the segment's bootstrap is unused
        here (n-step transitions bootstrap from the observations they store)."""
        ring, n = self.ring, self.config.n_step
        self.check_write(writer_id, samples)
        s0 = ring.written[writer_id]
        k_old = min(n, s0 - ring.traj_start[writer_id])  # earlier steps whose items may be pending
        old = {f: ring.read(writer_id, f, s0 - k_old, s0) for f in ("reward", "terminated", "truncated", "failed")}
        overwritten, lost_final = ring.write(writer_id, samples)
        if lost_final.size:
            lost = self._bootstrapping_from_final(lost_final)
            self.counts.final_frame_evictions += lost.size
            overwritten = np.union1d(overwritten, lost)

        window = {f: np.concatenate([old[f], getattr(samples, f)]) for f in old}
        tg = nstep_targets(window["reward"], window["terminated"], window["truncated"], n, self.config.gamma,
                           window["failed"])
        new = tg.complete & tg.valid  # a failed env step is no transition: never an item
        old_done = window["terminated"][:k_old] | window["truncated"][:k_old]
        new[:k_old] &= ~np.logical_or.accumulate(old_done[::-1], axis=0)[::-1]  # live already

        j, b = np.nonzero(new)  # time-major, so a Fifo sees items in step order
        steps = s0 - k_old + j
        cols = ring.offsets[writer_id] + b
        keys = (steps % ring.rows) * ring.B_total + cols
        boot_keys = ((steps + tg.bootstrap_offset[j, b]) % ring.rows) * ring.B_total + cols
        from_final = tg.from_final[j, b]
        # Only items whose observations the ring returns exactly (always true without frame_store).
        ok = ring.observation_ok(keys) & np.where(from_final, ring.final_observation_ok(boot_keys),
                                                   ring.observation_ok(boot_keys))
        self.counts.unrebuilt += int(ok.size - ok.sum())
        keys, j, b, boot_keys, from_final = keys[ok], j[ok], b[ok], boot_keys[ok], from_final[ok]
        self.return_[keys] = tg.return_[j, b]
        self.discount[keys] = tg.discount[j, b]
        self.bootstrap_key[keys] = boot_keys
        self.bootstrap_final[keys] = from_final
        return overwritten, keys.astype(np.int64)

    def _bootstrapping_from_final(self, done_keys: np.ndarray) -> np.ndarray:
        """Keys of the items (live or not) that bootstrap from the final observation of
        ``done_keys``: they can only be the n steps up to each done step, in its column."""
        rows, B = self.ring.rows, self.ring.B_total
        back = np.arange(self.config.n_step, dtype=np.int64)[None, :] * B
        cand = ((done_keys[:, None] - back) % (rows * B)).reshape(-1)
        owner = np.repeat(done_keys, self.config.n_step)
        return cand[self.bootstrap_final[cand] & (self.bootstrap_key[cand] == owner)]

    def restore(self, live: np.ndarray) -> np.ndarray:
        """frame_store: live items whose final frame a torn write took."""
        if self.ring.frames is None:
            return NO_KEYS
        keys = np.flatnonzero(live & self.bootstrap_final)
        return keys[~self.ring.frames.owns_final(self.bootstrap_key[keys])]

    def check_dest(self, dest, n: int) -> None:
        check_dest(dest, self.batch_spec(n), "destination Transition batch")

    def gather(self, keys: np.ndarray, is_weights: np.ndarray, dest) -> None:
        ring, flat = self.ring, self.ring.flat
        ring.gather_observation(keys, dest.observation)
        take_into(dest.action, flat.action, keys)
        np.take(self.return_, keys, out=dest.return_)
        np.take(self.discount, keys, out=dest.bootstrap_discount)
        dest.is_weight[:] = is_weights
        np.take(flat.policy_version, keys, axis=0, out=dest.policy_version)
        boot = self.bootstrap_key[keys]
        ring.gather_observation(boot, dest.bootstrap_observation)
        final = np.flatnonzero(self.bootstrap_final[keys])  # done steps: rare, patch them
        if final.size:
            patch = map_leaves(lambda d: np.empty((final.size, *d.shape[1:]), d.dtype), dest.bootstrap_observation)
            ring.gather_final_observation(boot[final], patch)
            dest.bootstrap_observation[final] = patch
        if dest.steps is not None:
            self._gather_steps(keys, dest.steps)

    def _gather_steps(self, keys: np.ndarray, dest) -> None:
        """dest (WindowSteps [len(keys), n_step]) = the steps of each item's window: its m steps
        (the rewards its return sums; m follows from where it bootstraps), zeros after them."""
        ring, rows, B, n = self.ring, self.ring.rows, self.ring.B_total, self.config.n_step
        offset = (self.bootstrap_key[keys] - keys) // B % rows  # same column: a whole number of rows
        m = offset + self.bootstrap_final[keys]  # a done at step m - 1 bootstraps from its final observation
        inside = np.arange(n)[None, :] < m[:, None]  # [N, n]
        i, k = np.nonzero(inside)
        step_keys = (keys[i] + k * B) % self.num_slots
        for _, leaf in leaves(dest):
            leaf[~inside] = 0
        dest.discount[i, k] = self.config.gamma ** k  # float64, as nstep_targets sums
        dest.reward[i, k] = ring.flat.reward[step_keys]

        def empty(d):
            return np.empty((step_keys.size, *d.shape[2:]), d.dtype)

        observation, action = map_leaves(empty, dest.observation), map_leaves(empty, dest.action)
        ring.gather_observation(step_keys, observation)
        take_into(action, ring.flat.action, step_keys)
        dest.observation[i, k] = observation
        dest.action[i, k] = action
