"""V-trace against a direct-sum reference across termination, truncation and the segment end, its
on-policy identities (n-step returns, GAE), and the targets PPO, A2C and IMPALA get from it on
feed-forward and recurrent agents."""

import math
from dataclasses import replace

import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.agents.pg import PgAgent
from shared.algos import registry
from shared.algos.gae import batch_advantages, gae, pg_targets
from shared.algos.hparams import A2CConfig, ImpalaConfig, PgTargetsConfig, PPOConfig
from shared.algos.ppo import PPO
from shared.algos.vtrace import vtrace
from tests import test_memory, test_pg_algos

torch.set_num_threads(1)
INF = math.inf


def reference_vtrace(log_rho, reward, value, next_value, terminated, done, gamma, lam, rho_bar, c_bar):
    """The paper's definition summed forward, step by step:
    v_s = V(s_s) + sum_{t >= s} gamma^{t-s} (prod_{i=s}^{t-1} c_i) rho_t delta_t, up to the episode's
    done step or the segment end; advantage_s = rho_s (r_s + gamma v_{s+1} - V(s_s)) with
    v_{s+1} = next_value[s] where the episode or the segment ends at s, 0 after a termination."""
    T, B = reward.shape
    ratio = np.exp(log_rho)
    rho, c = np.minimum(rho_bar, ratio), lam * np.minimum(c_bar, ratio)
    vs = np.zeros((T, B))
    for b in range(B):
        for s in range(T):
            total, weight = value[s, b], 1.0
            for t in range(s, T):
                bootstrap = 0.0 if terminated[t, b] else gamma * next_value[t, b]
                total += weight * rho[t, b] * (reward[t, b] + bootstrap - value[t, b])
                if done[t, b]:
                    break
                weight *= gamma * c[t, b]
            vs[s, b] = total
    adv = np.zeros((T, B))
    for b in range(B):
        for s in range(T):
            after = next_value[s, b] if done[s, b] or s == T - 1 else vs[s + 1, b]
            adv[s, b] = rho[s, b] * (reward[s, b] + (0.0 if terminated[s, b] else gamma * after) - value[s, b])
    return vs, adv


def random_segment(rng, T, B, pattern):
    """reward, value, next_value, terminated, done [T, B] with episode ends as ``pattern`` says;
    next_value is value[t + 1] where the episode goes on, as the learner builds it."""
    reward, value = rng.normal(size=(2, T, B))
    terminated = np.zeros((T, B), bool)
    truncated = np.zeros((T, B), bool)
    if pattern in ("terminated", "both"):
        terminated = rng.random((T, B)) < 0.3
    if pattern in ("truncated", "both"):
        truncated = rng.random((T, B)) < 0.3
    if pattern == "every_step":
        terminated[:, ::2], truncated[:, 1::2] = True, True
    done = terminated | truncated
    next_value = np.concatenate([value[1:], rng.normal(size=(1, B))])  # the bootstrap at t = T-1
    final = rng.normal(size=(T, B))  # V(final observation) where truncated
    next_value = np.where(truncated & ~terminated, final, next_value)
    return reward, value, next_value, terminated, done


def as_t(*arrays):
    return [torch.as_tensor(np.asarray(a)) for a in arrays]


PATTERNS = ["none", "terminated", "truncated", "both", "every_step"]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("rho_bar, c_bar, lam", [(1.0, 1.0, 1.0), (2.0, 0.5, 0.9), (INF, INF, 0.7), (0.3, 1.5, 0.0)])
def test_matches_the_direct_sum_of_the_paper(pattern, rho_bar, c_bar, lam):
    rng = np.random.default_rng(PATTERNS.index(pattern))
    T, B, gamma = 7, 4, 0.95
    segment = random_segment(rng, T, B, pattern)
    log_rho = rng.normal(scale=0.7, size=(T, B))  # ratios on both sides of every bar
    adv, vs = vtrace(*as_t(log_rho, *segment), gamma=gamma, lam=lam, rho_bar=rho_bar, c_bar=c_bar)
    ref_vs, ref_adv = reference_vtrace(log_rho, *segment, gamma, lam, rho_bar, c_bar)
    np.testing.assert_allclose(vs.numpy(), ref_vs, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-9, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 7), B=st.integers(1, 3), gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0),
       rho_bar=st.floats(0.1, 3.0), c_bar=st.floats(0.1, 3.0), pattern=st.sampled_from(PATTERNS),
       seed=st.integers(0, 2**31 - 1))
