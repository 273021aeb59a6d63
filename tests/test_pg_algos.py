"""PgAgent distributions and shapes; PPO and A2C learn bandits and CartPole from batches
laid out as the sampler fills them (shared.algos.Samples)."""

import io
import math

import gymnasium as gym
import numpy as np
import pytest
import torch

from shared.agents import EVALUATE
from shared.agents.pg import AgentInfo, PgAgent, PgAgentConfig
from shared.data.batches import OnPolicyBatch, Samples
from shared.algos.a2c import A2C, A2CConfig
from shared.algos.ppo import PPO, PPOConfig
from shared.agents.models import ModelConfig, make_encoder
from shared.data.namedarraytuple import namedarraytuple, torchify

torch.set_num_threads(1)

OBS = np.zeros(3, np.float32)


def obs_batch(B, seed=0):
    return torch.as_tensor(np.random.default_rng(seed).normal(size=(B, 3)).astype(np.float32))


# ---------------------------------------------------------------- agent


def test_discrete_actions_are_indices_from_zero_and_log_probs_match_evaluate():
    torch.manual_seed(0)
    agent = PgAgent(OBS, gym.spaces.Discrete(3, start=-1))  # EnvGroup adds the start for the env
    obs = obs_batch(256)
    action, info = agent.step(obs)
    assert action.dtype == torch.int64 and action.shape == (256,)
    assert set(action.tolist()) == {0, 1, 2}
    log_prob, entropy, value = agent.evaluate(obs, action)
    torch.testing.assert_close(log_prob, info.log_prob)
    torch.testing.assert_close(value, info.value)
    torch.testing.assert_close(agent.value(obs), info.value)
    # The policy head starts near uniform (gain 0.01).
    torch.testing.assert_close(entropy, torch.full((256,), math.log(3)), atol=1e-3, rtol=0)
    assert info.log_prob.dtype == info.value.dtype == torch.float32


def test_greedy_discrete_is_the_most_likely_action():
    torch.manual_seed(0)
    agent = PgAgent(OBS, gym.spaces.Discrete(4))
    obs = obs_batch(64)
    greedy, _ = agent.step(obs, EVALUATE)
    logits = agent._forward(obs)[0]
    assert torch.equal(greedy, logits.argmax(-1))


def test_multidiscrete_sums_independent_log_probs_and_entropies():
    torch.manual_seed(0)
    agent = PgAgent(OBS, gym.spaces.MultiDiscrete([3, 4]))
    obs = obs_batch(128)
    action, info = agent.step(obs)
    assert action.shape == (128, 2) and action.dtype == torch.int64
    assert action[:, 0].max() <= 2 and action[:, 1].max() <= 3
    logits = agent._forward(obs)[0]
    lp0 = torch.log_softmax(logits[:, :3], -1).gather(1, action[:, :1]).squeeze(1)
    lp1 = torch.log_softmax(logits[:, 3:], -1).gather(1, action[:, 1:]).squeeze(1)
    torch.testing.assert_close(info.log_prob, lp0 + lp1)
    _, entropy, _ = agent.evaluate(obs, action)
    torch.testing.assert_close(entropy, torch.full((128,), math.log(3) + math.log(4)), atol=1e-3, rtol=0)


def test_gaussian_samples_are_raw_and_log_std_sets_the_entropy():
    torch.manual_seed(0)
    space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    agent = PgAgent(OBS, space, agent_cfg=PgAgentConfig(init_log_std=0.5))
    obs = obs_batch(512)
    action, info = agent.step(obs)
    assert action.shape == (512, 2) and action.dtype == torch.float32
    assert action.abs().max() > 1.0  # not clipped to the bounds: the env adapter does that
    log_prob, entropy, _ = agent.evaluate(obs, action)
    torch.testing.assert_close(log_prob, info.log_prob)
    per_dim = 0.5 * math.log(2 * math.pi * math.e) + 0.5
    torch.testing.assert_close(entropy, torch.full((512,), 2 * per_dim))
    assert action.std(0).mean().item() == pytest.approx(math.exp(0.5), rel=0.1)
    greedy1, _ = agent.step(obs, EVALUATE)
    greedy2, _ = agent.step(obs, EVALUATE)
    assert torch.equal(greedy1, greedy2)
    assert "log_std" in agent.state_dict()


