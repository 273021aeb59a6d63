"""Helpers for tests that launch real runs: supervisord, the services, the metrics endpoint."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from shared.config import loading, schema
from shared.launch import backend, rundirs, supervisor
from shared.replay import arena
from shared.runtime.runfiles import RUN_CONFIG

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "deploy" / "configs"


PORT_SPAN = 8
"""Ports from a ``free_port`` that are free: a run's base port and the offsets its sockets bind."""


def free_port() -> int:
    """A port (and the PORT_SPAN - 1 after it) free now, from 20000 up to the kernel's ephemeral
    range, a slice of it each xdist worker. Not ``bind(0)``: that hands out an ephemeral port,
    which any process's outgoing connection can take between this check and a service's bind, and
    keep for that connection's life (Ray's connections did: an action-server failed its bind 20
    times). Below 20000 are Ray's worker ports."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    width = (low - 20000) // max(workers, 1)
    rng = np.random.default_rng()
    for _ in range(200):
        base = 20000 + worker * width + int(rng.integers(0, width - PORT_SPAN))
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + PORT_SPAN):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {PORT_SPAN} free ports in a row between 20000 and {low}")


# Every process the tests start (`rlpipe` commands, and supervisord with its services) imports
# this checkout (and tests' envs), whatever checkout the installed package points at.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def rlpipe_command(*args: str) -> dict:
    """Popen/run keywords for ``rlpipe ARGS`` from this checkout."""
    return {"args": [sys.executable, "-m", "shared.launch.cli", *args], "cwd": REPO}


def rlpipe(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``rlpipe ARGS``, run to its end."""
    return subprocess.run(**rlpipe_command(*args), capture_output=True, text=True, timeout=timeout)


def rlpipe_here(*args: str) -> subprocess.CompletedProcess:
    """``rlpipe ARGS`` run in this process: torch is loaded here already, so the commands that build
    the agent (launch, prepare) cost no interpreter start and no torch import (~2.5 s of CPU)."""
    from shared.launch import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return subprocess.CompletedProcess(["rlpipe", *args], code, out.getvalue(), err.getvalue())



