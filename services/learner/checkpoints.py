"""The learner's checkpoints: the latest and the one before it, each written atomically.

A latest checkpoint that cannot be loaded (truncated by a full disk, say) is reported and
the previous one is used.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from shared.runtime import heartbeat
from shared.runtime.files import fsync_dir
from shared.runtime.runfiles import CHECKPOINT, PREVIOUS_CHECKPOINT

log = logging.getLogger("services.learner.learner")


class Unloadable(RuntimeError):
    """Neither checkpoint of the run can be loaded; str() names both files and why."""


class Checkpoints:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir

    def save(self, state: dict) -> None:
        """``state`` (tensors and plain values) as the latest checkpoint; the latest so far
        becomes the previous one. OSError (a full disk) with the checkpoints as they were."""
        path = self.run_dir / CHECKPOINT
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        try:
            with tmp.open("wb") as f:  # a file, not a path: a full disk is then an OSError, not torch's RuntimeError
                torch.save(state, heartbeat.BeatingWriter(f))  # a large model's save is progress, not a hang
                f.flush()
                os.fsync(f.fileno())  # on the disk before a name points at it
        except (OSError, RuntimeError) as e:
            # torch's zip writer wraps the file's OSError in a RuntimeError of its own as it closes
            error = e if isinstance(e, OSError) else e.__context__
            if not isinstance(error, OSError):
                raise
            tmp.unlink(missing_ok=True)  # the space it took goes back; the checkpoints so far stay
            raise error from None
        if path.exists():
            os.replace(path, self.run_dir / PREVIOUS_CHECKPOINT)  # a crash right after: load() takes previous.pt
        os.replace(tmp, path)  # atomic: a kill mid-write leaves the previous checkpoints intact
        fsync_dir(path.parent)

    def load(self, device: torch.device, apply) -> Path | None:
        """``apply(state)`` with the latest checkpoint's state, or the previous one's where the
        latest cannot be loaded or applied; the file used, or None if there is none.
        Unloadable naming both files if neither works."""
        paths = [p for p in (self.run_dir / CHECKPOINT, self.run_dir / PREVIOUS_CHECKPOINT) if p.exists()]
        errors = []
        for path in paths:
            try:
                apply(torch.load(path, map_location=device, weights_only=True))
            except Exception as e:  # truncated zip, unpickling error, missing key, shape mismatch...
                errors.append(f"{path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                log.warning("cannot resume from %s (%s); trying the previous checkpoint", path, errors[-1])
                continue
            return path
        if errors:
            raise Unloadable("no checkpoint of this run can be loaded (" + "; ".join(errors) +
                             "); move them away to start the learner afresh")
        return None