def test_step_leaves_the_state_dict_unchanged_and_accepts_numpy():
    agent = PgAgent(OBS, gym.spaces.Discrete(2))
    before = {k: v.clone() for k, v in agent.state_dict().items()}
    agent.step(np.ones((5, 3), np.float32))
    after = agent.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("space", [gym.spaces.Discrete(3), gym.spaces.Box(-1, 1, (2,))])
def test_policy_and_value_run_as_one_ensemble_but_learn_apart(space):
    torch.manual_seed(0)
    agent = PgAgent(OBS, space)
    assert agent.twin is not None and agent.pi_head is None and agent.v_encoder is None
    obs = obs_batch(32)
    out, value = agent._forward(obs)
    out[:, 0].sum().backward()  # a policy loss: the value member gets no gradient
    assert all(w.grad[0].abs().sum() > 0 and not w.grad[1].any() for w in agent.twin.weights)
    agent.zero_grad(set_to_none=True)
    agent.value(obs).sum().backward()  # a value loss: only the value member's first output moves
    assert all(not w.grad[0].any() for w in agent.twin.weights)
    last = agent.twin.weights[-1].grad[1]
    assert last[:, 0].abs().sum() > 0 and not last[:, 1:].any()
    # Leading dims [T, B] (a segment batch's values) are run as rows.
    with torch.no_grad():
        torch.testing.assert_close(agent.value(obs.reshape(4, 8, -1)), agent.value(obs).reshape(4, 8))
    # Separate networks from a CNN encoder or an LSTM keep their own modules.
    recurrent = PgAgent(OBS, space, ModelConfig(lstm_size=8))
    assert recurrent.twin is None and recurrent.v_encoder is not None


def test_dict_observation_with_image_and_shared_encoder():
    Obs = namedarraytuple("Obs", ["pixels", "state"])
    example = Obs(np.zeros((64, 64, 3), np.uint8), np.zeros(5, np.float32))
    agent = PgAgent(example, gym.spaces.Discrete(4), ModelConfig(hidden_sizes=()), PgAgentConfig(shared_encoder=True))
    assert not any(k.startswith("v_encoder") for k in agent.state_dict())
    obs = Obs(torch.randint(0, 256, (6, 64, 64, 3), dtype=torch.uint8), torch.randn(6, 5))
    action, info = agent.step(obs)
    assert action.shape == (6,) and info.value.shape == (6,)


def test_encoder_flattens_leading_dims_and_scales_uint8():
    encoder, out_dim = make_encoder(np.zeros(4, np.uint8), ModelConfig(hidden_sizes=()))
    x = torch.full((2, 3, 4), 255, dtype=torch.uint8)
    assert out_dim == 4
    torch.testing.assert_close(encoder(x), torch.ones(2, 3, 4))


def test_nature_cnn_accepts_channels_first_frame_stacks():
    encoder, out_dim = make_encoder(np.zeros((4, 84, 84), np.uint8), ModelConfig(hidden_sizes=(32,)))
    assert out_dim == 32
    assert encoder(torch.zeros(2, 4, 84, 84, dtype=torch.uint8)).shape == (2, 32)


# ---------------------------------------------------------------- bandit batches


def bandit_batch(agent, T, B, reward_fn, seed):
    """A contextual bandit laid out as a sampler batch: every step terminates."""
    rng = np.random.default_rng(seed)
    context = rng.integers(0, 2, size=(T, B))
    obs = np.zeros((T, B, 3), np.float32)
    obs[..., 0] = context
    obs[..., 1] = 1 - context
    obs_t = torch.as_tensor(obs)
    action, info = agent.step(obs_t.reshape(T * B, 3))
    action = action.reshape(T, B, *action.shape[1:])
    done = torch.ones(T, B, dtype=torch.bool)
    samples = Samples(
        observation=obs_t,
        action=action,
        reward=reward_fn(torch.as_tensor(context), action).float(),
        terminated=done,
        truncated=torch.zeros(T, B, dtype=torch.bool),
        final_observation=obs_t,
        agent_info=AgentInfo(info.log_prob.reshape(T, B), info.value.reshape(T, B)),
        policy_version=torch.zeros(T, B, dtype=torch.int64),
        failed=torch.zeros(T, B, dtype=torch.bool),
    )
    return OnPolicyBatch(samples, torch.zeros(B), obs_t[-1])