def wait_for(predicate, timeout: float, what: str, details=lambda: "", poll: float = 0.25):
    """The first truthy ``predicate()``, polled every ``poll`` s; AssertionError naming ``what``
    (and ``details()``) after ``timeout`` s without one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{details()}".rstrip())

class Run:
    """A run directory and what tests ask of it; ``close()`` cleans it up whatever happened."""

    def __init__(self, run_dir: Path, metrics_port: int | None = None):
        self.dir, self.id, self.metrics_port = Path(run_dir), Path(run_dir).name, metrics_port

    @classmethod
    def launch(cls, tmp_path: Path, config: str, *overrides: str, command_line: bool = False,
               cluster: str | None = None) -> "Run":
        """``rlpipe launch CONFIG --detach`` with runs under tmp_path, a free metrics port and a
        progress row every 0.5 s (tests wait on those rows: a 2 s interval adds ~1 s to each wait).

        Unless ``command_line`` (benchmarks of what a user waits for) or ``cluster`` (``--cluster``:
        a Ray driver of its own), the launcher runs in this process (rlpipe_here: its agent check
        would otherwise contend with the services' start on 2 cores); supervisord and the services
        are separate real processes all the same.
        """
        port = free_port()
        args = ["launch", str(CONFIGS / config), "--detach", *(["--cluster", cluster] if cluster else [])]
        for s in (f"run.runs_dir='{tmp_path / 'runs'}'", f"network.metrics_port={port}", "run.log_interval_s=0.5",
                  *overrides):
            args += ["--set", s]
        done = rlpipe(*args) if command_line or cluster else rlpipe_here(*args)
        assert done.returncode == 0, done.stdout + done.stderr
        return cls(Path(re.search(r"run directory: (\S+)", done.stdout).group(1)), port)

    def progress(self) -> list[dict]:
        return rundirs.read_progress(self.dir)

    def wait_for(self, predicate, timeout: float, what: str):
        """``wait_for`` with the run's log tails in the failure."""
        return wait_for(predicate, timeout, what, lambda: self.logs(tail=3000))

    def wait_steps(self, steps: int, timeout: float = 120) -> None:
        self.wait_for(lambda: any(int(r["env_steps"]) >= steps for r in self.progress()), timeout,
                      f"{steps} env steps")

    def wait_result(self, timeout: float) -> dict:
        return self.wait_for(lambda: rundirs.read_result(self.dir), timeout, "the run's result")

    def status(self) -> dict[str, tuple[str, int | None]]:
        """Process name -> (state, pid: of a RUNNING process, else None), as `rlpipe status` shows
        them; asked over supervisord's XML-RPC socket (tests poll it: no supervisorctl process each time)."""
        return {p["name"]: (p["statename"], p["pid"] if p["statename"] == "RUNNING" else None)
                for p in supervisor.rpc(self.dir).supervisor.getAllProcessInfo()}

    def pid(self, name: str) -> int:
        return self.wait_for(lambda: self.status().get(name, ("", None))[1], 30, f"{name} to run")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def logs(self, service: str = "", tail: int | None = None) -> str:
        return "\n".join(p.name + ":\n" + p.read_text(errors="replace")[-(tail or 0):]
                         for p in sorted((self.dir / "logs").glob(f"{service}*.log")))

    def segments(self) -> list[str]:
        return [p.name for p in Path("/dev/shm").glob(f"rlpipe-{self.id}-*")]

    def stop_replay_between_operations(self) -> dict:
        """SIGSTOP replay0 at a moment no table operation is in progress and read its table
        from shared memory: {"pid", "size", "inserts", "samples", "deletes", "priority_total"}.
        The process stays stopped (kill it, or SIGCONT)."""
        pid = self.pid("replay0")
        shm_file = f"/dev/shm/rlpipe-{self.id}-replay0-"
        while True:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.05)  # the stop takes effect at once; the state is now what it will be
            if np.fromfile(shm_file + "table", np.int64)[arena.HEADER_OP] == arena.OP_NONE:
                break
            os.kill(pid, signal.SIGCONT)
        inserts, samples, deletes = np.fromfile(shm_file + "t.limiter", np.int64)
        tree = Path(shm_file + "t.sumtree.sum")
        return {"pid": pid, "size": int(np.fromfile(shm_file + "t.live", bool).sum()), "inserts": int(inserts),
                "samples": int(samples), "deletes": int(deletes),
                "priority_total": float(np.fromfile(tree, np.float64)[1]) if tree.exists() else None}

    def scale(self, count: int) -> float:
        """``rlpipe scale`` to ``count`` samplers; seconds until the metrics endpoint shows exactly them."""
        t0 = time.monotonic()
        out = rlpipe_here("scale", str(self.dir), f"sampler={count}")
        assert out.returncode == 0, out.stderr
        want = {str(i) for i in range(count)}
        self.wait_for(lambda: label_values(self.metrics(), "rlpipe_sampler_up") == want, 10,
                      f"the metrics endpoint to show samplers {sorted(want)}")
        assert self.config().sampler.count == count  # the run's config records it
        return time.monotonic() - t0

    def config(self):
        return loading.load(self.dir / RUN_CONFIG)

    def replay_table(self):
        """The replay's table, attached from shared memory as a restarted replay would (stop the
        replay first: ``stop_replay_between_operations``)."""
        from services.replay.tables import make_table, table_arena
        from services.build import batch_items, env_probe, example_step
        from shared.data.layout import segment_spec

        exp = self.config()
        columns = {i: exp.sampler.envs for i in range(schema.most_count(exp.sampler))}
        spec = segment_spec(example_step(exp, env_probe(exp)), exp.sampler.horizon, exp.sampler.envs)
        table = make_table(exp.replay, columns, spec, batch_items(exp), arena=table_arena(exp.replay, columns, spec, self.id))
        assert table.arena.restored, "the table in shared memory has another layout"
        return table

    def close(self) -> None:
        backend.clean(self.dir)


