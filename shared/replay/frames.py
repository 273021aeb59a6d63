"""Frame stacks kept one frame per step: the part a ``ColumnRing(frame_stack=True)`` injects.

An Atari observation is a rolling stack ``[K, H, W]`` uint8 (gymnasium's
FrameStackObservation, newest frame last): step t's stack is the newest frames of steps
t-K+1..t, where steps before the episode's first are replaced by that first frame (the
wrapper's default ``padding_type="reset"``). Storing every stack costs K frames a step,
plus K more for ``final_observation``; this part stores each step's newest frame once and
rebuilds stacks at sample time from

- ``frames [rows, B, H, W]``: the newest frame of each step's observation;
- ``back [rows, B]``: how many earlier frames of the same episode step t's stack holds
  (min(t - episode start, K - 1)); frame j of the stack (j = 0 oldest) is the newest frame of
  step t - min(K - 1 - j, back). An episode starts after a done step and at the first step
  after a writer seam;
- ``final_frames [F, H, W]``: a ring of the newest frame of ``final_observation`` for done
  steps only (``final_slot [rows, B]`` points into it, -1 for none). final_observation at a
  done step d is observation[d] shifted by one frame, plus that final frame.

The ring keeps K - 1 rows beyond the rows items live in, so a live step's oldest frames are
never overwritten. When ``final_frames`` wraps, the done steps whose final frame it drops
are reported (``write`` returns them) so that the items bootstrapping from them leave the
table. Nothing is assumed blindly: ``write`` rebuilds every new stack and compares it with
the one the env produced; ``stack_ok`` / ``final_ok`` record the result, and a storage makes
live only items whose stacks match (after a seam that cut an episode, the K - 1 steps whose
earlier frames replay never saw do not match and are skipped).
"""

from __future__ import annotations


import numpy as np

from shared.data.namedarraytuple import spec_nbytes
from shared.replay.arena import HEAP, Arena, Cells

_U8 = np.dtype(np.uint8).str


def frame_stack_shape(observation_spec, where: str = "replay.frame_store") -> tuple[int, int, int]:
    """(K, H, W) of an observation spec that is one [K, H, W] uint8 array; ValueError otherwise."""
    if observation_spec is None or "fields" in observation_spec:
        kind = "no observation" if observation_spec is None else "a structure of arrays"
        raise ValueError(f"{where}: needs observations that are one [K, H, W] uint8 frame stack (Atari "
                         f"with frame stacking), got {kind}; set it to false for this env")
    shape, dtype = list(observation_spec["shape"]), observation_spec["dtype"]
    if len(shape) != 3 or np.dtype(dtype) != np.uint8 or min(shape) < 1:
        raise ValueError(f"{where}: needs observations that are one [K, H, W] uint8 frame stack (Atari "
                         f"with frame stacking), got dtype {np.dtype(dtype)} shape {shape}; set it to false "
                         "for this env")
    return int(shape[0]), int(shape[1]), int(shape[2])


