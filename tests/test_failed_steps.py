"""A failed env step (the env raised) is no transition: the sampler marks it ``Samples.failed``,
and it is in no sampled batch, on-policy (A2C, PPO, PQN, recurrent too) or off-policy (n-step
transitions), while the steps before it keep their own targets."""

from __future__ import annotations

import time

import pytest
import torch

from services.build import make_algo
from shared.config.topology import topology
from shared.algos.gae import pg_targets, real_steps
from shared.config import loading
from shared.data.namedarraytuple import from_spec, map_leaves, spec_of
from shared.replay.rate_limiter import RateLimiter
from shared.replay.selectors import Fifo
from shared.replay.storage import StorageConfig
from shared.replay.tables import Table
from shared.replay.transitions import TransitionStorage, TransitionStorageConfig
from tests.test_memory import local_segments

torch.set_num_threads(1)
T, B, FAIL_ENV, FAIL_AT = 8, 3, 1, 3  # env 1's 3rd step raises: step t = 2 of the first segment


def collect(config: str, *overrides: str, segments: int = 2, mode: str = "raise"):
    """(experiment, agent, segments as torch trees) of one local sampler over FaultyEnv, whose
    env FAIL_ENV fails at its FAIL_AT-th step (once: the recreated env has another seed): it
    raises, or with ``mode = "sleep"`` hangs (give ``env.step_timeout_s`` in ``overrides``)."""
    seed = topology(loading.load(f"deploy/configs/{config}")).env_seed(0) + FAIL_ENV
    exp = loading.load(f"deploy/configs/{config}", [
        "env.id='tests.envs_for_tests:make_faulty_env'",
        f"env.kwargs='{{\"fail_seed\": {seed}, \"fail_at\": {FAIL_AT}, \"mode\": \"{mode}\"}}'",
        "sampler.count=1", f"sampler.envs={B}", f"sampler.horizon={T}", f"sampler.ring={segments + 1}",
        "sampler.inference='local'", "learner.batch_segments=1", *overrides])
    agent, out = local_segments(exp, segments + 1, "failtest")  # the last one brings the bootstraps of the others
    return exp, agent, out[:segments]


def failed_x(exp) -> torch.Tensor:
    """The observation the failed step was taken in: FaultyEnv's x = (steps so far, seed, 0)."""
    seed = topology(exp).env_seed(0) + FAIL_ENV
    return torch.tensor([FAIL_AT - 1, seed, 0.0])


@pytest.mark.parametrize("mode", ["raise", "sleep"])
def test_the_sampler_marks_the_failed_step_and_truncates_it(mode):
    """An env that raises, or hangs in ``step()`` past ``env.step_timeout_s`` (interrupted)."""
    t0 = time.monotonic()
    exp, _, (seg, _) = collect("cartpole_ppo.toml", "env.step_timeout_s=0.2", mode=mode)
    assert time.monotonic() - t0 < 10  # the 60 s sleep was cut short
    s = seg.samples
    expected = torch.zeros(T, B, dtype=torch.bool)
    expected[FAIL_AT - 1, FAIL_ENV] = True
    assert torch.equal(s.failed, expected)
    assert bool(s.truncated[FAIL_AT - 1, FAIL_ENV]) and float(s.reward[FAIL_AT - 1, FAIL_ENV]) == 0.0
    assert torch.equal(s.observation.x[FAIL_AT - 1, FAIL_ENV], failed_x(exp))


def test_a_failed_step_is_in_no_on_policy_batch_of_a2c_or_ppo():
    exp, agent, (seg, _) = collect("cartpole_ppo.toml")
    data = pg_targets(agent, seg, exp.algo)
    assert data.advantage.shape == (T * B - 1,)
    assert not (data.observation.x == failed_x(exp)).all(-1).any()
    # Zero weight in the loss: a failed step's reward, however absurd, changes no loss term.
    seg.samples.reward[FAIL_AT - 1, FAIL_ENV] = 1e6
    torch.manual_seed(0)
    stats = make_algo(exp, agent).update(seg, 0.0).stats
    assert stats["value_loss"] < 1e3, stats


def test_a_failed_step_has_no_weight_in_pqn_or_recurrent_ppo():
    exp, agent, (seg, _) = collect("cartpole_pqn.toml")
    seg.samples.reward[FAIL_AT - 1, FAIL_ENV] = 1e6
    assert make_algo(exp, agent).update(seg, 0.0).stats["loss"] < 1e3
    exp, agent, (seg, _) = collect("cartpole_novel_ppo_lstm.toml", "algo.minibatches=1", "model.normalize_observations=false")
    data = pg_targets(agent, seg, exp.algo)
    real, = real_steps(data)
    assert data.valid.sum() == T * B - 1 and real.advantage.shape == (T * B - 1,)
    assert not (real.observation.x == failed_x(exp)).all(-1).any()
    seg.samples.reward[FAIL_AT - 1, FAIL_ENV] = 1e6
    assert make_algo(exp, agent).update(seg, 0.0).stats["value_loss"] < 1e3


@pytest.mark.parametrize("n_step", [1, 3])
def test_a_failed_step_is_in_no_sampled_transition(n_step):
    exp, _, segs = collect("cartpole_ppo.toml")
    storage = TransitionStorage(spec_of(segs[0].samples), {0: B},
                                StorageConfig(capacity=B * 4 * T), TransitionStorageConfig(n_step=n_step, gamma=0.5))
    table = Table(storage, Fifo(), RateLimiter())
    for seg in segs:
        table.insert(0, map_leaves(lambda x: x.numpy(), seg.samples))
    items = []
    while table.can_sample(1):
        dest = from_spec(storage.batch_spec(1))
        table.sample_into(dest, 1)
        items.append((dest.observation.x[0].copy(), float(dest.return_[0]), float(dest.bootstrap_discount[0]),
                      dest.bootstrap_observation.x[0].copy()))
    bad = failed_x(exp).numpy()
    assert len(items) == 2 * T * B - 1 - B * n_step  # all but the failed step and the last n of each env
    assert not any((x == bad).all() for x, *_ in items)
    # The step before it bootstraps from the observation the failed step was taken in, one step on.
    before = [item for item in items if (item[0] == bad - [1, 0, 0]).all()]
    assert len(before) == 1 and before[0][1:3] == (1.0, 0.5) and (before[0][3] == bad).all()
