"""Where the time goes: a service's phase clock adds up to its process's wall time and reaches
its Prometheus counter; `rlpipe status` reads a run's split from its multiprocess directory and
names the bottleneck; the learner's split goes to TensorBoard with its progress rows."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from shared.launch import timesplit
from shared.runtime import metrics
from shared.runtime.runfiles import RUN_CONFIG
from tests.pipeline import CONFIGS, REPO, rlpipe_here, wall_seconds


def test_a_phase_clock_counts_every_second_of_the_process_once():
    clock = metrics.Phases(("startup", "a", "b"))
    age = metrics.process_age_s()
    assert age > 0.1  # this interpreter started a while ago (imports, pytest)
    assert clock.to("a") == "startup"
    time.sleep(0.05)
    assert clock.to("b") == "a"
    time.sleep(0.1)
    totals = clock.totals()
    assert totals["a"] == pytest.approx(0.05, abs=0.02) and totals["b"] == pytest.approx(0.1, abs=0.02)
    assert sum(totals.values()) == pytest.approx(wall_seconds(os.getpid()), abs=0.05)  # to the clock tick


class Family:
    def __init__(self):
        self.values: dict[str, float] = {}

    def labels(self, phase):
        family = self

        class Child:
            def inc(self, by):
                family.values[phase] = family.values.get(phase, 0.0) + by

        return Child()


def test_the_counter_gets_the_sums_at_most_every_flush_interval_and_the_current_phase_so_far(monkeypatch):
    monkeypatch.setattr(metrics, "FLUSH_S", 0.05)
    family = Family()
    clock = metrics.Phases(("startup", "work"), family)
    clock.to("work")
    assert set(family.values) <= {"startup"}  # the first flush is due FLUSH_S after the process started
    time.sleep(0.06)
    clock.to("work")  # one phase all along: its time so far is flushed all the same
    flushed = dict(family.values)
    assert flushed["work"] == pytest.approx(0.06, abs=0.02)
    clock.to("work")  # within FLUSH_S of the last flush: nothing is written
    assert family.values == flushed
    clock.flush()
    assert sum(family.values.values()) == pytest.approx(sum(clock.totals().values()), abs=1e-3)


SPLIT = {("learner", "0", "startup"): 3.0, ("learner", "0", "batch"): 2.0, ("learner", "0", "update"): 8.0,
         ("learner", "0", "publish"): 0.5, ("learner", "0", "report"): 0.1, ("learner", "0", "checkpoint"): 0.0,
         **{("sampler", i, phase): v for i in "01" for phase, v in (("startup", 1.0), ("env", 2.0), ("inference", 1.0),
                                                                     ("actions", 0.0), ("write", 0.2), ("ring", 7.0))},
         ("replay", "0", "idle"): 9.0, ("replay", "0", "insert"): 0.5, ("replay", "0", "sample"): 0.6}


def test_the_summary_names_the_busiest_service_and_its_largest_phase():
    summary = timesplit.shares(SPLIT)
    assert summary["sampler"]["instances"] == 2 and summary["sampler"]["startup"] == 2.0
    assert summary["learner"]["busy"] == pytest.approx(8.6 / 10.6)
    assert summary["sampler"]["busy"] == pytest.approx(3.2 / 10.2)
    assert timesplit.bottleneck(summary) == "learner (update 75%)"
    lines = timesplit.lines(SPLIT, "since the start")
    assert lines[0] == "where the time goes (since the start): bottleneck: learner (update 75%)"
    sampler = next(line for line in lines if line.startswith("  sampler"))
    assert "x2" in sampler and "env 20%" in sampler and "waiting: ring 69%" in sampler and "actions" not in sampler
    assert timesplit.lines({}, "since the start") == []
    starting = timesplit.lines({("replay", "0", "startup"): 1.5}, "since the start")
    assert starting == ["where the time goes (since the start): every service is starting",
                        "  replay        x1  starting (1.5 s so far)"]
    assert timesplit.since(SPLIT, {**SPLIT, ("replay", "0", "idle"): 8.0})[("replay", "0", "idle")] == 1.0


def test_status_of_an_ended_run_reads_the_split_its_services_left(tmp_path):
    """Processes of the run wrote their counters into <run>/metrics (as under supervisord); the
    run has ended: status says so and prints where the time went."""
    run_dir = tmp_path / "run"
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "result.json").write_text('{"reason": "budget"}')
    shutil.copy(CONFIGS / "cartpole_ppo.toml", run_dir / RUN_CONFIG)
    script = ("import time\nfrom shared.runtime import metrics\n"
              "m = metrics.for_service('learner', 0)\nm.time.to('update')\ntime.sleep(0.3)\nm.time.to('batch')\n"
              "time.sleep(0.05)\nm.time.flush()\n")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(run_dir / "metrics")}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    split = timesplit.read(run_dir)
    assert split[("learner", "0", "update")] == pytest.approx(0.3, abs=0.05)
    out = rlpipe_here("status", str(run_dir))
    assert out.returncode == 0, out.stderr
    head, split_line = out.stdout.splitlines()[:2]
    assert head == "run: not running; ended (budget)"
    share = re.fullmatch(r"where the time goes \(since the start\): bottleneck: learner \(update (\d+)%\)", split_line)
    assert share and 70 <= int(share.group(1)) <= 95, split_line  # 0.3 s of 0.35 s after start-up
    assert "  learner       x1  busy" in out.stdout
    assert rlpipe_here("top", str(run_dir)).stdout.startswith("run: not running")
    assert rlpipe_here("top", str(run_dir), "--interval", "0").returncode == 2
