"""R2D1's loss: value rescaling, n-step targets inside sequences, burn-in, sequence priorities."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.config import loading, schema
from shared.agents.config import ModelConfig, QAgentConfig, RnnState
from shared.agents.q import QAgent
from shared.algos.hparams import R2D1Config
from shared.algos.r2d1 import R2D1, h, h_inv, sequence_priorities, sequence_targets
from shared.data.batches import SequenceBatch

L, N, H, A = 10, 6, 8, 3
MODEL = ModelConfig(hidden_sizes=(16,), lstm_size=H, lstm_prev_action=True, lstm_prev_reward=True)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, allow_nan=False), min_size=1, max_size=64),
       st.sampled_from([1e-3, 1e-2, 0.0]))
def test_h_and_h_inv_are_inverse(xs, eps):
    x = torch.tensor(xs, dtype=torch.float64)
    torch.testing.assert_close(h_inv(h(x, eps), eps), x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h(h_inv(x / 100, eps), eps), x / 100, rtol=1e-6, atol=1e-6)


def test_h_shrinks_large_values_and_keeps_the_sign():
    x = torch.tensor([-100.0, -1.0, 0.0, 1.0, 100.0])
    y = h(x)
    assert torch.equal(torch.sign(y), torch.sign(x)) and y[-1] < 10.2 and y[2] == 0


def test_n_step_targets_stop_at_dones_and_at_the_sequences_end():
    r = torch.arange(1.0, 9.0)[:, None]
    term, trunc = torch.zeros(8, 1, dtype=torch.bool), torch.zeros(8, 1, dtype=torch.bool)
    term[3], trunc[6] = True, True
    tg = sequence_targets(r, term, trunc, 3, 0.5)
    # t=0: 1 + .5*2 + .25*3, bootstrap at 3 with .125; t=1..3: closed by the termination at 3.
    assert tg.return_[0, 0] == pytest.approx(2.75) and tg.discount[0, 0] == 0.125 and tg.bootstrap_index[0, 0] == 3
    assert tg.return_[1, 0] == pytest.approx(2 + 1.5 + 1.0) and tg.discount[1, 0] == 0
    assert tg.return_[3, 0] == 4 and tg.discount[3, 0] == 0 and tg.valid[3, 0]
    # t=4..6 end at the truncation at 6 (no final observation in a sequence): masked; t=7 has no successor.
    assert tg.valid[:, 0].tolist() == [True, True, True, True, False, False, False, False]
    # Without dones the last windows shrink so that the bootstrap stays inside the sequence.
    tg = sequence_targets(r, torch.zeros_like(term), torch.zeros_like(trunc), 3, 0.5)
    assert tg.bootstrap_index[:, 0].tolist() == [3, 4, 5, 6, 7, 7, 7, 7]
    assert tg.discount[5, 0] == 0.25 and tg.discount[6, 0] == 0.5 and not tg.valid[7, 0]


def test_a_failed_step_trains_no_target_and_windows_end_before_it():
    r = torch.arange(1.0, 9.0)[:, None]
    failed = torch.zeros(8, 1, dtype=torch.bool)
    failed[4] = True  # marked truncated too, as the sampler records it
    tg = sequence_targets(r, torch.zeros_like(failed), failed.clone(), 3, 0.5, failed)
    assert tg.valid[:, 0].tolist() == [True, True, True, True, False, True, True, False]
    # t=2, 3: their windows reach step 4 and end before it, bootstrapping from its observation.
    assert tg.return_[2, 0] == pytest.approx(3 + 0.5 * 4) and tg.discount[2, 0] == 0.25
    assert tg.return_[3, 0] == 4 and tg.discount[3, 0] == 0.5
    assert tg.bootstrap_index[2:4, 0].tolist() == [4, 4]


def test_priorities_are_eta_max_plus_one_minus_eta_mean_per_sequence():
    td = torch.tensor([[1.0, 5.0], [3.0, 0.0], [100.0, 2.0]])
    mask = torch.tensor([[True, True], [True, True], [False, True]])
    p = sequence_priorities(td, mask, 0.9)
    torch.testing.assert_close(p, torch.tensor([0.9 * 3 + 0.1 * 2.0, 0.9 * 5 + 0.1 * 7 / 3]))


def test_an_all_masked_sequence_has_a_positive_priority():
    """Issue 26: a sequence with no trained step got priority exactly 0; now the batch's
    smallest priority among sequences with trained steps (1.0 when none has one)."""
    td = torch.tensor([[1.0, 5.0, 7.0, 2.0], [3.0, 0.0, 9.0, 4.0]])
    mask = torch.tensor([[True, True, False, True], [True, False, False, True]])
    p = sequence_priorities(td, mask, 0.9)
    trained = torch.tensor([0.9 * 3 + 0.1 * 2.0, 5.0, 0.9 * 4 + 0.1 * 3.0])
    torch.testing.assert_close(p, torch.tensor([trained[0], trained[1], trained.min(), trained[2]]))
    assert p[2] > 0
    torch.testing.assert_close(sequence_priorities(td, torch.zeros_like(mask), 0.9), torch.ones(4))
    # through the loss: a truncation at the first step after burn-in leaves sequence 0 nothing to train on
    algo = R2D1(_agent(), R2D1Config(burn_in=L - 2, n_step=2, batch_size=N))
    batch = _batch()
    batch.truncated[L - 2, 0] = True
    _, extra = algo.loss(batch)
    assert not extra["mask"][:, 0].any() and extra["mask"][:, 1:].any(0).all()
    assert extra["priorities"][0] == extra["priorities"][1:].min() > 0


def _agent(seed=0):
    torch.manual_seed(seed)
    return QAgent(np.zeros(2, np.float32), gym.spaces.Discrete(A), MODEL, QAgentConfig())


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    action = torch.randint(A, (L, N), generator=g)
    term = torch.zeros(L, N, dtype=torch.bool)
    term[6, 1] = True
    return SequenceBatch(
        observation=torch.randn(L, N, 2, generator=g), action=action, reward=torch.randn(L, N, generator=g),
        terminated=term, truncated=torch.zeros(L, N, dtype=torch.bool), failed=torch.zeros(L, N, dtype=torch.bool),
        prev_action=torch.cat([torch.zeros(1, N, dtype=torch.long), action[:-1]]),
        prev_reward=torch.randn(L, N, generator=g),
        start_state=RnnState(h=torch.randn(N, 1, H, generator=g), c=torch.randn(N, 1, H, generator=g)),
        is_weight=torch.ones(N), policy_version=torch.zeros(N, dtype=torch.long))


def test_burn_in_steps_get_no_gradient_and_their_targets_do_not_matter():
    B = 4
    algo = R2D1(_agent(), R2D1Config(burn_in=B, n_step=2, batch_size=N))
    batch = _batch()
    obs = batch.observation.clone().requires_grad_(True)
    loss, extra = algo.loss(batch._replace(observation=obs))
    loss.backward()
    assert torch.all(obs.grad[:B] == 0) and obs.grad[B:].abs().sum() > 0
    assert not extra["mask"][:B].any() and extra["mask"][B:-1].all()
    # Rewards and actions of burn-in-only steps (t < B - 1: no trained window reaches them) change nothing.
    other = batch._replace(reward=batch.reward.clone(), action=batch.action.clone())
    other.reward[: B - 1] += 10.0
    other.action[: B - 1] = (other.action[: B - 1] + 1) % A
    loss2, _ = algo.loss(other)
    torch.testing.assert_close(loss2, loss.detach())
    # ...while the stored start state does (it seeds the burn-in).
    loss3, _ = algo.loss(batch._replace(start_state=RnnState(h=torch.zeros(N, 1, H), c=torch.zeros(N, 1, H))))
    assert not torch.allclose(loss3, loss.detach())


def test_an_update_returns_one_priority_per_sequence_and_lowers_the_loss():
    algo = R2D1(_agent(), R2D1Config(burn_in=2, n_step=3, batch_size=N, lr=1e-2, target_update_period=1000))
    batch = _batch()
    first = algo.loss(batch)[0].item()
    for _ in range(50):
        stats, priorities = algo.update(batch, 0.0)
    assert priorities.shape == (N,) and np.all(priorities >= 0)
    assert algo.loss(batch)[0].item() < 0.5 * first


def test_annealed_learning_rate_reaches_zero_at_the_end_of_the_run():
    algo = R2D1(_agent(), R2D1Config(burn_in=2, n_step=3, batch_size=N, lr=1e-2, anneal_lr=True))
    batch = _batch()
    assert algo.update(batch, 0.25).stats["lr"] == pytest.approx(7.5e-3)
    before = [p.clone() for p in algo.agent.parameters()]
    assert algo.update(batch, 1.0).stats["lr"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, algo.agent.parameters()))


def test_r2d1_needs_a_recurrent_agent_and_the_sequence_table():
    base = ["algo.name='r2d1'", "env.id='rlpipe/CartPoleNoVel-v1'", "replay.table='sequence'",
            "replay.capacity=100000", "replay.sequence_length=20", "replay.sequence_period=10", "algo.burn_in=4"]
    with pytest.raises(schema.ConfigError, match="lstm_size"):
        loading.from_dict(loading.apply_overrides({}, base))
    with pytest.raises(schema.ConfigError, match="sequence"):
        loading.from_dict(loading.apply_overrides({}, [*base, "model.lstm_size=8", "replay.table='uniform'"]))
    with pytest.raises(schema.ConfigError, match="burn_in"):
        loading.from_dict(loading.apply_overrides({}, [*base, "model.lstm_size=8", "algo.burn_in=19"]))
    exp = loading.from_dict(loading.apply_overrides({}, [*base, "model.lstm_size=8"]))
    assert exp.algo.priority_eta == 0.9 and exp.algo.double
