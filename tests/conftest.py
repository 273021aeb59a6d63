"""Fixtures shared by all tests (keep them generic)."""

import uuid

import pytest

from shared import shm


@pytest.fixture
def run_id() -> str:
    """A fresh run id; the test fails if it leaves any ``rlpipe-<run_id>-*`` segment in /dev/shm."""
    rid = "t" + uuid.uuid4().hex[:8]
    yield rid
    left = shm.clean(rid)
    assert not left, f"test left shared-memory segments behind: {left}"