class FrameStacks:
    """Newest frames, stack lengths and final frames of a ring of ``rows`` x ``B`` steps.

    Keys are ``row * B + column`` as in ColumnRing. All methods take keys [n] int64 and are
    vectorised over them.
    """

    def __init__(self, K: int, H: int, W: int, rows: int, B: int, final_slots: int, arena: Arena = HEAP):
        """final_slots: F, how many final frames are kept (>= the done steps of one write).
        arena: where the arrays live (shared/replay/arena.py)."""
        if final_slots < 1:
            raise ValueError(f"FrameStacks: final_slots must be >= 1, got {final_slots}")
        self.K, self.H, self.W, self.rows, self.B, self.F = K, H, W, rows, B, final_slots
        self.spec = {"type": "FrameStackData", "fields": [
            ["frames", {"dtype": _U8, "shape": [rows, B, H, W]}],
            ["back", {"dtype": _U8, "shape": [rows, B]}],
            ["stack_ok", {"dtype": np.dtype(bool).str, "shape": [rows, B]}],
            ["final_ok", {"dtype": np.dtype(bool).str, "shape": [rows, B]}],
            ["final_slot", {"dtype": np.dtype(np.int32).str, "shape": [rows, B]}],
            ["final_frames", {"dtype": _U8, "shape": [final_slots, H, W]}],
            ["final_owner", {"dtype": np.dtype(np.int64).str, "shape": [final_slots]}],
        ]}
        self.data = arena.tree("frames", self.spec, fill=False)  # frames: no pass over gigabytes
        n = rows * B
        self.frames = self.data.frames.reshape(n, H, W)
        self.back = self.data.back.reshape(n)
        self.stack_ok = self.data.stack_ok.reshape(n)
        self.final_ok = self.data.final_ok.reshape(n)
        self.final_slot = self.data.final_slot.reshape(n)
        if not arena.restored:
            self.stack_ok[:] = False
            self.final_ok[:] = False
            self.final_slot[:] = -1
            self.data.final_owner[:] = -1
        self.cursor = Cells(arena, "frames.cursor", final=0)  # the next final-frame slot
        # Offsets back in time of stack frames j = 0..K-1 before clamping to the episode start.
        self._offsets = np.arange(K - 1, -1, -1, dtype=np.int64)

    @property
    def nbytes(self) -> int:
        return spec_nbytes(self.spec)

    def owns_final(self, keys: np.ndarray) -> np.ndarray:
        """bool [n]: done steps ``keys`` still hold a final frame that is theirs."""
        slot = self.final_slot[keys]
        return self.final_ok[keys] & (slot >= 0) & (self.data.final_owner[np.maximum(slot, 0)] == keys)

    def frame_keys(self, keys: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Keys [n, len(offsets)] of the frames ``offsets`` steps back (clamped to each step's
        episode start) in the columns of ``keys`` [n]."""
        keys = np.asarray(keys, dtype=np.int64)
        back = np.minimum(offsets[None, :], self.back[keys].astype(np.int64)[:, None])
        # row - back wraps modulo rows: key - back * B, taken modulo rows * B, stays in the column
        return (keys[:, None] - back * self.B) % (self.rows * self.B)

    def gather_stacks(self, keys: np.ndarray, out: np.ndarray) -> None:
        """out [n, K, H, W] = the observation stacks of steps ``keys`` [n]."""
        idx = self.frame_keys(keys, self._offsets)
        if out.flags.c_contiguous:
            np.take(self.frames, idx.reshape(-1), axis=0, out=out.reshape(-1, self.H, self.W))
        else:
            out[...] = self.frames[idx]

    def gather_final_stacks(self, keys: np.ndarray, out: np.ndarray) -> None:
        """out [n, K, H, W] = the final_observation stacks of done steps ``keys`` [n]: the
        step's own stack shifted by one frame, then its final frame. Keys without a final frame
        (check ``final_ok``) get whatever the slot -1 holds."""
        keys = np.asarray(keys, dtype=np.int64)
        if self.K > 1:
            out[:, : self.K - 1] = self.frames[self.frame_keys(keys, self._offsets[1:])]
        out[:, self.K - 1] = self.data.final_frames[self.final_slot[keys]]

    def write(self, keys: np.ndarray, observation: np.ndarray, final_observation: np.ndarray,
              done: np.ndarray, start: np.ndarray, prev_back: np.ndarray) -> np.ndarray:
        """Store T new steps of B_w columns and check their stacks; return the keys of earlier
        done steps whose final frame was dropped to make room (their items must leave).

        keys [T, B_w]: the steps' keys (consecutive steps of each column); observation and
        final_observation [T, B_w, K, H, W]; done [T, B_w] bool (terminated | truncated);
        start [T, B_w] bool: an episode starts at this step; prev_back [B_w]: ``back`` of each
        column's previous step (used where no start lies before a step inside this write).
        """
        T, Bw = keys.shape
        K = self.K
        t = np.arange(T)[:, None]
        last_start = np.maximum.accumulate(np.where(start, t, -1), axis=0)
        since = np.where(last_start >= 0, t - last_start, prev_back.astype(np.int64)[None, :] + 1 + t)
        flat = keys.reshape(-1)
        obs = observation.reshape(T * Bw, K, self.H, self.W)
        self.frames[flat] = obs[:, K - 1]
        self.back[flat] = np.minimum(since, K - 1).reshape(-1)
        self.final_slot[flat] = -1
        self.final_ok[flat] = False
        if K > 1:  # the newest frame matches by construction; compare the K - 1 older ones
            rebuilt = self.frames[self.frame_keys(flat, self._offsets[:-1])]
            ok = (rebuilt == obs[:, : K - 1]).all(axis=(1, 2, 3))
        else:
            ok = np.ones(T * Bw, dtype=bool)
        self.stack_ok[flat] = ok

        d = np.flatnonzero(done.reshape(-1))
        if d.size > self.F:
            raise ValueError(f"FrameStacks: {d.size} done steps in one write exceed the {self.F} final-frame slots")
        slots = (self.cursor.final + np.arange(d.size)) % self.F
        self.cursor.final = (self.cursor.final + d.size) % self.F
        owners = self.data.final_owner[slots]
        held = owners >= 0
        lost = owners[held][self.final_slot[owners[held]] == slots[held]]
        self.final_slot[lost] = -1
        self.final_ok[lost] = False
        dk = flat[d]
        fin = final_observation.reshape(T * Bw, K, self.H, self.W)[d]
        # The owner before the frame: a kill in between leaves the slot to a step that
        # ``owns_final`` then rejects, never an old owner with a new step's frame.
        self.data.final_owner[slots] = dk
        self.data.final_frames[slots] = fin[:, K - 1]
        self.final_slot[dk] = slots
        shifted = (fin[:, : K - 1] == obs[d, 1:]).all(axis=(1, 2, 3))
        self.final_ok[dk] = ok[d] & shifted
        return lost
