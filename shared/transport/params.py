"""Parameter versions in shared memory: the learner writes, action-servers and samplers read.

The segment holds two copies of the agent's state_dict (every tensor a leaf with its own
dtype) and, per copy, a seqlock pair ``stamp[i] = (version written before, after)`` and the
run's env steps at that version (epsilon schedules follow them). The learner writes
version v into copy v % 2 and then announces v; a reader copies copy v % 2 and keeps it
only if both stamps equal v before and after the copy, so a torn read (the learner already
overwriting with v + 2) is detected instead of silently used.

Action-servers learn of versions from the learner's announcements (``ParamAnnouncements``);
local-inference samplers look at the stamps themselves before every step
(``ParamFollower``: two int64 reads, no message, no syscall). ``newest_stamp`` reads only the
stamps: the newest version's env steps, for a process that loads no version.

A reader loads versions into a torch module's state (any device), or into ``StateArrays``:
numpy arrays of its own, for a sampler that acts in numpy and never imports torch (this
module does not import it).

A consumer on another node than the learner (``[placement]``) cannot map the segment: the
learner then also publishes every version's arrays as frames (``params_data``), and
``ParamStream`` follows those.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from shared.transport import shm
from shared.data.namedarraytuple import leaves, namedarraytuple, spec_of, validate_spec, with_leading_dims
from shared.runtime.retry import worth_logging

log = logging.getLogger(__name__)
ParamSlot = namedarraytuple("ParamSlot", ["stamp", "env_steps", "tensors"])


def field_name(key: str) -> str:
    """The segment's field for state_dict entry ``key``."""
    return "p_" + key.replace(".", "__")


def state_spec(module):
    """Spec of ParamSlot for a torch ``module``'s state_dict, with a leading copy dimension of 2."""
    state = module.state_dict()
    cls = namedarraytuple("State", [field_name(k) for k in state])
    example = ParamSlot(np.zeros(2, np.int64), np.int64(0), cls(*(t.detach().cpu().numpy() for t in state.values())))
    return with_leading_dims(spec_of(example), [2])


class ParamWriter:
    """Owner side (learner): ``write(version)`` copies the module's state into the segment."""

    def __init__(self, module, segment_name: str):
        self.module = module
        spec = state_spec(module)
        self.previous_version = _stale_version(segment_name, spec)
        self.segment, self.slots, self.descriptor = shm.allocate(segment_name, spec)
        self.slots.stamp[:] = -1

    def write(self, version: int, env_steps: int = 0) -> None:
        i = version % 2
        stamp = self.slots.stamp[i]
        stamp[0] = version
        # Index each leaf here: self.slots[i] would turn 0-d entries (num_batches_tracked) into copies.
        for (_, arr), t in zip(leaves(self.slots.tensors), self.module.state_dict().values()):
            arr[i] = t.detach().cpu().numpy()
        self.slots.env_steps[i] = env_steps
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


class ModuleState:
    """Load target: a torch module's state_dict tensors, overwritten in place (on any device)."""

    def __init__(self, module) -> None:
        import torch  # only processes that hold a torch module get here

        self.spec = state_spec(module)
        self.tensors = list(module.state_dict().values())  # detached, sharing the parameters' storage
        self.from_numpy = torch.from_numpy

    def load(self, staged: list[np.ndarray]) -> None:
        for t, arr in zip(self.tensors, staged):  # the staged copies are ours: wrapped, not copied again
            t.copy_(self.from_numpy(arr))


class StateArrays:
    """Load target without torch: one numpy array per state entry, by segment field (``arrays``),
    for the layout ``spec`` the learner published (``shared.agents.acting.read_acting_file``)."""

    def __init__(self, spec) -> None:
        validate_spec(spec, "parameter segment spec")
        self.spec = spec
        self.arrays = {f: np.zeros(leaf["shape"][1:], np.dtype(leaf["dtype"])) for f, leaf in state_fields(spec)}

    def load(self, staged: list[np.ndarray]) -> None:
        for arr, new in zip(self.arrays.values(), staged):
            np.copyto(arr, new)


def state_fields(spec) -> list:
    """[(field, leaf spec)] of the state entries in a (validated) ParamSlot spec."""
    state = dict((spec or {}).get("fields") or [])
    fields = (state.get("tensors") or {}).get("fields")
    if (spec or {}).get("type") != "ParamSlot" or fields is None or \
            not all("shape" in leaf and leaf["shape"][:1] == [2] for _, leaf in fields):
        raise ValueError("not the layout of a parameter segment (ParamSlot with two copies of a state)")
    return fields


