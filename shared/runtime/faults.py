"""Fault injection for tests: die by SIGKILL at a named point of the code.

``RLPIPE_FAULT=<point>:<n>`` in a process's environment kills it the n-th time it passes
``point(<point>)`` (1-based), as ``kill -9`` would at that instant: no cleanup, no atexit.
Tests use it to cut an operation in the middle (e.g. ``replay.insert``: a segment copied
into the replay table but its items not yet made samplable). Unset, ``point`` is one dict
lookup.
"""

from __future__ import annotations

import os
import signal

_armed: dict[str, int] = {}
_spec = os.environ.get("RLPIPE_FAULT", "")
if _spec:
    _name, _, _count = _spec.rpartition(":")
    if not _name or not _count.isdigit() or int(_count) < 1:
        raise ValueError(f"RLPIPE_FAULT={_spec!r}: expected <point>:<n>, e.g. replay.insert:3")
    _armed[_name] = int(_count)


def point(name: str) -> None:
    """Die here by SIGKILL if ``RLPIPE_FAULT`` armed ``name`` and this is its n-th pass."""
    left = _armed.get(name)
    if left is None:
        return
    if left > 1:
        _armed[name] = left - 1
        return
    os.kill(os.getpid(), signal.SIGKILL)
