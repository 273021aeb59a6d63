"""A run directory says which code made it, on which host, with which command (meta.json)."""

from __future__ import annotations

import subprocess

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
