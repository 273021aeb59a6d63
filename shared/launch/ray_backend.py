"""Ray as the cluster engine: ``rlpipe launch CONFIG --cluster ray[://ADDRESS]``.

Every service instance of the run is a detached Ray actor, named ``<service><i>`` in the
run's namespace (``rlpipe-<run id>``). The actor starts the entry point supervisord would
(``python -m services.<service> --run-dir RUN --instance I``) as its child, with the child's
output appended to ``<run>/logs/<service><i>.log`` (rotated as supervisord rotates it:
``LOG_MAX_BYTES``, ``LOG_BACKUPS``), and it supervises the child as supervisord does: a child
that fails (or, but for the learner, ends at all) ends the actor, and Ray restarts the actor
(``MAX_RESTARTS``) with a new child. Each restart, and the failure after which Ray restarts
it no more, is a line in that log (and in the actor's own, Ray's). The child is killed
with its actor (SIGKILL on the parent's death), so ``ray.kill`` of an actor, or a node
that dies, leaves no orphan; a restarted service removes what its predecessor left in
/dev/shm, as under supervisord.

Placement (``[placement]``): services labelled ``main`` go to the node of the Ray driver
that launched the run (node affinity); a service labelled ``L`` to any node that offers the
custom resource ``L`` (``ray start --resources='{"L": 1}'``). Actors ask for no CPU (a
service is not one Ray task; the OS shares the cores, as under supervisord), and learners
and action-servers for a GPU when ``run.device`` names CUDA. Links between labels carry
their arrays as frames over TCP (docs/architecture.md, "Data across nodes").

The run directory records the cluster's address and namespace (``cluster.json``), so
``rlpipe status/stop/clean`` reach the actors from any process; ``logs`` reads the files.
The run directory must be reachable at the same path from every node (one host, or a
shared filesystem).

Authentication: Ray's token authentication (Ray >= 2.52, ``RAY_AUTH_MODE=token`` on every
node and in the launching shell, the token in ``~/.ray/auth_token`` or ``RAY_AUTH_TOKEN``)
is what keeps other users of the network from running code on the cluster, and with it in
the run's services; ``start`` says so in a warning line when it is off. Ray turns it on by
itself for the local cluster (``auto``) when a token exists. The services get no token:
they never talk to Ray (``RAY_AUTH_TOKEN`` is dropped from their environment).

This module is the Ray backend (``shared.launch.backend.Backend``); live scaling is not
one of its powers (``scale`` says so).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from shared.config import endpoints
from shared.launch.supervisor import ScaleError, service_pids
from shared.runtime.process import PRIVATE_UMASK, signal_at_parent_death
from shared.runtime.runfiles import CLUSTER_FILE, LOGS_DIR, METRICS_DIR

log = logging.getLogger(__name__)

MAX_RESTARTS = 20  # an actor's restarts for the whole run (Ray's max_restarts), reported when spent
LOG_MAX_BYTES = 20 * 2**20  # as supervisord's stdout_logfile_maxbytes
LOG_BACKUPS = 1
TOKEN_ENV = "RAY_AUTH_TOKEN"
STOP_WAIT_S = 5.0  # as supervisord's stopwaitsecs: SIGTERM, then SIGKILL
START_TIMEOUT_S = 60.0  # every actor placed and its service started
CONNECT_TIMEOUT_S = 2.0  # the cluster's GCS must answer within this to count as there


def is_cluster_run(run_dir: Path) -> bool:
    return (Path(run_dir) / CLUSTER_FILE).exists()


def parse_target(target: str) -> str:
    """The address ``ray.init`` takes for ``--cluster`` TARGET: ``ray`` (RAY_ADDRESS, else the
    cluster this host runs) or ``ray://HOST:PORT`` (Ray Client); ValueError otherwise."""
    if target == "ray":
        return os.environ.get("RAY_ADDRESS") or "auto"
    if target.startswith("ray://") and len(target) > len("ray://"):
        return target
    raise ValueError(f"--cluster {target!r}: expected ray or ray://HOST:PORT")


