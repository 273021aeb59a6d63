"""``algo.value_norm``: the value net learns the returns normalised by their running statistics
(MAPPO's ValueNorm): the statistics, the targets against the same net in returns' units, and the
update and checkpoint of A2C and PPO with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.build import make_algo
from shared.agents.config import AgentInfo
from shared.algos.gae import pg_targets
from shared.algos.hparams import PgTargetsConfig
from shared.algos.value_norm import ValueNorm
from shared.config import loading
from shared.data.batches import OnPolicyBatch, Samples
from tests.test_gae import sum_value_agent
from tests.test_memory import local_segments


def test_the_statistics_weigh_each_update_alike_and_invert():
    norm = ValueNorm(torch.device("cpu"))
    mean, std = norm.mean_std()
    assert float(mean) == 0.0 and float(std) == pytest.approx(0.1)  # before any update: the floor
    norm.update(torch.tensor([1.0, 3.0]))  # mean 2, mean of squares 5
    norm.update(torch.tensor([10.0]))  # 10, 100
    mean, std = norm.mean_std()
    # Debiased: the plain mean of the two updates' moments (to ~1e-5, the weights' difference).
    assert float(mean) == pytest.approx(6.0, rel=1e-4)
    assert float(std) == pytest.approx(np.sqrt(52.5 - 36.0), rel=1e-4)
    x = torch.tensor([-3.0, 0.0, 17.5])
    torch.testing.assert_close(norm.denormalize(norm.normalize(x)), x)
    torch.testing.assert_close(norm.normalize(torch.tensor([6.0, 6.0 + float(std)])), torch.tensor([0.0, 1.0]))
    constant = ValueNorm(torch.device("cpu"))
    for _ in range(3):
        constant.update(torch.full((4,), 7.0))
    assert float(constant.mean_std()[1]) == pytest.approx(0.1)  # not blown up by a zero variance


def segment(T: int = 4, B: int = 2) -> OnPolicyBatch:
    """A segment with a termination and a truncation (whose final observation the net values)."""
    terminated = torch.zeros(T, B, dtype=torch.bool)
    truncated = torch.zeros(T, B, dtype=torch.bool)
    terminated[2, 0] = True
    truncated[1, 1] = True
    g = torch.Generator().manual_seed(0)
    samples = Samples(
        observation=torch.rand(T, B, 2, generator=g), action=torch.zeros(T, B, dtype=torch.int64),
        reward=torch.randn(T, B, generator=g) * 30, terminated=terminated, truncated=truncated,
        final_observation=torch.rand(T, B, 2, generator=g),
        agent_info=AgentInfo(torch.zeros(T, B), torch.zeros(T, B)),
        policy_version=torch.zeros(T, B, dtype=torch.int64), failed=torch.zeros(T, B, dtype=torch.bool))
    return OnPolicyBatch(samples, torch.zeros(B), torch.rand(B, 2, generator=g))


def test_the_targets_are_those_of_the_net_in_returns_units():
    """A net whose outputs are normalised values under statistics (m, s) gives the advantages the
    net m + s x output gives without them; its targets are those returns normalised by the
    statistics after the update, its V(s_t) its own outputs."""
    norm = ValueNorm(torch.device("cpu"))
    norm.update(torch.tensor([-40.0, 10.0]))
    norm.update(torch.tensor([-20.0]))
    m, s = (float(v) for v in norm.mean_std())
    cfg = PgTargetsConfig(gamma=0.9, gae_lambda=0.8)
    normalised = sum_value_agent()
    plain = sum_value_agent()
    plain.value = lambda obs: m + s * obs.sum(-1)
    batch = segment()
    with_norm = pg_targets(normalised, batch, cfg, norm)
    without = pg_targets(plain, batch, cfg)
    torch.testing.assert_close(with_norm.advantage, without.advantage)
    torch.testing.assert_close(with_norm.old_value, batch.samples.observation.sum(-1).reshape(-1))
    m2, s2 = (float(v) for v in norm.mean_std())
    assert (m2, s2) != (m, s)  # the statistics took in this batch's returns before normalising them
    torch.testing.assert_close(with_norm.returns, (without.returns - m2) / s2)


@pytest.mark.parametrize("config", ["cartpole_ppo.toml", "cartpole_a2c.toml"])
def test_an_update_trains_on_normalised_returns_and_a_checkpoint_keeps_the_statistics(config):
    """Rewards of a thousand a step: with value_norm the value loss is in normalised units, and
    a restored algorithm holds the statistics the saved one had."""
    exp = loading.load(f"deploy/configs/{config}", ["algo.value_norm=true", "sampler.envs=4", "sampler.horizon=16",
                                                     "sampler.count=1", "sampler.inference='local'",
                                                     "learner.batch_segments=1"])
    agent, (seg,) = local_segments(exp, 1, f"valuenorm{config[9:12]}")
    seg.samples.reward.mul_(1000.0)
    algo = make_algo(exp, agent)
    torch.manual_seed(0)
    stats = algo.update(seg, 0.0).stats
    assert stats["value_loss"] < 10, stats  # the returns are in the thousands
    restored = make_algo(exp, agent)
    restored.load_state_dict(algo.state_dict())
    assert float(algo.value_norm.mean_std()[0]) > 100
    for a, b in zip(algo.value_norm.mean_std(), restored.value_norm.mean_std()):
        assert torch.equal(a, b)
