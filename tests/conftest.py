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
    _longest_modules_first(items)


def _longest_modules_first(items):
    """Order the modules learning checks first, then live tests, then the unit tier (each module's
    tests keep their order). ``make test`` hands whole modules to two pytest-xdist workers in this
    order (``--dist loadscope``), so the long modules start early and the many short unit modules
    fill the end, instead of one worker finishing a learning check alone."""
    def rank(item):
        return 0 if item.get_closest_marker("learning") else 1 if item.get_closest_marker("live") else 2

    module_rank = {}
    for item in items:
        key = item.nodeid.split("::")[0]
        module_rank[key] = min(module_rank.get(key, 2), rank(item))
    items.sort(key=lambda item: module_rank[item.nodeid.split("::")[0]])


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
