"""Helpers for tests that launch real runs: supervisord, the services, the metrics endpoint."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from shared import launch

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "deploy" / "configs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rlpipe(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``rlpipe ARGS`` from this checkout; its services import this checkout too (and tests' envs)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


class Run:
    """A run directory and what tests ask of it; ``close()`` cleans it up whatever happened."""

    def __init__(self, run_dir: Path, metrics_port: int | None = None):
        self.dir, self.id, self.metrics_port = Path(run_dir), Path(run_dir).name, metrics_port

    @classmethod
    def launch(cls, tmp_path: Path, config: str, *overrides: str) -> "Run":
        """``rlpipe launch CONFIG --detach`` with runs under tmp_path and a free metrics port."""
        port = free_port()
        args = ["launch", str(CONFIGS / config), "--detach"]
        for s in (f"run.runs_dir='{tmp_path / 'runs'}'", f"network.metrics_port={port}", *overrides):
            args += ["--set", s]
        out = rlpipe(*args)
        assert out.returncode == 0, out.stdout + out.stderr
        return cls(Path(re.search(r"run directory: (\S+)", out.stdout).group(1)), port)

    def progress(self) -> list[dict]:
        return launch.read_progress(self.dir)

    def wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs(tail=3000)}")

    def wait_steps(self, steps: int, timeout: float = 120) -> None:
        self.wait_for(lambda: any(int(r["env_steps"]) >= steps for r in self.progress()), timeout,
                      f"{steps} env steps")

    def wait_result(self, timeout: float) -> dict:
        return self.wait_for(lambda: launch.read_result(self.dir), timeout, "the run's result")

    def status(self) -> dict[str, tuple[str, int | None]]:
        """Process name -> (state, pid) from supervisorctl."""
        out = launch.supervisorctl(self.dir, "status", capture=True).stdout
        procs = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 2:
                pid = re.search(r"pid (\d+)", line)
                procs[parts[0].split(":")[-1]] = (parts[1], int(pid.group(1)) if pid else None)
        return procs

    def pid(self, name: str) -> int:
        state, pid = self.wait_for(lambda: self.status().get(name) if self.status().get(name, ("", None))[1] else None,
                                   30, f"{name} to run")
        return pid

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def logs(self, service: str = "", tail: int | None = None) -> str:
        return "\n".join(p.name + ":\n" + p.read_text(errors="replace")[-(tail or 0):]
                         for p in sorted((self.dir / "logs").glob(f"{service}*.log")))

    def segments(self) -> list[str]:
        return [p.name for p in Path("/dev/shm").glob(f"rlpipe-{self.id}-*")]

    def close(self) -> None:
        launch.clean(self.dir)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def maps_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's shared library mapped (it imported torch)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def instances(metrics_text: str, name: str) -> set[str]:
    """The instance labels of the samples of metric ``name`` in a Prometheus text page."""
    return set(re.findall(rf'^{name}{{[^}}]*instance="(\d+)"', metrics_text, re.M))


def metric_value(page: str, name: str) -> float:
    """Sum of the samples of metric ``name`` on a Prometheus text page."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))
