"""Prometheus metrics: the only module that names metrics.

Every service records into prometheus_client; under supervisord the environment variable
PROMETHEUS_MULTIPROC_DIR points all processes of a run at one directory, and the metrics
service serves them all on one HTTP endpoint (prometheus_client's multiprocess mode).
Names follow ``rlpipe_<service>_<thing>_<unit>``; every series carries ``service`` and
``instance`` labels.

prometheus_client maps one file per metric kind and process in that directory (the run
directory's ``metrics/``), sparse: on a full disk the first write to a page not yet backed is a
SIGBUS. So before the process's first metric, ``for_service`` allocates those files in full
(``reserve_files``); where the disk cannot hold them the process records its metrics in memory
only (not served: a warning says so) and runs on. prometheus_client chooses between the two
when it is first imported, which is why this module imports it late.

A label whose values come and go (the self-play pool's versions: ``TRANSIENT_LABELS``) has its
series set and removed together (``_Partial.replace``), so that the endpoint serves the current
values only. prometheus_client's multiprocess mode cannot remove a series (a process's file keeps
every series it wrote: prometheus/client_python#916), so there a removed series is set to REMOVED,
which the endpoint's collector (``Served``) leaves out. The file still holds it, one entry (about
200 bytes) a value for the process's life: about a thousand pool versions fit the file's
reservation (MULTIPROC_FILE_BYTES) before prometheus_client grows it, sparse.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from shared.runtime import runfiles

log = logging.getLogger(__name__)
MULTIPROC = "PROMETHEUS_MULTIPROC_DIR"
MULTIPROC_PREFIXES = ("counter", "gauge_livemostrecent", "histogram")
"""The files a process of ours has there (prometheus_client names them ``<prefix>_<pid>.db``)."""
MULTIPROC_FILES = len(MULTIPROC_PREFIXES)
MULTIPROC_FILE_BYTES = 256 << 10
"""Each file's size: every series of every service in one process takes under 15 KiB of the
largest (tests/test_deploy.py checks a margin); prometheus_client grows a file, sparse again,
only past this."""

LABELS = ("service", "instance", "node")
_LAT_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

# service -> {attribute: (kind, name suffix, help, extra labels)}
_DEFS: dict[str, dict[str, tuple]] = {
    "sampler": {
        "env_steps": ("counter", "env_steps_total", "Environment steps taken", ()),
        "episodes": ("counter", "episodes_total", "Episodes finished", ()),
        "episode_return": ("gauge", "episode_return", "Mean return of the episodes finished in the last segment", ()),
        "episode_length": ("gauge", "episode_length_steps", "Mean length of the episodes finished in the last segment", ()),
        "segments": ("counter", "segments_total", "Segments handed to replay", ()),
        "dropped_steps": ("counter", "dropped_steps_total", "Env steps collected but not handed over when the sampler stopped", ()),
        "wait": ("counter", "wait_seconds_total", "Seconds spent waiting, by what for", ("on",)),
        "env_errors": ("counter", "env_errors_total", "Environments that misbehaved and were recreated", ()),
        "refused_segments": ("counter", "refused_segments_total", "Segments replay refused (or would): dropped", ()),
        "bad_returns": ("counter", "bad_returns_total", "Finished episodes not reported: return not finite or beyond 1e15", ()),
        "reconnects": ("counter", "reconnects_total", "Peer timeouts that led to a reconnect", ("peer",)),
        "phase": ("counter", "phase_seconds_total", "Wall seconds of the process, by what it was doing (PHASES)", ("phase",)),
    },
    "action_server": {
        "requests": ("counter", "requests_total", "Observation requests served", ()),
        "batch_size": ("histogram", "batch_size_requests", "Requests per forward pass", (), _BATCH_BUCKETS),
        "batch_envs": ("histogram", "batch_size_envs", "Environments per forward pass", (), _BATCH_BUCKETS),
        "latency": ("histogram", "latency_seconds", "From a request's arrival to its reply", (), _LAT_BUCKETS),
        "policy_version": ("gauge", "policy_version", "Parameter version in use", ()),
        "peers": ("gauge", "peers", "Samplers attached", ()),
        "peers_lost": ("counter", "peers_lost_total", "Samplers detached after going silent", ()),
        "phase": ("counter", "phase_seconds_total", "Wall seconds of the process, by what it was doing (PHASES)", ("phase",)),
    },
    "replay": {
        "size": ("gauge", "size_items", "Items in the table", ()),
        "inserts": ("counter", "inserts_total", "Items inserted", ()),
        "insert_steps": ("counter", "insert_steps_total", "Env steps inserted", ()),
        "samples": ("counter", "samples_total", "Items sampled", ()),
        "dropped": ("counter", "dropped_total", "Items dropped for exceeding the policy-lag bound", ()),
        "blocked": ("counter", "blocked_seconds_total", "Seconds a request waited on the table, by side", ("side",)),
        "peers_lost": ("counter", "peers_lost_total", "Samplers reported lost after going silent", ()),
        "priority_max": ("gauge", "priority_max", "Largest priority seen (what new items get)", ()),
        "priority_mean": ("gauge", "priority_alpha_mean", "Mean of priority^alpha over the table", ()),
        "priority_updates": ("counter", "priority_updates_total", "Priority updates applied", ()),
        "restarts": ("gauge", "table_restarts", "Times the table was re-attached from shared memory after a kill", ()),
        "torn_items": ("counter", "torn_items_total", "Items dropped at a re-attach: a kill tore the write that held them", ()),
        "snapshot_errors": ("counter", "snapshot_errors_total", "Table snapshots not written (a full disk); tried again later", ()),
        "episodes_dropped": ("counter", "episodes_dropped_total", "Finished episodes never reported to the learner: more ended before its next batch than one reply carries", ()),
        "phase": ("counter", "phase_seconds_total", "Wall seconds of the process, by what it was doing (PHASES)", ("phase",)),
    },
    "learner": {
        "updates": ("counter", "updates_total", "Optimisation updates (one per batch)", ()),
        "env_steps": ("gauge", "env_steps", "Env steps sampled in the run so far (restored on resume)", ()),
        "policy_version": ("gauge", "policy_version", "Latest published parameter version", ()),
        "policy_lag": ("gauge", "policy_lag_versions", "Mean policy lag of the last batch", ()),
        "mean_return": ("gauge", "mean_return", "Mean return of the recent episodes", ()),
        "loss": ("gauge", "loss", "Last value of each loss term and diagnostic", ("term",)),
        "batch_wait": ("counter", "batch_wait_seconds_total", "Seconds waiting for a batch", ()),
        "update_time": ("counter", "update_seconds_total", "Seconds spent in updates", ()),
        "skipped_steps": ("counter", "skipped_steps_total", "Gradient steps skipped: loss or gradient norm not finite", ()),
        "write_errors": ("counter", "write_errors_total", "Files of the run directory not written (a full disk), by file; tried again later", ("file",)),
        "phase": ("counter", "phase_seconds_total", "Wall seconds of the process, by what it was doing (PHASES)", ("phase",)),
        "pool_outcome": ("gauge", "pool_outcome_ratio", "Share of the learner seat's recent self-play games against the "
                         "pool's past versions that ended in an outcome (win, draw, loss)", ("outcome",)),
        "pool_elo": ("gauge", "pool_elo", "Elo rating of the learner from its self-play games against the pool", ()),
        "pool_best_elo": ("gauge", "pool_best_elo", "Elo rating of the self-play pool's highest-rated version", ()),
        "pool_best_version": ("gauge", "pool_best_version", "The self-play pool's highest-rated version", ()),
        "pool_version_elo": ("gauge", "pool_version_elo", "Elo rating of each self-play pool version", ("version",)),
    },
    "evaluator": {
        "mean_return": ("gauge", "mean_return", "Mean return of the latest evaluation's greedy episodes", ()),
        "std_return": ("gauge", "return_std", "Standard deviation of the latest evaluation's returns", ()),
        "policy_version": ("gauge", "policy_version", "Parameter version the latest evaluation measured", ()),
        "env_steps": ("gauge", "env_steps", "Run env steps at the version the latest evaluation measured", ()),
        "outcome": ("gauge", "outcome_ratio", "Share of the latest evaluation's two-player games against an opponent "
                    "that ended in an outcome (win, draw, loss), by the policy's seat (first, second)",
                    ("opponent", "seat", "outcome")),
        "evaluations": ("counter", "evaluations_total", "Evaluations finished", ()),
        "eval_time": ("counter", "eval_seconds_total", "Seconds spent evaluating (the rest it sleeps)", ()),
        "write_errors": ("counter", "write_errors_total", "Evaluation results not written to eval.csv (a full disk); tried again later", ()),
        "failures": ("counter", "failed_evaluations_total", "Evaluations that failed (an env error), retried after a pause", ()),
    },
    "watchdog": {
        "kills": ("counter", "kills_total", "Services killed for a heartbeat older than run.watchdog_s, by process", ("process",)),
    },
}
_COMMON = {
    "up": ("gauge", "up", "1 while the process runs", ()),
    "healthy": ("gauge", "healthy", "1 while the service's peers answer", ()),
    "bad_messages": ("counter", "bad_messages_total", "Messages rejected or failed, by reason "
                     "(wire, auth, descriptor, value, state, internal)", ("reason",)),
}
# Label values known in advance: their series are created at 0 when a process starts, so a
# counter that has not counted yet reads 0 instead of being absent (a dashboard panel shows
# "0 bad messages", not "no data"). Labels not listed here (a loss term) appear when first set.
KNOWN_LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "reason": ("wire", "auth", "descriptor", "value", "state", "internal"),
    "peer": ("action_server", "replay"),
    "on": ("actions", "replay"),
    "side": ("sampler", "learner"),
    "file": (runfiles.PROGRESS, runfiles.POOL_ELO, "checkpoint", "tensorboard", runfiles.RESULT),
}
TRANSIENT_LABELS = ("version",)
"""Labels whose values come and go (``_Partial.replace``): at most the values of now are served."""
REMOVED = math.nan
"""What a series removed in multiprocess mode reads in its process's file (``Served`` leaves it out)."""
# Where a service's wall time goes (``m.time``, a ``Phases`` clock; docs/architecture.md, "Where the
# time goes"): every second of the process belongs to one phase, from the process's start
# ("startup": imports, building, connecting) on. WAITING: the phases in which the service waits
# for another one; the rest is its own work, and the busiest service is the run's bottleneck.
PHASES: dict[str, tuple[str, ...]] = {
    # env: stepping the envs; inference: the policy's forward pass in this process (local
    # inference, parameter versions followed there); actions: waiting for an action-server's
    # actions; write: copying steps into the segment ring and handing segments over; ring:
    # waiting for replay to release a ring slot (back-pressure, the rate limiter).
    "sampler": ("startup", "env", "inference", "actions", "write", "ring"),
    # idle: waiting for requests; gather: waiting up to max_wait_ms for more; forward: the
    # batch's forward pass (with joining the observations); reply: writing actions back and
    # ringing the samplers; params: loading a new parameter version.
    "action_server": ("startup", "idle", "gather", "forward", "reply", "params"),
    # idle: waiting for messages; messages: handling them; insert: copying segments into the
    # table; sample: filling the learner's batch slots; snapshot: copying the table to disk.
    "replay": ("startup", "idle", "messages", "insert", "sample", "snapshot"),
    # batch: waiting for a batch from replay; update: the algorithm's update (and the lag and finiteness
    # checks); publish: priorities, the next request and the new parameter version; report:
    # progress rows (CSV, TensorBoard, W&B); checkpoint: writing one.
    "learner": ("startup", "batch", "update", "publish", "report", "checkpoint"),
}
WAITING: dict[str, tuple[str, ...]] = {
    "sampler": ("actions", "ring"), "action_server": ("idle", "gather"), "replay": ("idle",), "learner": ("batch",),
}
FLUSH_S = 0.25
"""Seconds between two flushes of a ``Phases`` clock's sums into its Prometheus counter."""
_families: dict[str, object] = {}


