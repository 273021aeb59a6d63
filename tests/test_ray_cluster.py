"""Ray as the cluster engine (``rlpipe launch --cluster ray``) on a local Ray cluster of two
nodes, A and B (``ray.cluster_utils.Cluster``: two raylets on this machine, each offering its
own custom resource)."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest

from shared.launch import supervisor as launch
from tests.pipeline import Run, free_port, metric_value, rlpipe, rlpipe_here

pytestmark = pytest.mark.learning


@pytest.fixture(scope="module")
def ray_address():
    cluster_utils = pytest.importorskip("ray.cluster_utils", reason="the `cluster` extra (ray) is not installed")
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"a": 1}, "include_dashboard": False})
    cluster.add_node(num_cpus=2, resources={"b": 1})
    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = cluster.address  # for the rlpipe commands, and for this process's clean-up
    try:
        yield cluster.address
    finally:
        import ray

        ray.shutdown()  # this process became a driver if a run was cleaned up from here
        cluster.shutdown()
        if old is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = old


def status(run: Run) -> dict[str, tuple[str, int | None, str]]:
    """`rlpipe status` of a Ray run: name -> (state, service pid, Ray node id)."""
    out = rlpipe("status", str(run.dir))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = re.findall(r"^(\S+)\s+(\S+)\s+pid (\S+)(?: exit \S+)?\s+node (\S+)$", out.stdout, re.M)
    return {name: (state, None if pid == "None" else int(pid), node) for name, state, pid, node in rows}


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_ppo_learns_on_two_ray_nodes_through_a_killed_sampler_actor(ray_address, tmp_path):
    """Replay and learner on node A, samplers and their action-server on node B, every array
    crossing between them as frames over TCP. A sampler actor killed with SIGKILL is restarted
    by Ray with a new sampler, and the run reaches its target; `rlpipe stop` leaves no actor,
    no process and no segment."""
    run = Run.launch(tmp_path, "cartpole_ppo.toml", 'network.transport="tcp"', f"network.base_port={free_port()}",
                     "sampler.inference='server'", "sampler.count=2", "placement.replay='a'", "placement.learner='a'",
                     "placement.sampler='b'", "placement.action_server='b'", cluster="ray")
    try:
        run.wait_steps(5_000)
        services = status(run)
        assert {s for s, (state, _, _) in services.items() if state == "RUNNING"} == \
            {"metrics0", "replay0", "learner0", "action_server0", "sampler0", "sampler1"}, services
        node = {name: row[2] for name, row in services.items()}
        assert node["sampler0"] == node["sampler1"] == node["action_server0"] != node["replay0"] == node["learner0"]
        assert metric_value(run.metrics(), "rlpipe_sampler_env_steps_total", node="b") > 0

        killed = services["sampler0"][1]
        os.kill(parent(killed), signal.SIGKILL)  # the actor: its sampler dies with it
        run.wait_for(lambda: status(run)["sampler0"][0] == "RUNNING" and status(run)["sampler0"][1] != killed, 60,
                     "Ray to restart the sampler actor")
        assert not Path(f"/proc/{killed}").exists()
        result = run.wait_result(240)
        assert result["reason"] == "target" and result["mean_return"] >= 475 and result["env_steps"] <= 200_000, result
        assert run.logs("sampler0").count("services.sampler: sampler 0:") == 2  # the log holds both incarnations

        out = rlpipe("stop", str(run.dir))
        assert out.returncode == 0, out.stdout + out.stderr
        assert launch.service_pids(run.dir) == [] and run.segments() == []
        assert "not running" in rlpipe("status", str(run.dir)).stdout
    finally:
        run.close()


def test_cluster_targets_are_ray_or_a_ray_client_address(monkeypatch):
    from shared.launch.ray_backend import parse_target

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert parse_target("ray") == "10.0.0.5:6379" and parse_target("ray://head:10001") == "ray://head:10001"
    monkeypatch.delenv("RAY_ADDRESS")
    assert parse_target("ray") == "auto"
    for bad in ("ray://", "slurm", "k8s://x"):
        with pytest.raises(ValueError, match="expected ray or ray://HOST:PORT"):
            parse_target(bad)


def test_a_run_whose_cluster_is_gone_is_not_running_and_stops_at_once(tmp_path):
    """`rlpipe status/stop/clean` of a Ray run whose cluster went away answer at once (ray.init
    would wait minutes for a GCS that is gone), through the run's backend; `scale` says in one
    line that Ray runs do not scale."""
    import json
    import time

    from shared.launch import backend, ray_backend as ray_cluster, supervisor
    from shared.runtime.runfiles import RUN_CONFIG

    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / ray_cluster.CLUSTER_FILE).write_text(json.dumps(
        {"engine": "ray", "address": f"127.0.0.1:{free_port()}", "namespace": "rlpipe-x", "actors": ["replay0"]}))
    (run_dir / RUN_CONFIG).touch()  # what makes it a run directory for the commands
    was_driver = ray_driver()  # of the two-node test's cluster, when it ran before in this process
    t0 = time.monotonic()
    assert backend.for_run(run_dir) is ray_cluster and backend.for_run(tmp_path) is supervisor
    assert not backend.for_run(run_dir).running(run_dir) and backend.for_run(run_dir).stop(run_dir)
    assert ray_cluster.actor_states(run_dir) == {"replay0": {"state": "GONE", "pid": None, "exit_code": None, "node": None}}
    for command, code, out in ((["status"], 0, "run: not running\n"), (["stop"], 0, "run: stopped\n"),
                               (["clean"], 0, "run: killed 0 process(es), removed 0 shared-memory segment(s)\n"),
                               (["scale", "sampler=2"], 2, "")):
        done = rlpipe_here(command[0], str(run_dir), *command[1:])
        assert (done.returncode, done.stdout) == (code, out), done
    assert done.stderr == "rlpipe: scale: this run's services are Ray actors: live scaling works on supervisord runs " \
                          "only\n"
    assert time.monotonic() - t0 < 10
    assert ray_driver() == was_driver, "the commands on a gone cluster's run started a local Ray instance"


def ray_driver() -> bool:
    """Whether this process is a Ray driver."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def test_an_actor_reports_its_spent_restart_cap_and_its_log_rotates(tmp_path, monkeypatch):
    """No cluster needed: the actor class runs its service as a child in a plain process. A
    service that fails on the actor's last allowed start says so in its log (the child's own
    output copied before it); and the log is rotated as supervisord rotates its logs."""
    import subprocess
    import textwrap

    from shared.launch import ray_backend

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "nosuch0.starts").write_text(str(ray_backend.MAX_RESTARTS))  # this start is the last Ray makes
    script = textwrap.dedent(f"""
        import time
        from shared.launch.ray_backend import ServiceActor
        ServiceActor("nosuch", 0, {str(tmp_path)!r}, False, {{"PYTHONPATH": {os.getcwd()!r}}})
        time.sleep(30)  # the actor's watcher ends this process when its service fails
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    text = (logs / "nosuch0.log").read_text()
    assert done.returncode == 1, done.stderr
    assert f"restarted by Ray ({ray_backend.MAX_RESTARTS} of {ray_backend.MAX_RESTARTS})" in text
    assert "No module named services.nosuch" in text  # the service's own output, before the cap line
    assert text.rstrip().endswith("Ray will not start it again; the service stays down (`rlpipe status`: GONE)")
    assert "restart cap" in done.stderr
    assert (logs / "nosuch0.starts").read_text() == str(ray_backend.MAX_RESTARTS + 1)
    assert oct(os.stat(logs / "nosuch0.log").st_mode & 0o777) == "0o600"

    monkeypatch.setattr(ray_backend, "LOG_MAX_BYTES", 1000)
    handler = ray_backend.rotating_log(tmp_path / "x.log")
    for i in range(100):
        ray_backend.write_line(handler, f"line {i:3d} " + "." * 40 + "\n")
    handler.close()
    assert sorted(p.name for p in tmp_path.glob("x.log*")) == ["x.log", "x.log.1"]
    assert all(p.stat().st_size <= 1000 for p in tmp_path.glob("x.log*"))
    assert (tmp_path / "x.log").read_text().rstrip().endswith("line  99 " + "." * 40)
