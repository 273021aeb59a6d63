"""The monitoring files in deploy/ match the metrics the services record.

The Grafana dashboard may only query metric names shared.runtime.metrics defines (a renamed metric
must fail here, not show an empty panel); prometheus.yml scrapes the default metrics port;
and the endpoint over prometheus_client's multiprocess files exposes those names, drops a dead
process's `up` gauge, which services.metrics' reap_dead relies on, and the series a live one
removed.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from shared.runtime import metrics
from shared.config.schema import NetworkConfig

try:
    import yaml
except ImportError:  # PyYAML is not a dependency; the line reader below stands in
    yaml = None

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "rlpipe.json"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
METRIC_NAME = re.compile(r"\brlpipe_[a-z0-9_]+")


def exposed_names() -> set[str]:
    """Every sample name the services can expose, derived from shared.runtime.metrics' definitions."""
    names = set()
    for service, defs in metrics._DEFS.items():
        for kind, suffix, *_ in {**metrics._COMMON, **defs}.values():
            name = f"rlpipe_{service}_{suffix}"
            if kind == "histogram":
                names |= {name + "_bucket", name + "_sum", name + "_count"}
            elif kind == "counter" and not name.endswith("_total"):
                names.add(name + "_total")  # prometheus_client appends it
            else:
                names.add(name)
    return names


def queries(node) -> list[str]:
    """Every PromQL string in a dashboard: panel targets' ``expr`` and template ``query`` values."""
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k in ("expr", "query") and isinstance(v, str)]
        return found + [q for v in node.values() for q in queries(v)]
    if isinstance(node, list):
        return [q for v in node for q in queries(v)]
    return []


def test_dashboard_queries_only_defined_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = queries(dashboard["panels"]) + queries(dashboard["templating"])
    used = {name for e in exprs for name in METRIC_NAME.findall(e)}
    unknown = sorted(used - exposed_names())
    assert not unknown, f"dashboard queries metrics shared/runtime/metrics.py does not define: {unknown}"
    # Every service has panels, and the selection above really found the expressions.
    assert {s for s in metrics._DEFS if any(n.startswith(f"rlpipe_{s}_") for n in used)} == set(metrics._DEFS)
    assert len(used) > 30


def test_dashboard_is_importable():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and 36 <= dashboard["schemaVersion"] <= 41
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert "DS_PROMETHEUS" in [v["name"] for v in dashboard["templating"]["list"]]
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "Grafana mixes up panels with the same id"
    for p in panels:
        assert 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            expr = t["expr"]
            # A cheap PromQL sanity check: brackets balance (no Prometheus here to parse it).
            for open_, close in ("()", "{}", "[]"):
                assert expr.count(open_) == expr.count(close), f"{p['title']}: unbalanced {open_}{close} in {expr}"


def scrape_job_from_lines(text: str) -> dict:
    """The first scrape job's flat settings, read line by line (needs flow-style ``targets: [...]``)."""
    job, jobs = {}, 0
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip().removeprefix("- ").strip()
        key, sep, value = line.partition(":")
        if not sep or not value.strip():
            continue
        if key == "job_name":
            jobs += 1
            if jobs > 1:
                break
        value = value.strip()
        if key == "targets":
            job[key] = [t.strip().strip("\"'") for t in value.strip("[]").split(",")]
        elif jobs:
            job[key] = {"true": True, "false": False}.get(value, value)
    return job


def scrape_job_from_yaml(text: str) -> dict:
    job = dict(yaml.safe_load(text)["scrape_configs"][0])
    job["targets"] = job.pop("static_configs")[0]["targets"]
    return job


def test_prometheus_scrapes_the_default_metrics_endpoint():
    text = PROMETHEUS.read_text()
    job = scrape_job_from_yaml(text) if yaml else scrape_job_from_lines(text)
    net = NetworkConfig()
    assert job["job_name"] == "rlpipe"
    assert job["targets"] == [f"{net.metrics_host}:{net.metrics_port}"]
    assert job["scrape_interval"] == "5s"
    # Without it Prometheus renames each series' instance label (the process number) away.
    assert job["honor_labels"] is True


@pytest.mark.skipif(yaml is None, reason="PyYAML not installed")
def test_line_reader_agrees_with_yaml():
    text = PROMETHEUS.read_text()
    assert scrape_job_from_lines(text) == scrape_job_from_yaml(text)


def test_multiprocess_exposes_defined_names_and_forgets_dead_processes(tmp_path):
    # A separate process, because prometheus_client picks multiprocess mode at import time.
    script = (
        "from shared.runtime import metrics\n"
        "for service, defs in metrics._DEFS.items():\n"
        "    m = metrics.for_service(service, 0)\n"
        "    for attr, (kind, suffix, doc, extra, *_) in {**metrics._COMMON, **defs}.items():\n"
        "        child = getattr(m, attr).labels(**{label: 'x' for label in extra}) if extra else getattr(m, attr)\n"
        "        if kind == 'gauge':\n"
        "            child.set(1)  # livemostrecent gauges are exposed only once set\n"
        "metrics.for_service('sampler', 0).env_steps.inc(7)\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    _, err = child.communicate(timeout=30)
    assert child.returncode == 0, err

    registry = CollectorRegistry()
    registry.register(metrics.Served(tmp_path))  # as services.metrics serves them
    sampler0 = {"service": "sampler", "instance": "0", "node": "main"}  # node: the [placement] label
    assert registry.get_sample_value("rlpipe_sampler_env_steps_total", sampler0) == 7
    assert registry.get_sample_value("rlpipe_sampler_up", sampler0) == 1
    assert {s.name for fam in registry.collect() for s in fam.samples} == exposed_names()

    mark_process_dead(child.pid, str(tmp_path))
    assert registry.get_sample_value("rlpipe_sampler_up", sampler0) is None
    assert registry.get_sample_value("rlpipe_learner_up", {"service": "learner", "instance": "0", "node": "main"}) is None
    # Counters outlive the process, so rates stay continuous across a restart.
    assert registry.get_sample_value("rlpipe_sampler_env_steps_total", sampler0) == 7


def run_with_metrics(script: str, directory: Path) -> None:
    """``script`` in a process of its own, recording into ``directory`` (prometheus_client picks
    multiprocess mode at import time)."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    child = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert child.returncode == 0, child.stderr


def test_a_pool_version_that_left_the_pool_leaves_the_endpoint(tmp_path):
    """The learner's per-version Elo over versions 3 and 5, then 5 and 7: the multiprocess files keep
    version 3's series (prometheus_client cannot remove one there), the endpoint serves 5 and 7."""
    run_with_metrics("from shared.runtime import metrics\n"
                     "m = metrics.for_service('learner', 0)\n"
                     "m.pool_version_elo.replace({'3': 990.0, '5': 1010.0})\n"
                     "m.pool_version_elo.replace({'5': 1004.5, '7': 1001.0})\n", tmp_path)

    def versions(collector) -> dict[str, float]:
        registry = CollectorRegistry()
        registry.register(collector)
        return {s.labels["version"]: s.value for family in registry.collect() for s in family.samples
                if s.name == "rlpipe_learner_pool_version_elo"}

    in_files = versions(MultiProcessCollector(None, path=str(tmp_path)))
    assert set(in_files) == {"3", "5", "7"} and math.isnan(in_files["3"])
    assert versions(metrics.Served(tmp_path)) == {"5": 1004.5, "7": 1001.0}
