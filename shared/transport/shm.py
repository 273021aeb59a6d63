"""Named POSIX shared-memory segments: the only module that creates and unlinks them.

Segments live in /dev/shm as ``rlpipe-<run_id>-<service><i>-<purpose>``. The owner creates
(removing a stale segment of the same name that a crash left), peers attach by name, the
owner unlinks on exit. We use the files in /dev/shm directly rather than
``multiprocessing.shared_memory``: its resource tracker unlinks segments that a *peer*
merely attached to when that peer exits (Python < 3.13), which breaks named sharing
between unrelated processes.

A segment that holds a namedarraytuple is described by a *descriptor*
``{"name", "nonce", "spec"}``: plain data that travels in messages. The nonce changes every
time the owner (re)creates the segment, so a peer can tell a restarted owner's segment from
the one it attached to before.

A descriptor comes from a socket, so ``attach`` trusts nothing in it: the name must be one
the expected ``Owner`` would give its segment in this run, the file is opened without
following symlinks and must be a regular file of our uid with one link, and its size
must be exactly what the spec needs (spec within ``MAX_SEGMENT_BYTES``, allowed dtypes
and ranks: ``namedarraytuple.validate_spec``). Only then is anything mapped.
"""

from __future__ import annotations

import atexit
import errno
import logging
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from shared.data.namedarraytuple import from_spec, spec_nbytes, validate_spec

SHM_DIR = Path("/dev/shm")
PREFIX = "rlpipe-"
_NAME_RE = re.compile(r"^rlpipe-[A-Za-z0-9_.]+-[A-Za-z0-9_.-]+$")
# No '-' in a run id: it ends the run id in a segment name, so clean("a") cannot take run "a-b"'s.
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_.]+$")
MAX_SEGMENT_BYTES = 1 << 34  # one descriptor's segment (16 GiB): a ring of Atari segments fits

log = logging.getLogger(__name__)
_owned: dict[str, "Segment"] = {}


def segment_name(run_id: str, service: str, instance: int, purpose: str) -> str:
    _check_run_id(run_id)
    return f"{PREFIX}{run_id}-{service}{instance}-{purpose}"


@dataclass(frozen=True)
class Owner:
    """Who must own a segment a descriptor names: service ``service`` of run ``run_id``,
    instance ``instance`` (None: any instance, e.g. the learner's params seen by a reader)."""

    run_id: str
    service: str
    instance: int | None = None

    def check(self, name: str) -> None:
        instance = r"\d+" if self.instance is None else str(int(self.instance))
        pattern = rf"{PREFIX}{re.escape(self.run_id)}-{re.escape(self.service)}{instance}-[A-Za-z0-9_.]+"
        if not re.fullmatch(pattern, name):
            want = f"{PREFIX}{self.run_id}-{self.service}{'<i>' if self.instance is None else self.instance}-<purpose>"
            raise ValueError(f"segment name {name!r:.80} is not {want}: not this run's, or not the sender's own")


class NoSpace(OSError):
    """/dev/shm cannot hold a segment; str() is one line naming the segment, the need and the room."""


def _no_space(name: str, size: int) -> str:
    st = os.statvfs(SHM_DIR)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return (f"shared-memory segment {name} needs {size / 2**20:,.1f} MiB, {SHM_DIR} has {free / 2**20:,.1f} MiB free "
            f"of {total / 2**20:,.1f} MiB: free it (`rlpipe clean` of old runs), give the machine or container a larger "
            "/dev/shm (docker run --shm-size), or make the run smaller (replay.capacity)")


def _check_space(name: str, size: int) -> None:
    """NoSpace before anything is made when /dev/shm's free space is below ``size`` bytes (the
    allocation below catches what a race takes after this look)."""
    st = os.statvfs(SHM_DIR)
    if size > st.f_bavail * st.f_frsize:
        raise NoSpace(_no_space(name, size))