def reserve_files(directory: Path, pid: int | None = None) -> str | None:
    """Allocate this process's metrics files in ``directory`` (``MULTIPROC_PREFIXES``, each
    ``MULTIPROC_FILE_BYTES``) so that no write to them can fault; None once done, else why
    not (one line; the files made are removed)."""
    pid = os.getpid() if pid is None else pid
    made = []
    try:
        for prefix in MULTIPROC_PREFIXES:
            path = Path(directory) / f"{prefix}_{pid}.db"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                if os.fstat(fd).st_size == 0:
                    made.append(path)
                os.posix_fallocate(fd, 0, max(os.fstat(fd).st_size, MULTIPROC_FILE_BYTES))
            finally:
                os.close(fd)
    except OSError as e:
        for path in made:
            path.unlink(missing_ok=True)
        room = ""
        if e.errno == errno.ENOSPC:
            st = os.statvfs(directory)
            room = f" ({st.f_bavail * st.f_frsize / 2**20:.1f} MiB free, {MULTIPROC_FILES * MULTIPROC_FILE_BYTES / 2**20:.0f} MiB needed)"
        return f"{directory}: {e.strerror}{room}"
    return None


def _start_recording() -> None:
    """Before the first metric: the multiprocess files allocated, or metrics in memory only."""
    directory = os.environ.get(MULTIPROC)
    if directory is None or "prometheus_client.values" in sys.modules:
        return  # in memory anyway; or chosen already (a test, a library that imported it first)
    why = reserve_files(Path(directory))
    if why is not None:
        del os.environ[MULTIPROC]
        log.warning("metrics of this process are not served: cannot allocate its metrics files in %s; "
                    "it runs on without them", why)