class ParamReader:
    """Peer side: ``read(version, descriptor)`` loads a published version into ``target``
    (a torch module, or ``StateArrays``) from a segment of ``owner`` (the run's learner).

    ``version`` and ``env_steps`` are those of the last version loaded (-1 and 0 before any).
    """

    def __init__(self, target, owner: shm.Owner):
        self.state = target if isinstance(target, StateArrays) else ModuleState(target)
        self.owner = owner
        self.segment = None
        self.nonce = None
        self.slots = None
        self.version = -1
        self.env_steps = 0

    def read(self, version: int, descriptor: dict) -> bool:
        """Load ``version``; False if the copy was torn or stale (a newer one follows)."""
        if descriptor.get("nonce") != self.nonce:
            self.attach(descriptor)
        read = _seqlocked(self.slots, version, lambda i: (
            [np.array(arr[i]) for _, arr in leaves(self.slots.tensors)],  # copies; 0-d stays an array
            int(self.slots.env_steps[i])))
        if read is None:
            return False
        staged, env_steps = read
        self.state.load(staged)
        self.version, self.env_steps = version, env_steps
        return True

    def close(self) -> None:
        if self.segment is not None:
            self.slots = None
            self.segment.close()
            self.segment = None

    def attach(self, descriptor: dict) -> None:
        # Check before attaching, so a rejected descriptor leaves the current segment in use.
        if descriptor.get("spec") != self.state.spec:
            raise ValueError(f"parameter segment {descriptor.get('name')} does not match this agent's state_dict "
                             "(was the learner started with another config?)")
        if self.segment is not None:
            self.segment.close()
        self.segment, self.slots = shm.attach(descriptor, self.owner)
        self.nonce = descriptor.get("nonce")
        self.version = -1  # a restarted learner's segment: take whatever version it holds


def _seqlocked(slots, version: int, read):
    """``read(i)`` of copy ``i = version % 2`` of a segment's ``slots``, or None where that copy
    does not hold ``version`` all through the read (not written yet, or being overwritten with
    version + 2)."""
    stamp = slots.stamp[version % 2]
    if stamp[1] != version:
        return None
    value = read(version % 2)
    return value if stamp[0] == version else None


def newest_stamp(segment_name: str, spec, owner: shm.Owner) -> tuple[int, int] | None:
    """(version, env steps) of the newest complete version in the learner's parameter segment
    ``segment_name`` (layout ``spec``, owned by ``owner``), from its stamps alone: no copy of the
    state is made or read. For a process that wants the run's env steps where it starts but acts
    with no version of the learner's. None while the segment does not exist or holds no complete
    version; ValueError where it is not the segment ``spec`` describes (or not yet its size: a
    learner creating it)."""
    try:
        seg, slots = shm.attach({"name": segment_name, "spec": spec}, owner)
    except FileNotFoundError:
        return None
    try:
        version = int(slots.stamp[:, 1].max())
        env_steps = _seqlocked(slots, version, lambda i: int(slots.env_steps[i])) if version >= 0 else None
        return None if env_steps is None else (version, env_steps)
    finally:
        del slots  # the segment's arrays go before it is unmapped
        seg.close()


class _ThroughReader:
    """A follower that loads versions with a ``ParamReader`` (``self.reader``): the version
    and env steps held are the reader's."""

    reader: ParamReader

    @property
    def version(self) -> int:
        return self.reader.version

    @property
    def env_steps(self) -> int:
        return self.reader.env_steps


class ParamAnnouncements(_ThroughReader):
    """Follows the learner's announcements (``params`` on ``sub``, a SUB endpoint subscribed
    to that type: a version and its segment's descriptor): ``poll()`` takes what has come,
    without blocking, and loads the newest version announced (a ``ParamReader`` on
    ``target``, ``owner``). A restarted learner (its segment has a new nonce) may number on
    from below the version held: its announcements count as newer."""

    def __init__(self, target, sub, owner: shm.Owner):
        self.reader = ParamReader(target, owner)
        self.sub = sub
        self.failed = 0

    def poll(self) -> bool:
        """Load the newest version announced since the last poll; True if one was loaded."""
        latest = None
        for _, msg in self.sub.drain():
            if msg.type == "params" and (msg.body["version"] > self.reader.version
                                         or msg.body["segment"].get("nonce") != self.reader.nonce):
                latest = msg
        if latest is None:
            return False
        try:
            return self.reader.read(latest.body["version"], latest.body["segment"])
        except (ValueError, FileNotFoundError) as e:
            self.failed += 1
            if worth_logging(self.failed):  # announced with every update: a log that cannot flood
                log.warning("cannot load parameters version %d (%d failed loads so far): %s", latest.body["version"],
                            self.failed, e)
            return False

    def close(self) -> None:
        self.reader.close()
        self.sub.close()


