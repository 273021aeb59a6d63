"""Retry loops pause (doubling, capped) and give up after their bound; the evaluator's failed
evaluations are one such loop."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.evaluator import __main__ as evaluator
from shared.runtime.retry import Backoff, worth_logging


def test_backoff_doubles_up_to_its_cap_and_is_spent_after_its_bound(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("shared.runtime.retry.time.monotonic", lambda: now[0])
    b = Backoff(0.5, 2.0, give_up_s=10.0, max_failures=6)
    assert [b.fail() for _ in range(4)] == [0.5, 1.0, 2.0, 2.0] and not b.spent()
    b.fail(), b.fail()
    assert b.spent()  # six failures in a row
    b.reset()
    assert b.fail() == 0.5 and not b.spent()
    now[0] += 10.0
    assert b.spent()  # ten seconds without a success
    assert [n for n in range(1, 20) if worth_logging(n)] == [1, 2, 4, 8, 16] and not worth_logging(0)


def test_the_evaluator_pauses_after_a_failed_evaluation_and_gives_up_with_the_error():
    counted = []
    m = SimpleNamespace(failures=SimpleNamespace(inc=lambda: counted.append(1)))
    failures = Backoff(evaluator.FAILURE_PAUSE_S, 8 * evaluator.FAILURE_PAUSE_S, max_failures=evaluator.MAX_FAILURES)
    error = ValueError("env exploded")
    pauses = [evaluator.evaluation_failed(failures, error, 7, m) for _ in range(evaluator.MAX_FAILURES - 1)]
    assert pauses == [min(evaluator.FAILURE_PAUSE_S * 2 ** i, 8 * evaluator.FAILURE_PAUSE_S)
                      for i in range(evaluator.MAX_FAILURES - 1)]
    with pytest.raises(RuntimeError, match="version 7 failed 5 times in a row, last: ValueError: env exploded"):
        evaluator.evaluation_failed(failures, error, 7, m)
    assert len(counted) == evaluator.MAX_FAILURES
