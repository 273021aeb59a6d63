"""Where a run's time goes: each service's wall seconds by phase, read from the run's Prometheus
multiprocess directory (``<run>/metrics``, the files the metrics endpoint serves; no endpoint
needed), summarised one line a service with the bottleneck named, for ``rlpipe status`` (since
the start) and ``rlpipe top`` (over each refresh interval).

The phases and which of them are waits are ``shared.runtime.metrics.PHASES`` and ``WAITING``. A
service's *busy* share is its wall time less its waits and its start-up; the bottleneck is the
service busiest on average over its instances, named with its largest busy phase: while it
works, the others wait on it (and more of them would not help).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from shared.runtime.metrics import PHASES, WAITING, phase_metric
from shared.runtime.runfiles import METRICS_DIR

SHOWN = 0.005
"""Phases with a smaller share are left out of a service's line (an unused one, e.g. inference
with an action-server)."""
Split = dict[tuple[str, str, str], float]
"""(service, instance, phase) -> wall seconds."""


def read(run_dir: Path) -> Split:
    """Every service instance's seconds by phase so far (restarted processes' summed), empty
    where the run has recorded none."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    directory = Path(run_dir) / METRICS_DIR
    if not directory.is_dir() or not any(directory.glob("counter_*.db")):
        return {}
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    names = {phase_metric(service): service for service in PHASES}
    split: Split = {}
    for family in registry.collect():
        for s in family.samples:
            service = names.get(s.name)
            if service is not None:
                key = (service, s.labels["instance"], s.labels["phase"])
                split[key] = split.get(key, 0.0) + s.value
    return split


def since(now: Split, before: Split) -> Split:
    """The seconds spent between two ``read``s."""
    return {key: value - before.get(key, 0.0) for key, value in now.items()}


def shares(split: Split) -> dict[str, dict]:
    """Per service: {"instances", "startup" (seconds, summed over instances), "shares" (phase ->
    share of the time after start-up, over all instances), "busy" (share of it not waiting)}."""
    out: dict[str, dict] = {}
    for service in PHASES:
        rows = {key: value for key, value in split.items() if key[0] == service}
        if not rows:
            continue
        instances = {instance for (_, instance, _), v in rows.items() if v > 0}  # over an interval: those that ran
        startup = sum(v for (_, _, phase), v in rows.items() if phase == "startup")
        by_phase = {phase: sum(v for (_, _, p), v in rows.items() if p == phase) for phase in PHASES[service][1:]}
        total = sum(by_phase.values())
        phase_shares = {phase: v / total for phase, v in by_phase.items()} if total > 0 else {}
        busy = 1.0 - sum(phase_shares.get(phase, 0.0) for phase in WAITING[service]) if total > 0 else 0.0
        out[service] = {"instances": len(instances), "startup": startup, "shares": phase_shares, "busy": busy}
    return out


def bottleneck(summary: dict[str, dict]) -> str | None:
    """``learner (update 82%)``: the busiest service and its largest busy phase; None before any
    service got past its start-up."""
    started = {service: s for service, s in summary.items() if s["shares"]}
    if not started:
        return None
    service = max(started, key=lambda name: started[name]["busy"])
    work = {p: v for p, v in started[service]["shares"].items() if p not in WAITING[service]}
    phase = max(work, key=work.get)
    return f"{service} ({phase} {work[phase]:.0%})"


def lines(split: Split, over: str) -> list[str]:
    """The summary as printed: a head line naming the bottleneck, then one line a service;
    ``over`` says what the shares are of ("since the start", "over the last 2 s")."""
    summary = shares(split)
    if not summary:
        return []
    neck = bottleneck(summary)
    out = [f"where the time goes ({over}): " + (f"bottleneck: {neck}" if neck else "every service is starting")]
    for service, s in summary.items():
        head = f"  {service:<13} x{s['instances']:<2}"
        if not s["shares"]:
            out.append(f"{head} starting ({s['startup']:.1f} s so far)")
            continue
        shown = {p: v for p, v in s["shares"].items() if v >= SHOWN}
        work = "  ".join(f"{p} {v:.0%}" for p, v in shown.items() if p not in WAITING[service])
        waits = "  ".join(f"{p} {v:.0%}" for p, v in shown.items() if p in WAITING[service]) or "-"
        startup = f"  (start-up {s['startup']:.1f} s)" if s["startup"] else ""
        out.append(f"{head} busy {s['busy']:4.0%}: {work}  | waiting: {waits}{startup}")
    return out


def top(run_dir: Path, running, interval_s: float = 2.0, count: int | None = None, out=None) -> None:
    """Print the split over each ``interval_s`` to ``out`` (None: sys.stdout as it is then) until
    the run stops (``running()`` false), or ``count`` times."""
    out = sys.stdout if out is None else out
    before = read(run_dir)
    shown = 0
    while count is None or shown < count:
        time.sleep(interval_s)
        now = read(run_dir)
        text = lines(since(now, before), f"over the last {interval_s:g} s") or ["no time split recorded yet"]
        print(time.strftime("%H:%M:%S ") + "\n".join(text), file=out, flush=True)
        before, shown = now, shown + 1
        if not running():
            break