def _family(kind: str, name: str, doc: str, labels: tuple, buckets=None):
    if not _families:
        _start_recording()
    from prometheus_client import Counter, Gauge, Histogram

    if name not in _families:
        multiproc = MULTIPROC in os.environ
        if kind == "counter":
            _families[name] = Counter(name, doc, labels)
        elif kind == "histogram":
            _families[name] = Histogram(name, doc, labels, buckets=buckets)
        else:
            mode = "livemostrecent" if multiproc else "all"
            _families[name] = Gauge(name, doc, labels, multiprocess_mode=mode)
    return _families[name]


def for_service(service: str, instance: int, node: str = "main") -> SimpleNamespace:
    """The labelled metrics of one process: ``m.env_steps.inc(n)``, ``m.wait.labels(on="actions")``;
    ``node``: the service's ``[placement]`` label."""
    out = {}
    defs = {**_COMMON, **_DEFS[service]}
    fixed = {"service": service, "instance": str(instance), "node": node}
    for attr, (kind, suffix, doc, extra, *buckets) in defs.items():
        fam = _family(kind, f"rlpipe_{service}_{suffix}", doc, LABELS + extra, buckets[0] if buckets else None)
        out[attr] = _Partial(fam, fixed, extra) if extra else fam.labels(**fixed)
        known = {**KNOWN_LABEL_VALUES, "phase": PHASES.get(service, ())}
        if extra and kind == "counter" and all(label in known for label in extra):
            for values in itertools.product(*(known[label] for label in extra)):
                out[attr].labels(**dict(zip(extra, values)))
    m = SimpleNamespace(**out)
    m.up.set(1)
    if service in PHASES:
        m.time = Phases(PHASES[service], m.phase)
    return m


