"""Where a run came from: the code's commit, the host, the command and the date, written once
into its directory (``meta.json``) when the directory is made, so a results row built later
from the directory alone can say what ran where (``rlpipe results``)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from shared.runtime.runfiles import META

REPO = Path(__file__).resolve().parents[2]


def commit(repo: Path = REPO) -> str:
    """The checkout's commit (12 hex digits, ``+dirty`` with uncommitted changes to tracked
    files), or ``unknown`` outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


VECTOR_ISA = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 with bf16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
"""(/proc/cpuinfo flag, what ``cpu`` calls it), widest first."""


def cpu() -> str:
    """This host's CPU model, the cores this process may use and its widest vector instructions,
    e.g. ``AMD EPYC (2 cores, AVX2)``: hosts of one model name differ in them, and bf16's speed
    with them (docs/benchmarks.md, "Hardware"), so the name alone does not say what ran."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value)  # the first processor's
    except OSError:
        pass
    model = " ".join(info["model name"].split()) if "model name" in info else platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    isa = next((name for flag, name in VECTOR_ISA if flag in flags), None)
    return f"{model} ({len(os.sched_getaffinity(0))} cores{', ' + isa if isa else ''})"


def gpu() -> str:
    """The GPUs ``nvidia-smi`` lists (comma-separated names), or ``none``; no torch import."""
    if not shutil.which("nvidia-smi"):
        return "none"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "none"
    return ", ".join(n.strip() for n in out.splitlines() if n.strip()) or "none"


def record(run_dir: Path) -> dict:
    """Write ``meta.json`` into a new run directory and return it."""
    meta = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(), "cpu": cpu(),
            "gpu": gpu(), "host": platform.node(), "python": platform.python_version(),
            "command": shlex.join(["rlpipe", *sys.argv[1:]]) if Path(sys.argv[0]).name in ("rlpipe", "cli.py")
            else shlex.join(sys.argv)}
    (run_dir / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def read(run_dir: Path) -> dict:
    """A run directory's ``meta.json`` (empty for a run made before runs recorded one)."""
    try:
        return json.loads((Path(run_dir) / META).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