def test_matches_the_direct_sum_on_random_segments(T, B, gamma, lam, rho_bar, c_bar, pattern, seed):
    rng = np.random.default_rng(seed)
    segment = random_segment(rng, T, B, pattern)
    log_rho = rng.normal(size=(T, B))
    adv, vs = vtrace(*as_t(log_rho, *segment), gamma=gamma, lam=lam, rho_bar=rho_bar, c_bar=c_bar)
    ref_vs, ref_adv = reference_vtrace(log_rho, *segment, gamma, lam, rho_bar, c_bar)
    np.testing.assert_allclose(vs.numpy(), ref_vs, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-9, atol=1e-9)


def test_hand_computed_off_policy_column():
    # One column, T = 3, gamma 0.5, lambda 1, rho_bar 1, c_bar 1: ratios 2 (cut to 1), 0.5, 1;
    # step 1 truncates (V(final obs) 4), step 2 ends the segment (bootstrap 6).
    log_rho = np.log([[2.0], [0.5], [1.0]])
    reward, value = np.array([[1.0], [2.0], [3.0]]), np.array([[10.0], [20.0], [30.0]])
    next_value = np.array([[20.0], [4.0], [6.0]])
    terminated, done = np.zeros((3, 1), bool), np.array([[False], [True], [False]])
    adv, vs = vtrace(*as_t(log_rho, reward, value, next_value, terminated, done), gamma=0.5, lam=1.0,
                     rho_bar=1.0, c_bar=1.0)
    # deltas: d0 = 1 (1 + 10 - 10), d1 = .5 (2 + 2 - 20) = -8, d2 = 3 + 3 - 30 = -24.
    # v2 = 30 - 24 = 6; v1 = 20 - 8 = 12 (cut: truncated); v0 = 10 + 1 + .5 * 1 * (12 - 20) = 7.
    np.testing.assert_allclose(vs.numpy()[:, 0], [7.0, 12.0, 6.0])
    # adv0 = 1 (1 + .5 * 12 - 10) = -3; adv1 = .5 (2 + .5 * 4 - 20) = -8; adv2 = 3 + 3 - 30 = -24.
    np.testing.assert_allclose(adv.numpy()[:, 0], [-3.0, -8.0, -24.0])