def _connect(address: str, namespace: str) -> None:
    """This process a driver of the cluster at ``address`` (once; again for another cluster)."""
    import ray

    if ray.is_initialized():
        if ray.get_runtime_context().gcs_address == address:
            return
        ray.shutdown()
    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="WARNING")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the actor that started it dies."""
    signal_at_parent_death(signal.SIGKILL)


def _count_start(path: Path) -> int:
    """How many times this actor has started in the run, this start included (kept in ``path``:
    Ray restarts an actor from scratch, and says nothing of how many restarts are left)."""
    try:
        starts = int(path.read_text() or 0) + 1
    except (FileNotFoundError, ValueError):
        starts = 1
    path.write_text(str(starts))
    return starts


def rotating_log(path: Path) -> logging.Handler:
    """A handler that appends a service's output lines to ``path`` as they come, rotated at
    ``LOG_MAX_BYTES`` with ``LOG_BACKUPS`` old files, as supervisord does with its logs."""
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=LOG_MAX_BYTES, backupCount=LOG_BACKUPS,
                                                   encoding="utf-8", errors="replace")
    handler.terminator = ""  # the lines keep their own newlines
    return handler


def write_line(handler: logging.Handler, text: str) -> None:
    handler.emit(logging.makeLogRecord({"msg": text}))


class ServiceActor:
    """One service instance: its process as this actor's child (module doc)."""

    def __init__(self, service: str, instance: int, run_dir: str, restart_on_success: bool, environment: dict):
        os.umask(PRIVATE_UMASK)  # this worker process is the actor's alone: its log files are private
        self.name, self.restart_on_success, self.stopping = f"{service}{instance}", restart_on_success, False
        logs = Path(run_dir) / LOGS_DIR
        self.restarts = _count_start(logs / f"{self.name}.starts") - 1
        self.log = rotating_log(logs / f"{self.name}.log")
        if self.restarts:
            write_line(self.log, f"rlpipe: actor {self.name} restarted by Ray ({self.restarts} of {MAX_RESTARTS})\n")
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(Path(run_dir) / METRICS_DIR), "PYTHONUNBUFFERED": "1",
               **environment}  # the launcher's import path (rundirs.service_env)
        env.pop(TOKEN_ENV, None)  # the cluster's token: the services never talk to Ray
        self.child = subprocess.Popen(
            [sys.executable, "-m", f"services.{service}", "--run-dir", run_dir, "--instance", str(instance)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=run_dir,
            preexec_fn=_die_with_parent)
        self.copied = threading.Event()
        threading.Thread(target=self._copy_output, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _copy_output(self) -> None:
        for line in iter(self.child.stdout.readline, b""):
            write_line(self.log, line.decode(errors="replace"))
        self.copied.set()

    def _watch(self) -> None:
        code = self.child.wait()
        if not self.stopping and (code != 0 or self.restart_on_success):
            self.copied.wait(2.0)  # the service's last lines first
            if self.restarts >= MAX_RESTARTS:
                text = (f"rlpipe: {self.name} failed (exit {code}) after {self.restarts} restarts: its restart cap "
                        f"(ray_backend.MAX_RESTARTS = {MAX_RESTARTS}) is spent and Ray will not start it again; "
                        "the service stays down (`rlpipe status`: GONE)")
                write_line(self.log, text + "\n")
                print(text, file=sys.stderr, flush=True)  # the actor's own log, in Ray's session logs
            os._exit(1)  # Ray restarts the actor, and with it the service

    def info(self) -> dict:
        import ray

        code = self.child.poll()
        return {"state": "RUNNING" if code is None else "EXITED", "pid": self.child.pid, "exit_code": code,
                "node": ray.get_runtime_context().get_node_id()}

    def stop(self) -> int | None:
        """SIGTERM the service, SIGKILL it after STOP_WAIT_S; its exit code."""
        self.stopping = True
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)
            try:
                self.child.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
        return self.child.returncode


def start(exp, run_dir: Path, target: str = "ray") -> None:
    """Place every service instance of the run as an actor on the cluster ``target`` names
    (``parse_target``; by default RAY_ADDRESS's, else the one this host runs)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from shared.launch.rundirs import programs, service_env

    namespace = f"rlpipe-{run_dir.name}"
    _connect(parse_target(target), namespace)
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        log.warning("the Ray cluster is reached without token authentication: whoever can reach it can run code "
                    "there, in this run's services too; start the cluster and this launch with RAY_AUTH_MODE=token "
                    "(docs/architecture.md, \"Ray as the cluster engine\")")
    here = ray.get_runtime_context().get_node_id()
    instances = [(service, i, autorestart) for service, count, _, autorestart in programs(exp) for i in range(count)]
    # Written before any actor exists: a launch that fails half-way is cleaned up by these names.
    (run_dir / CLUSTER_FILE).write_text(json.dumps({
        "engine": "ray", "address": ray.get_runtime_context().gcs_address, "namespace": namespace,
        "actors": [f"{service}{i}" for service, i, _ in instances]}))
    remote = ray.remote(ServiceActor)
    actors = []
    for service, i, autorestart in instances:
        label = exp.placement.node(service)
        gpu = 1 if service in ("learner", "action_server") and exp.run.device.startswith("cuda") else 0
        where = {"scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)} if label == "main" \
            else {"resources": {label: 0.001}}
        actors.append(remote.options(name=f"{service}{i}", lifetime="detached", max_restarts=MAX_RESTARTS,
                                     num_cpus=0, num_gpus=gpu, **where)
                      .remote(service, i, str(run_dir), autorestart == "true", service_env(exp)))
    try:
        ray.get([a.info.remote() for a in actors], timeout=START_TIMEOUT_S)  # every service started
    except ray.exceptions.GetTimeoutError:
        labels = sorted(set(exp.placement.labels().values()) - {"main"})
        raise RuntimeError(f"the run's actors were not all placed within {START_TIMEOUT_S:.0f} s: does a node of the "
                           f"cluster offer each of the resources {labels} ([placement] labels)?") from None


def _reachable(address: str) -> bool:
    """Whether the cluster's GCS at ``host:port`` accepts a connection (``ray.init`` waits minutes
    for one that is gone)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        return True
    except (OSError, ValueError):
        return False