def transient_metrics() -> set[str]:
    """The names of the metrics with a TRANSIENT_LABELS label."""
    return {f"rlpipe_{service}_{suffix}" for service, defs in _DEFS.items()
            for kind, suffix, doc, extra, *_ in defs.values() if set(extra) & set(TRANSIENT_LABELS)}


class Served:
    """What the metrics endpoint serves: prometheus_client's multiprocess collector over the run's
    metrics ``directory``, less the series removed there (REMOVED in a metric of ``transient_metrics``)."""

    def __init__(self, directory: Path):
        from prometheus_client.multiprocess import MultiProcessCollector

        self.files, self.transient = MultiProcessCollector(None, path=str(directory)), transient_metrics()

    def collect(self):
        for family in self.files.collect():
            if family.name in self.transient:
                family.samples = [s for s in family.samples if not math.isnan(s.value)]
            if family.samples:
                yield family


def phase_metric(service: str) -> str:
    """The sample name of ``service``'s time split (``rlpipe_<service>_phase_seconds_total``)."""
    return f"rlpipe_{service}_{_DEFS[service]['phase'][1]}"


def process_age_s() -> float:
    """Seconds since this process started (Linux: its start time in /proc; elsewhere 0)."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rpartition(")")[2].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


class Phases:
    """Where a loop's wall time goes: the process is always in one of ``names``; ``to(phase)``
    ends the current one and starts ``phase`` (one clock read and a float sum: cheap enough
    for the sampler's every batch step), and returns the phase it ended. The first phase began
    when the process started. The sums go to ``counter`` (a family with the ``phase`` label,
    or None) at most every FLUSH_S seconds, the current phase's time so far included, so the
    counters add up to the process's wall time, less at most FLUSH_S."""

    def __init__(self, names: tuple[str, ...], counter=None):
        self.names, self.counter = names, counter
        self.spent = dict.fromkeys(names, 0.0)  # seconds by phase since the process started
        self.flushed = dict.fromkeys(names, 0.0)
        self.phase = names[0]
        self.since = time.perf_counter() - process_age_s()
        self.flush_at = self.since + FLUSH_S

    def to(self, phase: str) -> str:
        now = time.perf_counter()
        self.spent[self.phase] += now - self.since
        ended, self.phase, self.since = self.phase, phase, now
        if now >= self.flush_at:
            self.flush(now)
        return ended

    def totals(self) -> dict[str, float]:
        """Seconds by phase since the process started, the current phase's until now."""
        out = dict(self.spent)
        out[self.phase] += time.perf_counter() - self.since
        return out

    def flush(self, now: float | None = None) -> None:
        """Add what was spent since the last flush to the counter."""
        now = time.perf_counter() if now is None else now
        self.spent[self.phase] += now - self.since
        self.since, self.flush_at = now, now + FLUSH_S
        if self.counter is None:
            return
        for name, total in self.spent.items():
            if total > self.flushed[name]:
                self.counter.labels(phase=name).inc(total - self.flushed[name])
                self.flushed[name] = total


class NoPhases:
    """A ``Phases`` that measures nothing (a sampler without metrics: unit tests)."""

    phase = "startup"

    def to(self, phase: str) -> str:
        return self.phase


def bad_message_counter(m: SimpleNamespace):
    """``Endpoint(on_bad=...)`` for a service's metrics: counts each rejection by its reason."""
    return lambda reason: m.bad_messages.labels(reason=reason).inc()


class _Partial:
    """A family with service/instance/node fixed; ``.labels(**rest)`` gives the child, kept
    once made (the family's own lookup takes a lock and builds its key on every call; a cached
    child skips both: docs/benchmarks.md, "Sampling throughput")."""

    def __init__(self, fam, fixed: dict, extra: tuple[str, ...]):
        self.fam, self.fixed, self.extra, self.children = fam, fixed, extra, {}

    def labels(self, **rest):
        key = tuple(rest.items())
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = self.fam.labels(**self.fixed, **rest)
        return child

    def replace(self, values: dict[str, float]) -> None:
        """Set a series per entry of ``values`` (a value of the family's one label besides the fixed
        ones -> its sample) and remove those of the other values this process set (a pool version
        that left the pool): see the module's docstring for multiprocess mode."""
        (label,) = self.extra
        for key in [key for key in self.children if key[0][1] not in values]:
            child = self.children.pop(key)
            if MULTIPROC in os.environ:
                child.set(REMOVED)
            else:
                self.fam.remove(*self.fixed.values(), key[0][1])
        for value, sample in values.items():
            self.labels(**{label: value}).set(sample)