class AnnouncedSteps:
    """The run's env steps as the learner announces them with each version (``params`` on ``sub``,
    a SUB endpoint subscribed to that type), no version loaded: for a sampler whose action-server
    acts for the current policy while its self-play opponent, acting in the sampler, explores by
    the run's steps (a Q agent's epsilon). ``env_steps``: the steps to hold until the first
    announcement comes (the run's, read where the sampler starts: its parameter segment's)."""

    def __init__(self, sub, env_steps: int = 0):
        self.sub = sub
        self.env_steps = env_steps

    def poll(self) -> bool:
        """Take the steps of the newest announcement since the last poll, without blocking; True if one came."""
        steps = [msg.body["env_steps"] for _, msg in self.sub.drain() if msg.type == "params"]
        if steps:
            self.env_steps = steps[-1]  # a restarted learner counts on from its checkpoint: the last one sent wins
        return bool(steps)

    def close(self) -> None:
        self.sub.close()


class ParamFollower(_ThroughReader):
    """Follows the newest version in a learner's parameter segment by name, without messages.

    ``poll()`` (every step of a local-inference sampler) compares the segment's stamps with
    the version held and loads a newer one. Until the learner's segment exists the target
    keeps its own parameters; every ``recheck_s`` the segment's inode is compared with the
    attached one, so a learner that restarted (and recreated its segment) is followed again.
    """

    def __init__(self, target, segment_name: str, owner: shm.Owner, recheck_s: float = 1.0):
        """``target``: as ``ParamReader``'s."""
        self.reader = ParamReader(target, owner)
        self.descriptor = {"name": segment_name, "nonce": None, "spec": self.reader.state.spec}
        self.recheck_s = recheck_s
        self.t_check = -float("inf")
        self.failed = 0

    def poll(self) -> bool:
        """Load the newest complete version if it is newer than the one held; True if loaded."""
        now = time.monotonic()
        if now - self.t_check >= self.recheck_s:
            self.t_check = now
            ino = shm.inode(self.descriptor["name"])
            if ino is not None and (self.reader.segment is None or ino != self.reader.segment.inode):
                try:
                    self.reader.attach(self.descriptor)  # first sight, or a restarted learner's new segment
                except FileNotFoundError:  # gone between stat and open: the next recheck finds the new one
                    return False
                except ValueError as e:  # not the segment it should be: keep the parameters held, look again later
                    self.failed += 1
                    if worth_logging(self.failed):
                        log.warning("cannot follow the learner's parameters (%d tries so far, every %g s): %s",
                                    self.failed, self.recheck_s, e)
                    return False
        if self.reader.slots is None:
            return False
        newest = int(self.reader.slots.stamp[:, 1].max())
        return newest > self.reader.version and self.reader.read(newest, self.descriptor)

    def close(self) -> None:
        self.reader.close()


class ParamStream:
    """Follows the versions that arrive as frames (``params_data`` on ``sub``, a SUB endpoint
    subscribed to that type): ``poll()`` takes what has come, without blocking, and loads the
    newest into ``target`` (as ``ParamReader``'s). Arrays that do not fit the state's layout
    are counted bad (``sub.on_bad``) and skipped."""

    def __init__(self, target, sub):
        self.state = target if isinstance(target, StateArrays) else ModuleState(target)
        self.layout = [(tuple(leaf["shape"][1:]), np.dtype(leaf["dtype"])) for _, leaf in state_fields(self.state.spec)]
        self.sub = sub
        self.version = -1
        self.env_steps = 0

    def poll(self) -> bool:
        """Load the newest version that came since the last poll; True if one was loaded."""
        latest = None
        for _, msg in self.sub.drain():
            if msg.type == "params_data":
                latest = msg  # a restarted learner numbers on from its checkpoint: the last one sent wins
        if latest is None:
            return False
        arrays = latest.arrays
        if [(a.shape, a.dtype) for a in arrays] != self.layout:
            log.warning("parameters version %d came with arrays that do not fit this agent's state; skipped",
                        latest.body["version"])
            self.sub.on_bad("value")
            return False
        self.state.load([np.array(a) for a in arrays])  # our own copies: the frames' buffers are read-only
        self.version, self.env_steps = latest.body["version"], latest.body["env_steps"]
        return True

    def close(self) -> None:
        self.sub.close()