class Segment:
    """One mapped segment. ``owner`` segments are unlinked by ``unlink()`` or at exit."""

    def __init__(self, name: str, fd: int, size: int, owner: bool):
        self.name = name
        self.size = size
        self.owner = owner
        self.inode = os.fstat(fd).st_ino
        self.mmap = mmap.mmap(fd, size)
        os.close(fd)

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        _check_name(name)
        path = SHM_DIR / name
        if path.exists():
            log.warning("removing stale shared-memory segment %s left by an earlier run", name)
            path.unlink()
        _check_space(name, size)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            if size:
                # Backed now: a sparse tmpfs file takes pages at first write, and a write past a
                # full /dev/shm is a SIGBUS that kills the process with no word of the cause.
                os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            path.unlink()
            if e.errno == errno.ENOSPC:
                raise NoSpace(_no_space(name, size)) from None
            raise
        seg = cls(name, fd, size, owner=True)
        _owned[name] = seg
        return seg

    @classmethod
    def attach(cls, name: str) -> "Segment":
        """Map an existing segment: a regular file of our uid with one link, never a symlink."""
        _check_name(name)
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise FileNotFoundError(f"shared-memory segment {name} does not exist (owner gone?)") from None
        except OSError as e:  # ELOOP: a symlink; ENXIO etc.: a fifo or socket
            raise ValueError(f"shared-memory segment {name}: cannot open safely ({e.strerror})") from None
        st = os.fstat(fd)
        problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode) else
                   f"belongs to uid {st.st_uid}, not ours ({os.getuid()})" if st.st_uid != os.getuid() else
                   f"has {st.st_nlink} links (a hard link to another file?)" if st.st_nlink != 1 else None)
        if problem is not None:
            os.close(fd)
            raise ValueError(f"shared-memory segment {name} {problem}: refused")
        return cls(name, fd, st.st_size, owner=False)

    def adopt(self) -> "Segment":
        """Take over a segment whose owner was killed (a restarted service re-attaching its own
        state): from now on ``unlink()`` and the exit remove it, as if this process had made it."""
        self.owner = True
        _owned[self.name] = self
        return self

    def unlink(self) -> None:
        if self.owner:
            _owned.pop(self.name, None)
            try:
                (SHM_DIR / self.name).unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap. Arrays that still view the segment keep the mapping alive until freed."""
        try:
            self.mmap.close()
        except BufferError:
            pass  # numpy views still exist; the mapping goes when they do


def allocate(name: str, spec) -> tuple[Segment, object, dict]:
    """Create segment ``name`` holding ``spec``; return (segment, arrays, descriptor)."""
    seg = Segment.create(name, spec_nbytes(spec))
    tree = from_spec(spec, seg.mmap, fill=True)
    return seg, tree, {"name": name, "nonce": secrets.randbits(48), "spec": spec}


def attach(descriptor: dict, owner: Owner | None) -> tuple[Segment, object]:
    """Attach to the segment a descriptor names, once the name, the file and the spec pass.

    ``owner``: whose segment it must be; None only for a name this process built itself.
    Raises ValueError (or FileNotFoundError) naming what was wrong; nothing stays mapped.
    """
    if not isinstance(descriptor, dict) or not isinstance(descriptor.get("name"), str):
        raise ValueError("descriptor: needs a 'name' (str)")
    if owner is not None:
        owner.check(descriptor["name"])
    validate_spec(descriptor.get("spec"), "descriptor.spec")
    need = spec_nbytes(descriptor["spec"])
    if need > MAX_SEGMENT_BYTES:
        raise ValueError(f"descriptor.spec needs {need} bytes, more than the {MAX_SEGMENT_BYTES}-byte limit")
    seg = Segment.attach(descriptor["name"])
    if seg.size != need:
        seg.close()
        raise ValueError(f"segment {seg.name} has {seg.size} bytes, its spec needs {need}")
    return seg, from_spec(descriptor["spec"], seg.mmap, fill=False)


def attach_all(descriptors: list, owner: Owner | None) -> tuple[list[Segment], list]:
    """Attach several descriptors (e.g. a peer's slots); on any failure close what was attached and raise."""
    segments, trees = [], []
    try:
        for desc in descriptors:
            seg, tree = attach(desc, owner)
            segments.append(seg)
            trees.append(tree)
    except (ValueError, FileNotFoundError):
        for seg in segments:
            seg.close()
        raise
    return segments, trees


def inode(name: str) -> int | None:
    """Inode of segment ``name`` now (None if absent): differs from ``Segment.inode`` once the
    owner has recreated the segment (a restarted process), so a peer knows to attach again."""
    _check_name(name)
    try:
        return os.stat(SHM_DIR / name).st_ino
    except FileNotFoundError:
        return None


def run_segments(run_id: str) -> list[Path]:
    _check_run_id(run_id)
    return sorted(SHM_DIR.glob(f"{PREFIX}{run_id}-*"))


def clean(run_id: str) -> list[str]:
    """Remove every segment of ``run_id`` (what a killed run left). Returns their names."""
    removed = []
    for path in run_segments(run_id):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed


def unlink_all_owned() -> None:
    for seg in list(_owned.values()):
        seg.unlink()


def _check_name(name: str) -> None:
    if not _NAME_RE.match(name) or len(name) > 250:
        raise ValueError(f"bad shared-memory segment name {name!r}: want rlpipe-<run>-<service><i>-<purpose>")


def _check_run_id(run_id: str) -> None:
    if not _RUN_ID_RE.match(run_id):
        raise ValueError(f"bad run id {run_id!r}: use letters, digits, '_' and '.' only")


atexit.register(unlink_all_owned)
