"""Monitoring against a real Prometheus server: it scrapes a live run's metrics endpoint with
the settings of deploy/prometheus.yml, and every expression of every panel of
deploy/grafana/rlpipe.json parses and returns data through Prometheus's query API;
`promtool check metrics` accepts the endpoint's page.

Prometheus is Debian's `prometheus` package (`.ci/run` installs it); where it is missing,
the fixture installs it with apt-get if this machine allows, and skips saying why if not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from shared.runtime.metrics import PHASES
from tests.pipeline import check_time_split, free_port, label_values
from tests.test_deploy import DASHBOARD, PROMETHEUS

pytestmark = pytest.mark.learning
SCRAPE_S = 1


@pytest.fixture(scope="session")
def prometheus_bin() -> tuple[str, str]:
    """(prometheus, promtool) executables; installed with apt-get when missing and possible."""
    def found():
        return shutil.which("prometheus"), shutil.which("promtool")

    if not all(found()):
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            pytest.skip("prometheus/promtool are not installed and apt-get cannot install them here "
                        "(needs root and apt-get): apt-get install prometheus")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (["apt-get", "install", "-y", "-q", "prometheus"], ["apt-get", "update", "-q"],
                        ["apt-get", "install", "-y", "-q", "prometheus"]):
            out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
            if command[1] == "install" and out.returncode == 0:
                break
        if not all(found()):
            last = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
            pytest.skip(f"apt-get install prometheus failed: {last[0]}")
    return found()


def scrape_config(*metrics_ports: int) -> str:
    """deploy/prometheus.yml aimed at the runs' endpoints, scraping every SCRAPE_S seconds."""
    text = PROMETHEUS.read_text()
    targets = ", ".join(f'"127.0.0.1:{port}"' for port in metrics_ports)
    for old, new in (('targets: ["127.0.0.1:9108"]', f"targets: [{targets}]"),
                     ("scrape_interval: 5s", f"scrape_interval: {SCRAPE_S}s"),
                     ("scrape_timeout: 4s", f"scrape_timeout: {SCRAPE_S}s")):
        assert text.count(old) == 1, f"deploy/prometheus.yml no longer has {old!r}"
        text = text.replace(old, new)
    return text


class Prometheus:
    """A Prometheus server on a free loopback port, storing into ``directory``."""

    def __init__(self, binary: str, directory: Path, config: str):
        (directory / "prometheus.yml").write_text(config)
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (directory / "prometheus.log").open("w")
        self.proc = subprocess.Popen([binary, f"--config.file={directory / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={directory / 'data'}",
                                      f"--web.listen-address={self.url.removeprefix('http://')}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self.ready():
            assert self.proc.poll() is None, f"prometheus exited: {(directory / 'prometheus.log').read_text()[-2000:]}"
            assert time.monotonic() < deadline, "prometheus did not become ready within 60 s"
            time.sleep(0.2)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> list:
        """The result of an instant query (a vector's samples, or a scalar as a one-element list);
        AssertionError naming the expression if Prometheus rejects it."""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}",
                                        timeout=5) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        assert body["status"] == "success", f"{expr}: {body.get('errorType')}: {body.get('error')}"
        data = body["data"]
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def panel_expressions() -> list[tuple[str, str]]:
    """(panel title, expression) of every target of every panel of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def test_prometheus_scrapes_a_live_run_and_every_panel_returns_data(runs, prometheus_bin, tmp_path):
    """A tic-tac-toe run with an action-server and the evaluator (whose games against the opponents
    feed the two-player panel), and one against a self-play pool with local inference (it feeds the
    pool's panels; tests/test_selfplay_pool.py runs a pool with server inference), so that every
    panel has something to show."""
    prometheus, promtool = prometheus_bin
    endless = ("run.target_return=1000.0", "run.max_env_steps=100000000", "run.max_wall_s=300.0")
    run = runs("tictactoe_ppo.toml", "sampler.inference=server", "eval.every_s=2.0", "eval.episodes=4", *endless)
    pool = runs("tictactoe_ppo.toml", "sampler.inference=local", "selfplay.pool='latest'",
                "selfplay.snapshot_every=2", "eval.every_s=0", *endless)
    server = Prometheus(prometheus, tmp_path, scrape_config(run.metrics_port, pool.metrics_port))
    try:
        run.wait_for(lambda: len(server.query('up{job="rlpipe"} == 1')) == 2, 30, "Prometheus to scrape the runs")
        assert {r["metric"]["instance"] for r in server.query('up{job="rlpipe"} == 1')} == {
            f"127.0.0.1:{run.metrics_port}", f"127.0.0.1:{pool.metrics_port}"}

        exprs = panel_expressions()
        assert len(exprs) > 60
        empty = exprs
        # rate() and increase() need two scrapes, the eval panel an evaluation, the pool's a scored game
        deadline = time.monotonic() + 120
        while empty and time.monotonic() < deadline:
            empty = [(title, expr) for title, expr in exprs if not server.query(expr)]
            time.sleep(SCRAPE_S)
        assert not empty, f"panel expressions without data after 120 s: {empty}"
        # A pool version's Elo series leaves the endpoint with the version: the pool's 8 at most, the first gone.
        def versions_shown() -> set[int]:
            return {int(v) for v in label_values(pool.metrics(), "rlpipe_learner_pool_version_elo", "version")}
        pool.wait_for(lambda: 0 < min(versions_shown(), default=0) and len(versions_shown()) <= 8, 60,
                      "version 0's Elo to leave the endpoint with it")
        # The evaluator's numbers went through Prometheus as the endpoint shows them.
        assert server.query("max(rlpipe_evaluator_policy_version) >= 0")
        # Every phase of every service's time split is there (the row's panels sum over them),
        # and the split adds up to each process's wall time.
        for service, phases in PHASES.items():
            found = server.query(f"sum by (phase) (rlpipe_{service}_phase_seconds_total)")
            assert {r["metric"]["phase"] for r in found} == set(phases), (service, found)
        status = check_time_split(run)
        assert re.search(r"bottleneck: \w+ \(\w+ \d+%\)", status), status
        assert all(f"  {service} " in status for service in ("sampler", "action_server", "replay", "learner")), status

        page = run.metrics()
        check = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        server.close()
    assert server.proc.returncode == 0, (tmp_path / "prometheus.log").read_text()[-2000:]
