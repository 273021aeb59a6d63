"""A run directory says which code made it, on which host, with which command (meta.json)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from shared.config import loading
from shared.launch import provenance, rundirs
from tests.pipeline import CONFIGS


def test_a_new_run_directory_records_its_commit_host_and_command(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr("sys.argv", ["/somewhere/bin/rlpipe", "launch", "my config.toml", "--set", "run.seed=3"])
    exp = loading.load(CONFIGS / "cartpole_ppo.toml", [f"run.runs_dir='{tmp_path / 'runs'}'"])
    meta = provenance.read(rundirs.make_run_dir(exp))
    head = subprocess.run(["git", "-C", str(provenance.REPO), "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert meta["commit"].removesuffix("+dirty") == head
    assert meta["command"] == "rlpipe launch 'my config.toml' --set run.seed=3"
    assert "cores" in meta["cpu"] and meta["gpu"] and meta["created"].startswith("20")


def test_a_directory_outside_git_or_without_meta_reads_as_unknown(tmp_path):
    assert provenance.commit(tmp_path) == "unknown"
    assert provenance.read(tmp_path) == {}


def test_the_cpu_names_its_model_cores_and_widest_vector_instructions():
    """Two hosts named "AMD EPYC" differed by AVX-512 with bf16 against AVX2 (bf16 0.64x against 15x
    fp32's time): the row's hardware says which, as /proc/cpuinfo's first processor has them."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("needs /proc/cpuinfo")
    first = {key.strip(): value for key, value in (line.split(":", 1) for line in
                                                   cpuinfo.read_text().split("\n\n")[0].splitlines() if ":" in line)}
    if "model name" not in first:
        pytest.skip("no model name in /proc/cpuinfo (not x86)")
    flags = set(first.get("flags", "").split())
    text = provenance.cpu()
    assert text.startswith(f"{' '.join(first['model name'].split())} ({len(os.sched_getaffinity(0))} cores")
    assert ("AMX" in text) == ("amx_bf16" in flags)
    assert ("bf16" in text) == ("avx512_bf16" in flags and "amx_bf16" not in flags)
    assert ("AVX-512" in text) == ("avx512f" in flags and "amx_bf16" not in flags)
    assert text.endswith(", AVX2)") == ("avx2" in flags and not {"avx512f", "amx_bf16"} & flags)
