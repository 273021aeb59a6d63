"""TQC and CrossQ: the truncated quantile target, the quantile Huber loss, batch renorm and
CrossQ's joint forward pass, against hand computations; CrossQ's batch-renormalized actor acts
on its running statistics, which its actor loss trains and which travel with the published
parameters; checkpoints round trip."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from shared.agents import EVALUATE, EXPLORE
from shared.agents.actor import acting_plan
from shared.agents.config import ActorConfig, CriticConfig, ModelConfig
from shared.agents.models import BatchRenorm
from shared.agents.qpg import SacAgent
from shared.transport import params, shm
from shared.algos import registry
from shared.algos.qpg import SAC, CrossQConfig, TQCConfig, TruncatedQuantiles
from shared.algos.quantiles import quantile_fractions, quantile_huber, truncated_pool
from tests.test_qpg import OBS, batch, box

MODEL = ModelConfig((16, 16), "relu")


def tqc(cfg=TQCConfig(n_critics=2, n_quantiles=5, drop_per_net=1)):
    return SAC(SacAgent(OBS, box(), MODEL, critic=cfg.critic()), cfg, TruncatedQuantiles(cfg.drop_per_net))


def crossq(cfg=CrossQConfig(critic_hidden_sizes=(32, 32))):
    return SAC(SacAgent(OBS, box(), MODEL, critic=cfg.critic(), actor=cfg.actor()), cfg)


def plain_actor_crossq():
    return crossq(CrossQConfig(critic_hidden_sizes=(32, 32), actor_batch_renorm=False))


# ------------------------------------------------------------------ quantiles

def test_truncation_keeps_the_lowest_pooled_atoms_of_all_critics():
    """Two critics of three quantiles, one dropped per critic: of the six pooled atoms the two
    largest go, whichever critic they came from."""
    quantiles = torch.tensor([[[1.0, 5.0, 3.0], [0.0, 0.0, 9.0]],    # critic 0, samples 0 and 1
                              [[2.0, 6.0, 4.0], [8.0, 7.0, -1.0]]])  # critic 1
    kept = truncated_pool(quantiles, drop_per_net=1)
    torch.testing.assert_close(kept, torch.tensor([[1.0, 2.0, 3.0, 4.0], [-1.0, 0.0, 0.0, 7.0]]))
    torch.testing.assert_close(truncated_pool(quantiles, 0)[0], torch.arange(1.0, 7.0))


def test_quantile_huber_loss_matches_a_hand_computation():
    """Quantiles 0 and 1 at tau 1/4, 3/4; target atoms 0.5 and 3: u = [[0.5, 3], [-0.5, 2]],
    Huber [[1/8, 5/2], [1/8, 3/2]], weights |tau - 1{u < 0}| [[1/4, 1/4], [1/4, 3/4]]."""
    torch.testing.assert_close(quantile_fractions(2), torch.tensor([0.25, 0.75]))
    loss = quantile_huber(torch.tensor([0.0, 1.0]), torch.tensor([0.5, 3.0]))
    torch.testing.assert_close(loss, torch.tensor([[1 / 32, 5 / 8], [1 / 32, 9 / 8]]))
    assert loss.mean().item() == pytest.approx(0.453125)
    pinball = quantile_huber(torch.tensor([0.0, 1.0]), torch.tensor([0.5, 3.0]), kappa=0.0)
    torch.testing.assert_close(pinball, torch.tensor([[0.125, 0.75], [0.125, 1.5]]))


def test_quantile_regression_finds_the_quantiles_of_a_sample():
    """Minimising the loss over a fixed sample puts quantile i at the sample's tau_i quantile."""
    torch.manual_seed(0)
    sample = torch.randn(2000) * 2.0 + 1.0
    theta = torch.zeros(4, requires_grad=True)
    opt = torch.optim.Adam([theta], lr=0.05)
    for _ in range(1500):
        opt.zero_grad()
        quantile_huber(theta, sample, kappa=0.0).mean().backward()
        opt.step()
    expected = torch.quantile(sample, quantile_fractions(4))
    torch.testing.assert_close(theta.detach(), expected, atol=0.1, rtol=0)


