"""Ape-X epsilons: one rule in every mode (issue 26). Each env's epsilon is spread over the
global env indices of all the samplers the run may have (``sampler.max_count * sampler.envs``,
shared/config/topology.py), in serial mode as in the pipeline's samplers and action-servers."""

from __future__ import annotations

import numpy as np

from services.serial import train_serial
from shared.config.topology import topology
from shared.agents.config import QAgentConfig
from shared.config import loading as config
from tests.pipeline import CONFIGS


def test_serial_and_pipeline_apex_epsilons_agree_when_max_count_exceeds_count(monkeypatch):
    exp = config.load(CONFIGS / "cartpole_dqn.toml", [
        "sampler.count=2", "sampler.max_count=4", "sampler.envs=2", "sampler.horizon=8", "agent.apex_alpha=7.0",
        "agent.apex_eps_base=0.4", "agent.eps_decay_steps=0", "run.max_env_steps=64", "replay.min_size_to_sample=16",
        "replay.samples_per_insert=0.5", "algo.batch_size=8"])
    seen: dict[int, set] = {}  # global env index -> (envs_total, epsilon) serial mode used
    original = QAgentConfig.epsilon

    def recording(self, env_steps, env_index, n_envs_total):
        eps = original(self, env_steps, env_index, n_envs_total)
        for j, e in zip(np.atleast_1d(env_index).tolist(), np.atleast_1d(eps).tolist()):
            seen.setdefault(int(j), set()).add((n_envs_total, e))
        return eps

    monkeypatch.setattr(QAgentConfig, "epsilon", recording)
    assert train_serial(exp)["reason"] == "budget"

    # The pipeline: sampler i's envs are topo.env_base(i) + 0..envs-1, and its local actions
    # and the action-servers both pass topo.total_envs (services/sampler/__main__.py,
    # services/action_server/__main__.py).
    topo = topology(exp)
    assert topo.total_envs == 4 * 2
    pipeline = {topo.env_base(i) + j: {(topo.total_envs, float(original(exp.agent, 0, topo.env_base(i) + j,
                                                                           topo.total_envs)))}
                for i in range(exp.sampler.count) for j in range(exp.sampler.envs)}
    assert seen.keys() == pipeline.keys() == {0, 1, 2, 3}
    for j in seen:
        (total, eps), = seen[j]
        (want_total, want_eps), = pipeline[j]
        assert total == want_total and np.isclose(eps, want_eps, rtol=1e-6), (j, seen[j], pipeline[j])
    # the test has power: spread over count * envs = 4 envs, env 3 would get the greediest epsilon
    assert not np.isclose(original(exp.agent, 0, 3, 4), pipeline[3].copy().pop()[1])
