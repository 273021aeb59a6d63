"""docs/benchmarks.md's generated rows are what `rlpipe results` makes of the run records kept
in docs/runs: a row typed or edited by hand, or a record changed after its row was written,
fails here (`rlpipe results docs/runs --into docs/benchmarks.md` writes them again)."""

from __future__ import annotations

from shared.launch.lab import results, runs
from tests.pipeline import REPO

DOC = REPO / "docs" / "benchmarks.md"
RECORDS = REPO / "docs" / "runs"


def test_the_generated_rows_equal_what_the_kept_run_records_give():
    dirs = runs.find_runs(RECORDS)
    assert dirs, "docs/runs holds no run record"
    assert results.section(DOC) == results.markdown(results.rows(dirs))


def test_kept_records_hold_no_secret_checkpoint_or_log():
    kept = {p.name for p in RECORDS.rglob("*") if p.is_file()}
    assert kept <= {*results.RECORD, "grid.json"}, kept - {*results.RECORD, "grid.json"}