def match_context(context, action):
    return (action == context).float()


def near_target(context, action):
    target = torch.where(context == 1, 0.5, -0.5)
    return -((action[..., 0] - target) ** 2)


def make_algo(name, agent):
    if name == "ppo":
        return PPO(agent, PPOConfig(lr=3e-3, anneal_lr=False, entropy_coef=0.0, epochs=4, minibatches=2))
    return A2C(agent, A2CConfig(lr=1e-2, optimizer="adam", normalize_advantage=True))


@pytest.mark.parametrize("name", ["ppo", "a2c"])
def test_learns_a_contextual_bandit_with_discrete_actions(name):
    torch.manual_seed(0)
    agent = PgAgent(OBS, gym.spaces.Discrete(2))
    algo = make_algo(name, agent)
    stats = [algo.update(bandit_batch(agent, 4, 32, match_context, seed=i), progress=i / 40).stats for i in range(40)]
    eval_batch = bandit_batch(agent, 4, 64, match_context, seed=999)
    assert eval_batch.samples.reward.mean() > 0.9
    # The value net learns the expected reward of each context (close to 1 once greedy).
    assert agent.value(eval_batch.samples.observation[0]).mean().item() == pytest.approx(1.0, abs=0.25)
    assert all(math.isfinite(v) for v in stats[0].values())


@pytest.mark.parametrize("name", ["ppo", "a2c"])
def test_learns_a_contextual_bandit_with_gaussian_actions(name):
    torch.manual_seed(0)
    agent = PgAgent(OBS, gym.spaces.Box(-1.0, 1.0, (1,), np.float32), agent_cfg=PgAgentConfig(init_log_std=-1.0))
    algo = make_algo(name, agent)
    for i in range(60):
        algo.update(bandit_batch(agent, 4, 32, near_target, seed=i), progress=i / 60)
    obs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    greedy, _ = agent.step(obs, EVALUATE)
    torch.testing.assert_close(greedy[:, 0], torch.tensor([0.5, -0.5]), atol=0.15, rtol=0)


def test_ppo_reports_kl_and_clipping_of_a_stale_batch_and_stops_at_lr_zero():
    torch.manual_seed(0)
    agent = PgAgent(OBS, gym.spaces.Discrete(2))
    batch = bandit_batch(agent, 4, 16, match_context, seed=0)
    info = batch.samples.agent_info
    # Behaviour log-probs one nat below the current ones: ratio = e for every sample.
    stale = batch._replace(samples=batch.samples._replace(agent_info=info._replace(log_prob=info.log_prob - 1.0)))
    before = [p.clone() for p in agent.parameters()]
    stats = PPO(agent, PPOConfig(anneal_lr=True)).update(stale, progress=1.0).stats
    assert stats["lr"] == 0.0
    assert stats["clip_fraction"] == 1.0
    assert stats["approx_kl"] == pytest.approx(math.e - 2.0, rel=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(before, agent.parameters()))
    assert set(stats) == {
        "policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "lr", "explained_variance", "grad_norm",
    }


@pytest.mark.parametrize("anneal_clip, progress, clipped", [(False, 0.5, 0.0), (True, 0.0, 0.0), (True, 0.5, 1.0)])
def test_ppo_clip_range_anneals_with_progress(anneal_clip, progress, clipped):
    """Ratios of e^0.15 ~ 1.16 lie inside the clip range 0.2 and outside 0.2 * (1 - 0.5) = 0.1."""
    torch.manual_seed(0)
    agent = PgAgent(OBS, gym.spaces.Discrete(2))
    batch = bandit_batch(agent, 4, 16, match_context, seed=0)
    info = batch.samples.agent_info
    stale = batch._replace(samples=batch.samples._replace(agent_info=info._replace(log_prob=info.log_prob - 0.15)))
    cfg = PPOConfig(clip_eps=0.2, anneal_clip=anneal_clip, epochs=1, minibatches=1)
    assert PPO(agent, cfg).update(stale, progress=progress).stats["clip_fraction"] == clipped