def _actors(run_dir: Path) -> dict:
    """Name -> actor handle (None where Ray holds no such actor any more; all None when the
    cluster itself is gone, and its actors with it)."""
    import ray

    info = json.loads((Path(run_dir) / CLUSTER_FILE).read_text())
    if not _reachable(info["address"]):
        return dict.fromkeys(info["actors"])
    _connect(info["address"], info["namespace"])
    out = {}
    for name in info["actors"]:
        try:
            out[name] = ray.get_actor(name, namespace=info["namespace"])
        except ValueError:
            out[name] = None
    return out


def actor_states(run_dir: Path) -> dict[str, dict]:
    """Name -> {state, pid, exit_code, node} of every service actor (state GONE, RESTARTING)."""
    import ray

    out = {}
    for name, actor in _actors(run_dir).items():
        if actor is None:
            out[name] = {"state": "GONE", "pid": None, "exit_code": None, "node": None}
            continue
        try:
            out[name] = ray.get(actor.info.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            out[name] = {"state": "RESTARTING", "pid": None, "exit_code": None, "node": None}
    return out


def status(run_dir: Path) -> int:
    """Print one line an actor: name, state, the service's pid (and exit code), its Ray node; 0."""
    for name, info in actor_states(run_dir).items():
        code = "" if info["exit_code"] is None else f" exit {info['exit_code']}"
        print(f"{name:<20} {info['state']:<11} pid {info['pid']}{code}  node {info['node']}")
    return 0


def running(run_dir: Path) -> bool:
    """Whether any service actor of the run is still held by Ray."""
    return any(actor is not None for actor in _actors(run_dir).values())


def supervised(run_dir: Path) -> bool:
    """As ``running``: an actor's service dies with it (``_die_with_parent``)."""
    return running(run_dir)


def running_here(run_dir: Path) -> bool:
    """Whether a service of the run runs on this host (no question to the cluster)."""
    return bool(service_pids(run_dir))


def scale(run_dir: Path, counts: dict[str, int]) -> tuple[list[str], list[str], list[str]]:
    """Live scaling works on supervisord runs only: ScaleError."""
    raise ScaleError("this run's services are Ray actors: live scaling works on supervisord runs only")


def stop(run_dir: Path, timeout_s: float = 60.0) -> bool:
    """Stop every service (SIGTERM, as supervisord would) and end its actor, then remove the
    run's socket directory; True when no actor is left and no process of the run on this host."""
    stopped = _stop_actors(run_dir, timeout_s)
    shutil.rmtree(endpoints.socket_dir(run_dir), ignore_errors=True)
    return stopped and not service_pids(run_dir)


def _stop_actors(run_dir: Path, timeout_s: float) -> bool:
    """SIGTERM every service through its actor, then end the actors; True when Ray holds none."""
    import ray

    actors = {name: a for name, a in _actors(run_dir).items() if a is not None}
    if not actors:  # none left, or the cluster is gone: ray.get would start a local Ray instance (~10 s)
        return True
    pending = [a.stop.remote() for a in actors.values()]
    try:
        ray.get(pending, timeout=timeout_s)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        pass  # an actor restarting or gone: killed below all the same
    for actor in actors.values():
        ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while running(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not running(run_dir)