def test_tqc_target_is_the_truncated_soft_atoms_of_the_target_critics():
    torch.manual_seed(0)
    algo, b = tqc(), batch(8)
    alpha = algo.log_alpha.exp().item()
    torch.manual_seed(1)
    next_action, log_prob = algo.agent.sample(b.bootstrap_observation)
    atoms = truncated_pool(algo.target.q(b.bootstrap_observation, next_action), 1)
    assert atoms.shape == (8, 8)
    expected = b.return_[:, None] + b.bootstrap_discount[:, None] * (atoms - alpha * log_prob[:, None])
    torch.manual_seed(1)
    stats, priorities = algo.update(b, 0.0)
    assert stats["target_mean"] == pytest.approx(expected.mean().item(), rel=1e-5)
    assert priorities.shape == (8,) and stats["td_abs_mean"] == pytest.approx(float(priorities.mean()), rel=1e-5)


def test_tqc_config_defaults_are_the_papers_and_the_critics_output_quantiles():
    cfg = TQCConfig()
    assert (cfg.n_critics, cfg.n_quantiles, cfg.drop_per_net) == (5, 25, 2)
    agent = SacAgent(OBS, box(), MODEL, critic=cfg.critic())
    assert agent.q(torch.zeros(7, 3), torch.zeros(7, 1)).shape == (5, 7, 25)
    with pytest.raises(ValueError, match="drop_per_net"):
        TQCConfig(n_quantiles=3, drop_per_net=3)
    assert registry.resolve("tqc").config is TQCConfig and registry.resolve("crossq").config is CrossQConfig


# ------------------------------------------------------------------ batch renorm and CrossQ

def test_batch_renorm_normalises_by_the_batch_then_corrects_towards_the_running_statistics():
    x = torch.tensor([[[1.0], [3.0]]])  # one member, two samples, one feature: mean 2, var 1
    norm = BatchRenorm(1, 1, momentum=0.5, eps=0.0, warmup_steps=1)
    torch.testing.assert_close(norm(x), torch.tensor([[[-1.0], [1.0]]]))  # warm-up: plain batch norm
    torch.testing.assert_close(norm.running_mean, torch.tensor([[[1.0]]]))  # 0 + 0.5 (2 - 0)
    torch.testing.assert_close(norm.running_var, torch.tensor([[[1.0]]]))  # 1 + 0.5 (1 - 1)
    # Past warm-up: r = sigma_B / sigma = 1, d = (mu_B - mu) / sigma = 1; x_hat = [-1, 1] * r + d.
    torch.testing.assert_close(norm(x), torch.tensor([[[0.0], [2.0]]]))
    norm.eval()  # running mean 1.5, var 1
    torch.testing.assert_close(norm(x), torch.tensor([[[-0.5], [1.5]]]))
    assert int(norm.steps) == 2


def test_crossq_forward_pass_uses_the_statistics_of_both_halves_and_has_no_target_network():
    """The critics' first batch renorm normalises [s, a] rows: after one update its running
    mean of the observation columns moved from 0 by momentum * the mean over the batch's and
    the bootstrap observations together (hand computation), and the batch half alone gives
    other Q-values than the joint pass."""
    torch.manual_seed(0)
    algo, b = crossq(), batch(16)
    assert algo.target is None and "target" not in algo.state_dict()
    first = algo.agent.critics.mlp.norms[0]
    joint_obs = torch.cat([b.observation, b.bootstrap_observation])
    with torch.no_grad():
        next_action, _ = algo.agent.sample(b.bootstrap_observation)
        q, next_q = algo.q_and_next_q(b, next_action)
    torch.testing.assert_close(first.running_mean[:, 0, :3], 0.01 * joint_obs.mean(0).expand(2, 3))
    torch.testing.assert_close(first.running_var[:, 0, :3], 0.99 + 0.01 * joint_obs.var(0, unbiased=False).expand(2, 3))
    assert int(first.steps) == 1
    with torch.no_grad():
        alone = algo.agent.q(b.observation, algo.agent.to_unit(b.action))
    assert q.shape == next_q.shape == (2, 16) and not torch.allclose(q, alone, atol=1e-3)
    algo.update(b, 0.0)
    assert int(first.steps) == 3  # the update's critic pass trains; the actor's reads in eval mode
    assert algo.agent.critics.training


