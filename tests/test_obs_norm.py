"""Observation normalisation: running moments from inserted segments, merged by the learner."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from shared.agents.config import ModelConfig
from shared.agents.qpg import SacAgent
from shared.algos.qpg import SAC, SACConfig
from shared.agents.models import ObsNorm, make_obs_norm
from shared.data.obs_stats import Moments, merge


def test_moments_merged_chunk_by_chunk_equal_the_mean_and_variance_of_all_data():
    rng = np.random.default_rng(0)
    chunks = [rng.normal(loc=[3.0, -100.0], scale=[0.5, 20.0], size=(rng.integers(1, 50), 4, 2)) for _ in range(30)]
    count, mean, var = 0.0, np.zeros(2), np.ones(2)
    moments = Moments((2,))
    for i, chunk in enumerate(chunks):
        moments.add(chunk)
        if i % 3 == 2:  # several segments per sampled batch, as replay reports them
            sums = moments.take()
            count, mean, var = merge(count, mean, var, sums["obs_count"], np.array(sums["obs_sum"]),
                                     np.array(sums["obs_sumsq"]))
    everything = np.concatenate([c.reshape(-1, 2) for c in chunks[:30]])
    assert count == len(everything)
    np.testing.assert_allclose(mean, everything.mean(0), rtol=1e-9)
    np.testing.assert_allclose(var, everything.var(0), rtol=1e-6)
    assert moments.take()["obs_count"] == 0  # taken: nothing is reported twice


def test_obs_norm_normalises_and_clips_with_its_buffers():
    norm = ObsNorm((2,), clip=5.0)
    x = np.random.default_rng(1).normal([10.0, 0.0], [2.0, 0.01], size=(5000, 2))
    norm.update(len(x), x.sum(0), np.square(x).sum(0))
    y = norm(torch.as_tensor(x, dtype=torch.float32))
    np.testing.assert_allclose(y.mean(0).numpy(), 0.0, atol=1e-3)
    np.testing.assert_allclose(y.std(0).numpy(), 1.0, atol=1e-2)
    assert norm(torch.tensor([[1e6, -1e6]])).tolist() == [[5.0, -5.0]]
    assert set(norm.state_dict()) == {"count", "mean", "var"}  # published and checkpointed with the agent


def test_agents_carry_the_normaliser_in_their_state_and_targets_copy_it():
    cfg = ModelConfig((16,), "relu", normalize_observations=True)
    agent = SacAgent(np.zeros(3, np.float32), gym.spaces.Box(-1, 1, (1,), np.float32), cfg)
    assert {"obs_norm.mean", "obs_norm.var", "obs_norm.count"} <= set(agent.state_dict())
    algo = SAC(agent, SACConfig())
    agent.obs_norm.update(10, [10.0, 20.0, 30.0], [20.0, 50.0, 100.0])
    algo.update_target(algo.cfg.tau)
    torch.testing.assert_close(algo.target.obs_norm.mean, agent.obs_norm.mean)  # copied, not averaged
    with pytest.raises(ValueError, match="one float array"):
        make_obs_norm(np.zeros((4, 4), np.uint8), cfg)


def test_the_learner_merges_a_batchs_statistics_after_its_update():
    """The statistics that come with a batch merge into the normaliser after the update, so the
    update normalises the batch as the behaviour policy did; the next version has them."""
    from services.build import env_probe, make_agent
    from services.learner.learner import Learner
    from shared.agents.config import AgentInfo
    from shared.algos.update import Update
    from shared.config import loading
    from shared.data.batches import OnPolicyBatch, Samples
    from tests.pipeline import CONFIGS

    exp = loading.load(CONFIGS / "cartpole_ppo.toml", ["model.normalize_observations=true"])
    probe = env_probe(exp)
    agent = make_agent(exp, probe)
    probe.close()

    class Recorder:
        seen = []

        def update(self, batch, progress):
            self.seen.append(agent.obs_norm.mean.clone())
            return Update({})

    learner = Learner(exp, agent, Recorder(), torch.device("cpu"), None)
    T, B = 2, 3
    z = np.zeros((T, B), np.float32)
    obs = np.full((T, B, 4), 5.0, np.float32)
    samples = Samples(observation=obs, action=z.astype(np.int64), reward=z, terminated=z.astype(bool),
                      truncated=z.astype(bool), final_observation=obs, agent_info=AgentInfo(z, z),
                      policy_version=z.astype(np.int64), failed=z.astype(bool))
    slot = OnPolicyBatch(samples, np.zeros(B, np.float32), obs[0])
    meta = {"env_steps": T * B, "episodes": [], "obs_count": T * B, "obs_sum": [5.0 * T * B] * 4,
            "obs_sumsq": [25.0 * T * B] * 4}
    before = agent.obs_norm.mean.clone()
    learner.train(slot, meta)
    assert torch.equal(Recorder.seen[0], before)  # the update saw the statistics the actors used
    np.testing.assert_allclose(agent.obs_norm.mean.numpy(), 5.0)  # and the next version has the merged ones
    learner.train(slot, {**meta, "obs_count": 0, "obs_sum": [], "obs_sumsq": []})
    np.testing.assert_allclose(Recorder.seen[1].numpy(), 5.0)