@pytest.mark.parametrize("pattern", PATTERNS)
def test_on_policy_without_truncation_levels_is_the_n_step_return(pattern):
    """The paper: with pi = mu and c_bar >= 1, v_s = sum_t gamma^{t-s} r_t + gamma^n V(s_{s+n}),
    the n-step return up to the episode's end or the segment's (from its bootstrap)."""
    rng = np.random.default_rng(7)
    T, B, gamma = 6, 3, 0.9
    reward, value, next_value, terminated, done = random_segment(rng, T, B, pattern)
    adv, vs = vtrace(*as_t(np.zeros((T, B)), reward, value, next_value, terminated, done), gamma=gamma, lam=1.0,
                     rho_bar=INF, c_bar=INF)
    expected = np.zeros((T, B))
    for b in range(B):
        for s in range(T):
            ret, discount = 0.0, 1.0
            for t in range(s, T):
                ret += discount * reward[t, b]
                discount *= gamma
                if terminated[t, b]:
                    break
                if done[t, b] or t == T - 1:
                    ret += discount * next_value[t, b]
                    break
            expected[s, b] = ret
    np.testing.assert_allclose(vs.numpy(), expected, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(adv.numpy(), expected - value, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("lam", [0.0, 0.5, 0.95, 1.0])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_on_policy_targets_are_the_gae_lambda_returns(pattern, lam):
    """On-policy (ratios 1) with bars >= 1: v_s is GAE(lambda)'s return for every lambda; the
    advantage r_s + gamma v_{s+1} - V(s_s) is GAE's at lambda = 1 and delta_s + gamma A^GAE_{s+1}
    (a one-step target on the next lambda-return) below it."""
    rng = np.random.default_rng(11)
    T, B, gamma = 8, 4, 0.97
    reward, value, next_value, terminated, done = segment = random_segment(rng, T, B, pattern)
    adv, vs = vtrace(*as_t(np.zeros((T, B)), *segment), gamma=gamma, lam=lam, rho_bar=1.0, c_bar=1.0)
    gae_adv, gae_ret = gae(*as_t(*segment), gamma=gamma, lam=lam)
    torch.testing.assert_close(vs, gae_ret, rtol=1e-9, atol=1e-9)
    if lam == 1.0:
        torch.testing.assert_close(adv, gae_adv, rtol=1e-9, atol=1e-9)
    goes_on = torch.as_tensor(~done)
    later = torch.cat([gae_adv[1:], torch.zeros(1, B, dtype=gae_adv.dtype)]) * goes_on
    delta = torch.as_tensor(reward + gamma * next_value * ~terminated - value)
    torch.testing.assert_close(adv, delta + gamma * later, rtol=1e-9, atol=1e-9)


def test_ratios_above_the_bars_count_as_the_bars():
    rng = np.random.default_rng(3)
    segment = random_segment(rng, 5, 2, "both")
    far = vtrace(*as_t(np.full((5, 2), 9.0), *segment), gamma=0.9, lam=0.8, rho_bar=1.5, c_bar=1.2)
    at_rho = vtrace(*as_t(np.full((5, 2), math.log(1.5)), *segment), gamma=0.9, lam=0.8 * 1.2 / 1.5,
                    rho_bar=1.5, c_bar=INF)
    for a, b in zip(far, at_rho):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("rho_bar", [1.0, 2.0, INF])
def test_a_ratio_that_overflows_at_an_episode_end_stays_in_its_episode(rho_bar):
    """c_bar = inf, float32 as the learner computes: pi/mu = exp(100) is inf at step 3, where an
    episode ends (terminated in column 0, truncated in column 1) and its trace is cut. The
    targets are the direct sum's everywhere: finite where rho_bar is; with rho_bar = inf the
    weight of that step's delta is infinite, so its episode's targets up to it are too, and never
    NaN, and every other episode's are unchanged."""
    rng = np.random.default_rng(5)
    T, B, gamma, lam = 6, 3, 0.9, 0.95
    reward, value, next_value, _, _ = random_segment(rng, T, B, "none")
    terminated, done = np.zeros((T, B), bool), np.zeros((T, B), bool)
    terminated[[1, 3], 0] = done[[1, 3], 0] = True  # column 0: episodes 0-1, 2-3, 4-5
    done[3, 1] = True  # column 1: truncated at 3
    log_rho = rng.normal(scale=0.5, size=(T, B))
    log_rho[3, :2] = 100.0
    tensors = [torch.as_tensor(a, dtype=torch.float32 if a.dtype == np.float64 else None)
               for a in (log_rho, reward, value, next_value, terminated, done)]
    adv, vs = vtrace(*tensors, gamma=gamma, lam=lam, rho_bar=rho_bar, c_bar=INF)
    ref_vs, ref_adv = reference_vtrace(log_rho, reward, value, next_value, terminated, done, gamma, lam, rho_bar, INF)
    assert not vs.isnan().any() and not adv.isnan().any()
    overflowed = np.zeros((T, B), bool)  # the overflowing step's episode, up to that step
    if rho_bar == INF:
        overflowed[2:4, 0] = overflowed[:4, 1] = True
        assert vs[torch.as_tensor(overflowed)].isinf().all()
    else:
        assert vs.isfinite().all() and adv.isfinite().all()
    rest = ~overflowed
    np.testing.assert_allclose(vs.numpy()[rest], ref_vs[rest], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(adv.numpy()[rest], ref_adv[rest], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- targets of a real batch


def test_an_on_policy_batch_gets_the_gae_returns_and_a_stale_one_is_corrected():
    """batch_advantages with V-trace on a PgAgent's own batch: the ratios are 1 (its log-probs
    come back from ``evaluate``), so the value targets are GAE(lambda)'s; once the policy moved,
    the ratios are the current policy's over the stored behaviour log-probs."""
    torch.manual_seed(0)
    agent = PgAgent(test_pg_algos.OBS, gym.spaces.Discrete(2))
    batch = test_pg_algos.bandit_batch(agent, 4, 8, test_pg_algos.match_context, seed=0)
    samples = batch.samples
    # Episodes that go on across steps: the traces matter.
    batch = batch._replace(samples=samples._replace(terminated=torch.zeros_like(samples.terminated)))
    cfg = PgTargetsConfig(gamma=0.9, gae_lambda=0.8, advantages="vtrace")
    _, vs, value = batch_advantages(agent, batch, cfg)
    _, gae_ret, _ = batch_advantages(agent, batch, PgTargetsConfig(gamma=0.9, gae_lambda=0.8))
    torch.testing.assert_close(vs, gae_ret, rtol=0, atol=1e-5)

    info = batch.samples.agent_info
    stale = batch._replace(samples=batch.samples._replace(agent_info=info._replace(log_prob=info.log_prob - 0.5)))
    adv, vs, _ = batch_advantages(agent, stale, replace(cfg, vtrace_rho_bar=INF, vtrace_c_bar=INF))
    s = stale.samples
    next_value = torch.cat([value[1:], agent.value(stale.bootstrap_observation)[None]]).detach()
    ref_vs, ref_adv = reference_vtrace(np.full((4, 8), 0.5), s.reward.numpy(), value.numpy(), next_value.numpy(),
                                       s.terminated.numpy(), s.truncated.numpy(), 0.9, 0.8, INF, INF)
    np.testing.assert_allclose(vs.numpy(), ref_vs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-4, atol=1e-4)


def test_a_recurrent_agent_replays_its_sequences_for_the_ratios():
    """A recurrent agent's segment (episode ends inside) collected by a real sampler: the current
    log-probs are replayed from the stored memory, so on-policy the ratios are 1 and the V-trace
    targets GAE's; PPO with V-trace (APPO) then updates it on whole sequences."""
    exp, agent, seg = test_memory._recurrent_segment()
    cfg = replace(exp.algo, advantages="vtrace")
    vs = pg_targets(agent, seg, cfg).returns
    gae_ret = pg_targets(agent, seg, replace(cfg, advantages="gae")).returns
    torch.testing.assert_close(vs, gae_ret, rtol=0, atol=1e-4)
    before = [p.detach().clone() for p in agent.parameters()]
    stats = PPO(agent, cfg).update(seg, 0.0).stats
    assert all(np.isfinite(v) for v in stats.values())
    assert any(not torch.equal(b, p) for b, p in zip(before, agent.parameters()))


def test_impala_is_a2c_with_vtrace_and_the_papers_settings():
    spec = registry.resolve("impala")
    assert spec.on_policy and spec.recurrent and spec.agent is registry.resolve("a2c").agent
    cfg = spec.config()
    assert isinstance(cfg, A2CConfig) and cfg.advantages == "vtrace"
    assert (cfg.vtrace_rho_bar, cfg.vtrace_c_bar, cfg.gae_lambda) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="advantages = 'retrace': allowed: gae, vtrace"):
        ImpalaConfig(advantages="retrace")
    with pytest.raises(ValueError, match="vtrace_rho_bar and vtrace_c_bar must be > 0"):
        PPOConfig(vtrace_c_bar=0.0)


def test_impala_sums_its_loss_over_the_batch():
    """The paper's lr, RMSprop epsilon and clip are sized for gradients summed over T x B steps:
    the same batch's gradient is T x B = 128 times the mean's (clipping off to see it)."""
    norms = {}
    for reduction in ("mean", "sum"):
        torch.manual_seed(0)
        agent = PgAgent(test_pg_algos.OBS, gym.spaces.Discrete(2))
        algo = registry.resolve("impala").make(agent, ImpalaConfig(loss_reduction=reduction, max_grad_norm=0.0))
        batch = test_pg_algos.bandit_batch(agent, 4, 32, test_pg_algos.match_context, seed=0)
        norms[reduction] = algo.update(batch, progress=0.0).stats["grad_norm"]
    assert norms["sum"] == pytest.approx(128 * norms["mean"], rel=1e-4)
    assert ImpalaConfig().loss_reduction == "sum" and A2CConfig().loss_reduction == "mean"
    with pytest.raises(ValueError, match="loss_reduction = 'median': allowed: mean, sum"):
        ImpalaConfig(loss_reduction="median")


@pytest.mark.parametrize("name", ["ppo", "impala"])
def test_learns_a_contextual_bandit_with_vtrace(name):
    """IMPALA with its shipped settings (RMSprop, epsilon 0.01, the summed loss, the learning rate
    annealed to 0 over the 60 updates): on a mean loss the same settings stay near 0.6-0.7."""
    torch.manual_seed(0)
    agent = PgAgent(test_pg_algos.OBS, gym.spaces.Discrete(2))
    if name == "ppo":
        cfg = PPOConfig(lr=3e-3, anneal_lr=False, entropy_coef=0.0, epochs=4, minibatches=2, advantages="vtrace")
    else:
        cfg = ImpalaConfig()
        assert (cfg.optimizer, cfg.optimizer_eps, cfg.anneal_lr) == ("rmsprop", 0.01, True)
    algo = registry.resolve(name).make(agent, cfg)
    updates = 40 if name == "ppo" else 60
    for i in range(updates):
        algo.update(test_pg_algos.bandit_batch(agent, 4, 32, test_pg_algos.match_context, seed=i),
                    progress=i / updates)
    eval_batch = test_pg_algos.bandit_batch(agent, 4, 64, test_pg_algos.match_context, seed=999)
    assert eval_batch.samples.reward.mean() > 0.9