def check_nstep(table, gamma: float, n: int) -> np.ndarray:
    """Recompute every live item's n-step return, discount and bootstrap step from the steps in
    the table's ring and compare with what the table stored; returns the live items' columns."""
    st, ring = table.storage, table.storage.ring
    keys = np.flatnonzero(table.live)
    B, rows = ring.B_total, ring.rows
    row, col = keys // B, keys % B
    ret, disc = np.zeros(len(keys)), np.zeros(len(keys))
    boot, final = np.full(len(keys), -1), np.zeros(len(keys), bool)
    open_ = np.ones(len(keys), bool)
    for j in range(n):
        k = ((row + j) % rows) * B + col
        ret[open_] += gamma ** j * ring.flat.reward[k][open_]
        term, trunc = ring.flat.terminated[k], ring.flat.truncated[k]
        ends = open_ & (term | trunc)
        disc[ends] = np.where(term[ends], 0.0, gamma ** (j + 1))
        boot[ends], final[ends] = k[ends], True
        open_ &= ~ends
    disc[open_] = gamma ** n
    boot[open_] = (((row + n) % rows) * B + col)[open_]
    np.testing.assert_allclose(st.return_[keys], ret, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(st.discount[keys], disc, rtol=1e-6)
    np.testing.assert_array_equal(st.bootstrap_key[keys], boot)
    np.testing.assert_array_equal(st.bootstrap_final[keys], final)
    return col


def stop_process(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until the kernel has stopped it (state T): the signal takes effect
    only when the process next runs, and one a test means stopped must not act meanwhile (e.g.
    on a SIGHUP that comes a moment later)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop within {timeout:.0f} s"
        time.sleep(0.01)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wall_seconds(pid: int) -> float:
    """Seconds since process ``pid`` started (the kernel's start time, to its clock tick)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")


MIN_AGE_S = 8.0
"""Process age from which ``check_time_split`` holds a split to 10% of it."""


def check_time_split(run: Run) -> str:
    """Every running service's time split (its phase counters, as `rlpipe status` reads them)
    adds up to its process's wall time within 10%, once the youngest is MIN_AGE_S old (the
    counters trail the clocks by up to FLUSH_S); returns `rlpipe status`'s output."""
    from shared.launch import timesplit
    from shared.runtime.metrics import PHASES

    # The services that keep a split (not the metrics endpoint, the watchdog or the evaluator,
    # whose time is its eval_seconds_total).
    pids = {name: pid for name, (_, pid) in run.status().items()
            if pid is not None and name.rstrip("0123456789") in PHASES}
    youngest = min(wall_seconds(pid) for pid in pids.values())
    time.sleep(max(0.0, MIN_AGE_S - youngest))
    ages = {name: wall_seconds(pid) for name, pid in pids.items()}
    split = timesplit.read(run.dir)
    sums = {}
    for (service, instance, _), seconds in split.items():
        sums[f"{service}{instance}"] = sums.get(f"{service}{instance}", 0.0) + seconds
    assert ages.keys() <= sums.keys(), (ages, sums)
    for name in ages:
        assert abs(sums[name] - ages[name]) <= 0.1 * ages[name], (name, sums[name], ages[name], split)
    out = rlpipe_here("status", str(run.dir))
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def maps_library(pid: int, library: str = "libtorch") -> bool:
    """Whether process ``pid`` has a shared library mapped whose path contains ``library``
    (the default: torch's, so it imported torch)."""
    return library in Path(f"/proc/{pid}/maps").read_text()


def label_values(metrics_text: str, name: str, label: str = "instance") -> set[str]:
    """The values of label ``label`` of the samples of metric ``name`` in a Prometheus text page."""
    return set(re.findall(rf'^{name}{{[^}}]*\b{label}="([^"]*)"', metrics_text, re.M))


def metric_value(page: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric ``name`` (with these label values) on a Prometheus text page."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if (line.startswith(name + "{") or line.startswith(name + " ")) and all(w in line for w in want))


# ---------------------------------------------------------------- benchmarks (tests/bench)


def rlpipe_to_target(tmp_path, config: str, seed: int, *overrides: str) -> tuple[float, int]:
    """(seconds from `rlpipe launch` to result.json, env steps) of one run; a run that ends on
    its step budget instead of the target is reported (its time is a lower bound), not dropped."""
    t0 = time.time()
    run = Run.launch(tmp_path, config, f"run.seed={seed}", *overrides, command_line=True)
    try:
        result = run.wait_result(1800)
        seconds = (run.dir / "result.json").stat().st_mtime - t0
    finally:
        run.close()
    if result["reason"] != "target":
        print(f"\n{config} seed {seed} missed the target: {result['reason']} at {result['env_steps']} env steps, "
              f"mean return {result['mean_return']:.1f} after {seconds:.1f} s")
    return seconds, result["env_steps"]


def summary(name: str, runs: list[tuple[float, int]]) -> float:
    secs = [s for s, _ in runs]
    steps = [n for _, n in runs]
    median = statistics.median(secs)
    print(f"{name}: median {median:.1f} s (min {min(secs):.1f}, max {max(secs):.1f}); env steps median "
          f"{statistics.median(steps):,.0f} (min {min(steps):,}, max {max(steps):,}); runs "
          f"{[(round(s, 1), n) for s, n in runs]}")
    return median


def rate_medians(rates: dict[str, list[float]], baseline: str, describe: dict[str, str]) -> dict[str, float]:
    """Print each setup's median rate (steps/s) over its rounds, with the rounds, and every other
    setup's ratio to ``baseline``'s median; ``describe``: setup -> what it is. Returns the medians."""
    medians = {name: statistics.median(runs) for name, runs in rates.items()}
    print()
    for name, runs in rates.items():
        ratio = "" if name == baseline else f"  ratio to {baseline} {medians[name] / medians[baseline]:.2f}"
        print(f"{describe[name]}: median {medians[name]:,.0f} steps/s  runs {[round(x) for x in runs]}{ratio}")
    return medians


def sb3_to_target(make, total_timesteps: int, target: float, window: int) -> tuple[float, int]:
    """(seconds, env steps) of the Stable-Baselines3 model ``make() -> (model, env)`` builds,
    learning on one thread until the mean return of its last ``window`` episodes reaches
    ``target`` (or the budget ends); the clock includes building it."""
    import torch
    from stable_baselines3.common.callbacks import BaseCallback

    torch.set_num_threads(1)

    class StopAtTarget(BaseCallback):
        def _on_step(self) -> bool:
            infos = list(self.model.ep_info_buffer)[-window:]
            return not (len(infos) >= window and sum(i["r"] for i in infos) / len(infos) >= target)

    t0 = time.time()
    model, env = make()
    model.learn(total_timesteps=total_timesteps, callback=StopAtTarget())
    seconds = time.time() - t0
    env.close()
    return seconds, model.num_timesteps
