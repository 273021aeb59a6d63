"""Fixtures shared by all tests (keep them generic)."""

import uuid

import pytest

from shared.transport import shm


@pytest.fixture
def run_id() -> str:
    """A fresh run id; the test fails if it leaves any ``rlpipe-<run_id>-*`` segment in /dev/shm."""
    rid = "t" + uuid.uuid4().hex[:8]
    yield rid
    left = shm.clean(rid)
    assert not left, f"test left shared-memory segments behind: {left}"


@pytest.fixture
def runs(tmp_path):
    """Start runs with ``runs(config, *overrides)``; every one is cleaned up and must leave no segment."""
    from tests.pipeline import Run

    started = []

    def start(config: str, *overrides: str):
        run = Run.launch(tmp_path, config, *overrides)
        started.append(run)
        return run

    yield start
    for run in started:
        run.close()
        assert run.segments() == [], f"{run.id} left shared memory behind"
