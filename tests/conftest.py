"""Fixtures shared by all tests (keep them generic), and the `live` marker."""

import uuid

import pytest

from shared.transport import shm

LIVE_HELPERS = "tests.pipeline"
"""The module of the helpers that start real runs and processes."""


def pytest_collection_modifyitems(config, items):
    """Mark ``live`` every test that starts real runs or processes: it uses the ``runs`` fixture,
    or its module uses ``tests.pipeline``'s functions or classes. ``make test-fast`` leaves them
    (and the learning checks) out."""
    for item in items:
        module = getattr(item, "module", None)
        uses_helpers = module is not None and any(
            getattr(value, "__module__", None) == LIVE_HELPERS for value in vars(module).values())
        if uses_helpers or "runs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.live)


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