def test_crossq_defaults_delay_the_actor_and_use_beta1_one_half():
    torch.manual_seed(0)
    cfg = CrossQConfig()
    assert (cfg.policy_delay, cfg.adam_beta1, cfg.target_networks, cfg.critic_hidden_sizes) == (3, 0.5, False, (2048, 2048))
    algo = crossq()
    assert algo.steps.critic_opt.param_groups[0]["betas"] == (0.5, 0.999)
    actor0 = [p.clone() for p in algo.steps.actor_params]
    for i in range(2):
        algo.update(batch(seed=i), 0.0)
    assert all(torch.equal(a, p) for a, p in zip(actor0, algo.steps.actor_params))
    algo.update(batch(seed=2), 0.0)
    assert not all(torch.equal(a, p) for a, p in zip(actor0, algo.steps.actor_params))


# ------------------------------------------------------------------ CrossQ's actor

def moved_actor_statistics(agent: SacAgent) -> None:
    """Running statistics far from their initial 0 and 1, as after a long run."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for norm in agent.actor_norms:
            norm.running_mean.copy_(torch.randn(norm.running_mean.shape, generator=g))
            norm.running_var.copy_(0.2 + 2.0 * torch.rand(norm.running_var.shape, generator=g))


def test_crossq_actor_has_batch_renorm_before_each_linear_layer_by_default_and_none_when_off():
    cfg = CrossQConfig()
    assert cfg.actor_batch_renorm and cfg.actor() == ActorConfig(True, 0.01, 1e-3, 100_000)
    agent = crossq().agent  # 16x16 trunk, then the head: batch renorm of widths 3, 16 and 16
    assert [norm.running_mean.shape[-1] for norm in agent.actor_norms] == [3, 16, 16]
    assert all(norm.momentum == 0.01 and norm.eps == 1e-3 and norm.warmup_steps == 100_000 for norm in agent.actor_norms)
    assert acting_plan(agent) is None  # acts in torch (the numpy plan has no batch renorm)
    assert plain_actor_crossq().agent.actor_norms == [] and SacAgent(OBS, box(), MODEL).actor_norms == []
    with pytest.raises(ValueError, match=r"CrossQConfig.renorm_momentum: must be in \(0, 1\], got 0"):
        CrossQConfig(renorm_momentum=0.0)
    with pytest.raises(ValueError, match=r"ActorConfig.renorm_warmup_steps: must be >= 0"):
        ActorConfig(batch_renorm=True, renorm_warmup_steps=-1)


def test_crossq_actor_acts_on_its_running_statistics_in_any_mode_and_moves_none():
    """Greedy actions of a batch are each row's own (row by row gives the same), computed with
    the running statistics (a hand-built eval pass), whether the module is in training mode (the
    learner's agent, which acts in serial mode) or eval mode (action-server, samplers); acting
    moves no statistic and leaves the modes as they were."""
    torch.manual_seed(0)
    agent = crossq().agent
    moved_actor_statistics(agent)
    obs = torch.randn(16, 3) * 3.0
    before = {k: v.clone() for k, v in agent.state_dict().items()}
    assert agent.training and all(norm.training for norm in agent.actor_norms)
    action, _ = agent.step(obs, EVALUATE)
    rows = torch.cat([agent.step(obs[i:i + 1], EVALUATE)[0] for i in range(16)])
    torch.testing.assert_close(action, rows)
    with torch.no_grad():
        x, trunk = obs, agent.actor_encoder.trunk
        for (linear, fn), norm in zip(trunk.plan, trunk.pre_norms):
            x = fn(linear((x - norm.running_mean[0]) / (norm.running_var[0] + 1e-3).sqrt() * norm.scale[0]
                          + norm.bias[0]))
        norm, (head, _) = agent.actor_head.pre_norms[0], agent.actor_head.plan[0]
        mean = head((x - norm.running_mean[0]) / (norm.running_var[0] + 1e-3).sqrt() * norm.scale[0] + norm.bias[0])
        torch.testing.assert_close(action, agent.to_env(torch.tanh(mean[:, :1])))
    agent.step(obs, EXPLORE)  # exploring samples around the same means
    assert all(torch.equal(before[k], v) for k, v in agent.state_dict().items())
    assert all(norm.training for norm in agent.actor_norms)
    agent.eval()
    torch.testing.assert_close(agent.step(obs, EVALUATE)[0], action)
    with torch.no_grad(), agent.actor_mode(True):  # training mode: the batch's statistics, another action
        trained = agent.mean_action(obs)
    assert not torch.allclose(agent.to_env(trained), action, atol=1e-3)
    assert not all(norm.training for norm in agent.actor_norms)


def test_crossq_actor_loss_trains_the_actor_statistics_and_the_bootstrap_actions_read_them():
    """Per update the bootstrap actions a' come from the running statistics (no pass counted);
    every third update the actor loss's pass trains them on the batch's observations: the first
    layer's running mean moves by momentum * their mean (hand computation)."""
    torch.manual_seed(0)
    algo = crossq()
    first = algo.agent.actor_norms[0]
    for i in range(2):
        algo.update(batch(seed=i), 0.0)
    assert [int(norm.steps) for norm in algo.agent.actor_norms] == [0, 0, 0]
    assert torch.equal(first.running_mean, torch.zeros(1, 1, 3))
    b = batch(seed=2)
    algo.update(b, 0.0)
    assert [int(norm.steps) for norm in algo.agent.actor_norms] == [1, 1, 1]
    torch.testing.assert_close(first.running_mean[0, 0], 0.01 * b.observation.mean(0))
    assert all(norm.training for norm in algo.agent.actor_norms)  # modes as they were


def test_crossq_actor_statistics_travel_with_the_published_parameters(run_id):
    """What an action-server loads from the learner's parameter segment carries the actor's
    running statistics and pass counts: its greedy actions are the learner's."""
    torch.manual_seed(0)
    algo = crossq()
    for i in range(6):
        algo.update(batch(seed=i), 0.0)
    moved_actor_statistics(algo.agent)
    writer = params.ParamWriter(algo.agent, shm.segment_name(run_id, "learner", 0, "params"))
    try:
        server = crossq().agent.eval()
        reader = params.ParamReader(server, shm.Owner(run_id, "learner"))
        writer.write(1)
        assert reader.read(1, writer.descriptor)
        reader.close()
    finally:
        writer.close()
    state = server.state_dict()
    assert state["actor_head.net.0.steps"].item() == 2 and state["actor_encoder.trunk.net.0.running_var"].ne(1).all()
    obs = torch.randn(8, 3)
    torch.testing.assert_close(server.step(obs, EVALUATE)[0], algo.agent.step(obs, EVALUATE)[0])


@pytest.mark.parametrize("make", [tqc, crossq, plain_actor_crossq], ids=["tqc", "crossq", "crossq-plain-actor"])
def test_checkpoints_round_trip(make):
    """Agent and algorithm state through torch.save/load: the clone's next update is the
    original's, bit for bit (batch renorm's running statistics and pass count included)."""
    torch.manual_seed(0)
    algo = make()
    for i in range(5):  # the sixth is an actor step for CrossQ too
        algo.update(batch(seed=i), 0.0)
    buffer = io.BytesIO()
    torch.save({"agent": algo.agent.state_dict(), "algo": algo.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    torch.manual_seed(1)
    clone = make()
    clone.agent.load_state_dict(saved["agent"])
    clone.load_state_dict(saved["algo"])
    assert clone.updates == algo.updates == 5
    torch.manual_seed(2)
    expected = algo.update(batch(seed=9), 0.0).stats
    torch.manual_seed(2)
    assert clone.update(batch(seed=9), 0.0).stats == expected
    for (k, a), b in zip(algo.agent.state_dict().items(), clone.agent.state_dict().values()):
        assert torch.equal(a, b), k
    assert np.isfinite(list(expected.values())).all()
    if make is crossq:  # the actor's statistics are in the checkpoint (one actor step, the third update)
        assert saved["agent"]["actor_encoder.trunk.net.0.steps"].item() == 1
