"""Parameter versions in shared memory: the learner writes, action-servers read.

The segment holds two copies of the agent's state_dict (every tensor a leaf with its own
dtype) and, per copy, a seqlock pair ``stamp[i] = (version written before, after)``. The
learner writes version v into copy v % 2 and then announces v; a reader copies copy v % 2
and keeps it only if both stamps equal v before and after the copy, so a torn read (the
learner already overwriting with v + 2) is detected instead of silently used.
"""

from __future__ import annotations

import numpy as np
import torch

from shared import shm
from shared.namedarraytuple import leaves, namedarraytuple, spec_of, with_leading_dims

ParamSlot = namedarraytuple("ParamSlot", ["stamp", "tensors"])


def _field(key: str) -> str:
    return "p_" + key.replace(".", "__")


def state_spec(module: torch.nn.Module):
    """Spec of ParamSlot for ``module``'s state_dict, with a leading copy dimension of 2."""
    state = module.state_dict()
    cls = namedarraytuple("State", [_field(k) for k in state])
    example = ParamSlot(np.zeros(2, np.int64), cls(*(t.detach().cpu().numpy() for t in state.values())))
    return with_leading_dims(spec_of(example), [2])


class ParamWriter:
    """Owner side (learner): ``write(version)`` copies the module's state into the segment."""

    def __init__(self, module: torch.nn.Module, segment_name: str):
        self.module = module
        spec = state_spec(module)
        self.previous_version = _stale_version(segment_name, spec)
        self.segment, self.slots, self.descriptor = shm.allocate(segment_name, spec)
        self.slots.stamp[:] = -1

    def write(self, version: int) -> None:
        i = version % 2
        stamp = self.slots.stamp[i]
        stamp[0] = version
        # Index each leaf here: self.slots[i] would turn 0-d entries (num_batches_tracked) into copies.
        for (_, arr), t in zip(leaves(self.slots.tensors), self.module.state_dict().values()):
            arr[i] = t.detach().cpu().numpy()
        stamp[1] = version

    def close(self) -> None:
        self.segment.unlink()
        self.segment.close()


def _stale_version(name: str, spec) -> int:
    """Newest version a crashed predecessor published in segment ``name`` (-1 if none).

    A learner restarted after ``kill -9`` resumes from its last checkpoint, but it may have
    published later versions before it died; numbering on from the highest keeps versions
    increasing for every reader and every stamp in replay.
    """
    try:
        seg, slots = shm.attach({"name": name, "spec": spec}, None)  # our own name
    except (FileNotFoundError, ValueError):
        return -1
    version = int(slots.stamp.max())
    del slots
    seg.close()
    return version


class ParamReader:
    """Peer side (action-server): ``read(version, descriptor)`` loads a published version
    from a segment of ``owner`` (the run's learner)."""

    def __init__(self, module: torch.nn.Module, owner: shm.Owner):
        self.module, self.owner = module, owner
        self.segment = None
        self.nonce = None
        self.slots = None

    def read(self, version: int, descriptor: dict) -> bool:
        """Load ``version`` into the module; False if the copy was torn or stale (a newer one follows)."""
        if descriptor.get("nonce") != self.nonce:
            self._attach(descriptor)
        i = version % 2
        stamp = self.slots.stamp[i]
        if stamp[1] != version:
            return False
        staged = [np.array(arr[i]) for _, arr in leaves(self.slots.tensors)]  # copies; 0-d stays an array
        if stamp[0] != version:
            return False
        with torch.no_grad():
            for t, arr in zip(self.module.state_dict().values(), staged):
                t.copy_(torch.from_numpy(arr))
        return True

    def _attach(self, descriptor: dict) -> None:
        # Check before attaching, so a rejected descriptor leaves the current segment in use.
        if descriptor.get("spec") != state_spec(self.module):
            raise ValueError(f"parameter segment {descriptor.get('name')} does not match this agent's state_dict "
                             "(was the learner started with another config?)")
        if self.segment is not None:
            self.segment.close()
        self.segment, self.slots = shm.attach(descriptor, self.owner)
        self.nonce = descriptor.get("nonce")
