"""Services placed on several nodes (``[placement]``): every array crosses as ZeroMQ frames over
TCP (CURVE), none through shared memory, and the run learns as on one node."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.launch import supervisor as launch
from tests.pipeline import free_port, rlpipe

pytestmark = pytest.mark.learning


def mapped(pid: int, run_id: str) -> set[str]:
    """The run's shared-memory segments process ``pid`` maps, as ``<service><i>-<purpose>``."""
    prefix = f"/dev/shm/rlpipe-{run_id}-"
    return {line.split(prefix, 1)[1].strip() for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if prefix in line}


def test_ppo_learns_with_samplers_and_learner_on_other_nodes_than_replay(runs):
    """Samplers and their action-server on node b, the learner on c, replay on main: segments,
    batches and parameter versions all go as frames (nobody maps another node's segment)."""
    run = runs("cartpole_ppo.toml", 'network.transport="tcp"', f"network.base_port={free_port()}",
               "sampler.inference='server'", "placement.sampler='b'", "placement.action_server='b'",
               "placement.learner='c'")
    run.wait_steps(5_000)
    maps = {name: mapped(run.pid(name), run.id) for name in ("replay0", "sampler0", "action_server0", "learner0")}
    assert not any(m.startswith(("sampler", "learner")) for m in maps["replay0"]), maps
    assert not any(m.startswith("learner") for m in maps["action_server0"]), maps
    assert {"sampler0-slot0", "sampler0-slot1"} <= maps["action_server0"]  # on one node: the step slots are shared
    result = run.wait_result(240)
    assert result["reason"] == "target" and result["mean_return"] >= 475 and result["env_steps"] <= 200_000, result
    out = rlpipe("stop", str(run.dir))
    assert out.returncode == 0, out.stdout + out.stderr
    assert launch.service_pids(run.dir) == [] and run.segments() == []