@pytest.mark.parametrize("name", ["ppo", "a2c"])
def test_optimizer_state_round_trip_continues_identically(name):
    torch.manual_seed(0)
    agent_a = PgAgent(OBS, gym.spaces.Discrete(2))
    algo_a = make_algo(name, agent_a)
    algo_a.update(bandit_batch(agent_a, 4, 16, match_context, seed=0), progress=0.0)

    agent_b = PgAgent(OBS, gym.spaces.Discrete(2))
    agent_b.load_state_dict(agent_a.state_dict())
    algo_b = make_algo(name, agent_b)
    saved = io.BytesIO()
    torch.save(algo_a.state_dict(), saved)
    saved.seek(0)
    algo_b.load_state_dict(torch.load(saved))

    batch = bandit_batch(agent_a, 4, 16, match_context, seed=1)
    for agent, algo in ((agent_a, algo_a), (agent_b, algo_b)):
        torch.manual_seed(1)
        algo.update(batch, progress=0.1)
    for pa, pb in zip(agent_a.parameters(), agent_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


# ---------------------------------------------------------------- CartPole (learning checks)


def train_cartpole(cfg: A2CConfig, T, total_steps, seed, target, n_envs=32):
    """Sampler-like loop (SAME_STEP autoreset) filling Samples exactly as the contract says.

    Returns the mean return of the last 100 finished episodes after each batch, stopping
    once it reaches ``target``.
    """
    torch.manual_seed(seed)
    env = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1") for _ in range(n_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    obs, _ = env.reset(seed=seed)
    agent = PgAgent(np.zeros(4, np.float32), env.single_action_space)
    algo = A2C(agent, cfg)
    buf = Samples(
        observation=np.zeros((T, n_envs, 4), np.float32),
        action=np.zeros((T, n_envs), np.int64),
        reward=np.zeros((T, n_envs), np.float32),
        terminated=np.zeros((T, n_envs), bool),
        truncated=np.zeros((T, n_envs), bool),
        final_observation=np.full((T, n_envs, 4), -42.42, np.float32),
        agent_info=AgentInfo(np.zeros((T, n_envs), np.float32), np.zeros((T, n_envs), np.float32)),
        policy_version=np.zeros((T, n_envs), np.int64),
        failed=np.zeros((T, n_envs), bool),
    )
    episode_return, finished, curve = np.zeros(n_envs), [], []
    for version in range(total_steps // (T * n_envs)):
        for t in range(T):
            action, info = agent.step(torch.as_tensor(obs))
            buf.observation[t] = obs
            obs, reward, terminated, truncated, infos = env.step(action.numpy())
            buf[t] = Samples(buf.observation[t], action.numpy(), reward, terminated, truncated,
                             buf.final_observation[t], AgentInfo(*(x.numpy() for x in info)), version, False)
            episode_return += reward
            for i in np.nonzero(terminated | truncated)[0]:
                buf.final_observation[t, i] = infos["final_obs"][i]
                finished.append(episode_return[i])
                episode_return[i] = 0.0
        batch = OnPolicyBatch(torchify(buf), agent.value(torch.as_tensor(obs)).detach(), torch.as_tensor(obs))
        algo.update(batch, progress=version * T * n_envs / total_steps)
        curve.append(np.mean(finished[-100:]) if len(finished) >= 100 else -np.inf)
        if curve[-1] >= target:
            break
    env.close()
    return curve


@pytest.mark.learning
def test_a2c_learns_cartpole():
    # ~3 s on one free core. SB3 defaults; 200 is reached at 35-55k steps (3 seeds).
    curve = train_cartpole(A2CConfig(), T=5, total_steps=100_000, seed=0, target=200)
    assert max(curve) >= 200
