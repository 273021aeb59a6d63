"""Files of the run directory written whole or not at all, and durably where a rename publishes them.

A full disk (ENOSPC, EDQUOT) is an OSError from these functions with the file as it was
before: a CSV row is appended whole or truncated away; a file published by a rename is
fsynced, then renamed, then its directory fsynced, so that a crash (or a power cut) leaves
the previous copy or the new one, never a name pointing at data that is not on the disk.
``WriteErrors`` is how a service reports such a failure: logged (once a minute a file),
counted, and tried again at the next interval.
"""

from __future__ import annotations

import csv
import errno
import io
import logging
import os
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)


def append_csv(path: Path, fields: list[str], row: dict) -> None:
    """Append ``row`` to the CSV file ``path`` (columns ``fields``), header first if the file is
    new or empty: one ``write``, and a short one (the disk filled up within the row) is
    truncated away before the OSError is raised. One process appends to each of a run's CSV
    files (progress.csv: the learner; eval.csv: the evaluator), so rows never interleave."""
    _match_header(path, fields)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        size = os.fstat(fd).st_size
        text = io.StringIO()
        writer = csv.DictWriter(text, fields)
        if size == 0:
            writer.writeheader()
        writer.writerow(row)
        data = text.getvalue().encode()
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, f"{path}: short write ({os.strerror(errno.ENOSPC)})")
        except OSError:
            os.ftruncate(fd, size)  # nothing of the row stays: the next row starts on a line of its own
            raise
    finally:
        os.close(fd)


def _match_header(path: Path, fields: list[str]) -> None:
    """Give an existing CSV file ``fields`` as its header where it has other columns (a run
    resumed by code that writes a column more): its rows are rewritten under the new header,
    a new column empty in them, in a file that replaces the old one whole. Without this the
    rows appended after the resume would have more fields than the header, and ``read_csv``
    would leave every one of them out."""
    try:
        with open(path, errors="replace") as f:
            first = f.readline()  # the header alone on every append: the whole file only to rewrite it
            if not first.endswith("\n") or next(csv.reader([first])) == list(fields):
                return
            text = first + f.read()
    except FileNotFoundError:
        return
    lines = list(csv.reader(io.StringIO(text[:text.rfind("\n") + 1])))
    # Rows a writer with the new columns already appended under the old header are read by them.
    rows = [dict(zip(fields if len(line) == len(fields) else lines[0], line)) for line in lines[1:]
            if len(line) in (len(lines[0]), len(fields))]
    text = io.StringIO()
    writer = csv.DictWriter(text, fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(text.getvalue())
    os.replace(tmp, path)


def read_csv(path: Path) -> list[dict]:
    """The rows of CSV file ``path`` as dicts of strings ([] if there is none), whole lines only:
    a row being appended right now, or one cut short by an older writer, is left out."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    text = text[:text.rfind("\n") + 1]
    return [row for row in csv.DictReader(io.StringIO(text)) if None not in row and None not in row.values()]


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, path: Path) -> None:
    """Rename the written file (or directory of files) ``tmp`` over ``path``, durably: its data
    first, then the rename, then the directory that holds the new name."""
    for f in (tmp.iterdir() if tmp.is_dir() else [tmp]):
        fsync_file(f)
    if tmp.is_dir():
        fsync_dir(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def out_of_space(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class WriteErrors:
    """How a service reports a file it could not write: ``failed(what, error)`` logs it (the first
    time, then at most once a minute per ``what``) and calls ``count(what)``; ``ok(what)`` logs
    that writing works again. The caller tries again at its next interval."""

    LOG_EVERY_S = 60.0

    def __init__(self, count: Callable[[str], None] = lambda what: None):
        self.count = count
        self.failing: dict[str, tuple[int, float]] = {}  # what -> (failures, last logged at)

    def failed(self, what: str, error: OSError) -> None:
        self.count(what)
        n, logged = self.failing.get(what, (0, -self.LOG_EVERY_S))
        now = time.monotonic()
        if now - logged >= self.LOG_EVERY_S:
            hint = " (disk full: free space in the run directory)" if out_of_space(error) else ""
            log.error("cannot write the %s%s: %s; tried again later, the service goes on (%d failure(s) so far)",
                      what, hint, error, n + 1)
            logged = now
        self.failing[what] = (n + 1, logged)

    def ok(self, what: str) -> None:
        if what in self.failing:
            log.warning("the %s is written again after %d failure(s)", what, self.failing.pop(what)[0])
