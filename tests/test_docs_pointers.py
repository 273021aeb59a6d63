"""Every pointer into docs/benchmarks.md resolves: a docstring, comment or config that names
one of its sections (the file's name, a comma, the heading in double quotes) names a heading
the page has, and a markdown link to ``benchmarks.md#anchor`` (or, inside the page, ``#anchor``)
names one of its headings' anchors. The page is rewritten as results move; a pointer left
behind would send a reader to nothing."""

from __future__ import annotations

import re
from pathlib import Path

from tests.pipeline import REPO

PAGE = REPO / "docs" / "benchmarks.md"
# A name, or several joined by "and" or commas; a quote may wrap onto a comment's next line.
NAMED = re.compile(r'benchmarks\.md,\s*("[^"]+"(?:\s*(?:and|,)\s*"[^"]+")*)')


def sources() -> list[Path]:
    paths = {p for pattern in ("shared/**/*.py", "services/**/*.py", "tests/**/*.py", "deploy/**/*.toml", "*.md",
                               "docs/*.md") for p in REPO.glob(pattern)}
    return sorted(paths - {Path(__file__).resolve()})


def headings(page: str) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", page, re.M)}


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def pointers(text: str, in_page: bool = False) -> list[tuple[str, str]]:
    """(kind, target) of every pointer into the page in ``text``: kind "heading" or "anchor"."""
    text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)  # join wrapped comments and docstrings
    found = [("heading", q) for m in NAMED.finditer(text) for q in re.findall(r'"([^"]+)"', m.group(1))]
    found += [("anchor", a) for a in re.findall(r"benchmarks\.md#([\w\-]+)", text)]
    if in_page:
        found += [("anchor", a) for a in re.findall(r"\]\(#([\w\-]+)\)", text)]
    return found


def dangling(found: list[tuple[str, str]], page: str) -> list[tuple[str, str]]:
    names = headings(page)
    anchors = {anchor(h) for h in names}
    return [(kind, target) for kind, target in found if target not in (names if kind == "heading" else anchors)]


def test_every_pointer_names_a_heading_the_page_has():
    page = PAGE.read_text()
    found = {str(p.relative_to(REPO)): pointers(p.read_text(), p == PAGE) for p in sources()}
    assert sum(kind == "heading" for f in found.values() for kind, _ in f) >= 20  # the scan sees the code's
    missing = {f: d for f, ptrs in found.items() if (d := dangling(ptrs, page))}
    assert not missing, f"pointers into docs/benchmarks.md without a heading there: {missing}"


def test_a_pointer_to_a_heading_that_went_is_found():
    page = "# Benchmarks\n\n## Sampling throughput\n\n### Server inference on a CPU\n"
    comment = ('x = 1  # faster (docs/benchmarks.md, "Sampling\n      # throughput" and "Issue 6 again"); see\n'
               "[there](docs/benchmarks.md#server-inference-on-a-cpu), [gone](docs/benchmarks.md#issue-6)")
    assert pointers(comment) == [("heading", "Sampling throughput"), ("heading", "Issue 6 again"),
                                 ("anchor", "server-inference-on-a-cpu"), ("anchor", "issue-6")]
    assert dangling(pointers(comment), page) == [("heading", "Issue 6 again"), ("anchor", "issue-6")]
