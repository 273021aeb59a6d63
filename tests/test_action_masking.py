"""Action masking (``model.action_mask``, shared/agents/masking.py): PPO/A2C's and the DQN
family's agents never pick an illegal action, whatever the mask, in torch (the action-server's
and a torch-acting sampler's step, evaluation) and in numpy (a local sampler's acting plan);
PPO's log-probabilities and entropy are over the legal actions; DQN's and R2D1's bootstrap
actions are legal ones; a mask the config names wrongly is one line. The learning checks run
rlpipe/MaskedChoice-v0 (shared/envs/tasks.py) through the pipeline in both inference modes
(PPO, DQN) and in serial mode (PPO, A2C, DQN, R2D1, PQN)."""

from __future__ import annotations

import io
import json
import tomllib
from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from services.build import make_agent
from services.evaluator.episodes import play
from shared.agents import EVALUATE, StepContext
from shared.agents.acting import numpy_actor
from shared.agents.actor import Actor, acting_plan, state_arrays
from shared.agents.config import Memory, ModelConfig, QAgentConfig, QpgAgentConfig, QuantileHead, RnnState
from shared.agents.masking import MASKED_LOGIT, legal, mask_path
from shared.agents.pg import PgAgent
from shared.agents.q import QAgent
from shared.agents.qpg import SacAgent
from shared.algos.hparams import DQNConfig, R2D1Config
from shared.algos.dqn import DQN
from shared.algos.r2d1 import R2D1, sequence_targets, h, h_inv
from shared.config import loading
from shared.config.schema import ConfigError
from shared.launch import api, rundirs
from shared.data.batches import SequenceBatch, Transition
from shared.data.namedarraytuple import map_leaves, namedarraytuple
from shared.envs.backends import make_env_group
from shared.envs.group import EnvConfig
from tests.pipeline import CONFIGS

A = 6  # MaskedChoice's actions
TASK = EnvConfig(id="rlpipe/MaskedChoice-v0")


def _task():
    """(example observation, observation space) of MaskedChoice, as EnvGroup lays them out."""
    probe = make_env_group(TASK, 1, 0)
    try:
        return probe.example_observation(), probe.observation_space
    finally:
        probe.close()


EXAMPLE, SPACE = _task()
MultiObs = namedarraytuple("MultiObs", ["action_mask", "x"])


def _obs(mask: np.ndarray, seed: int = 0):
    """A batch [B] of MaskedChoice observations with ``mask`` [B, A] and random cues."""
    cue = np.eye(A, dtype=np.float32)[np.random.default_rng(seed).integers(A, size=len(mask))]
    return type(EXAMPLE)(action_mask=mask.astype(np.int8), cue=cue)


def _legal(mask: np.ndarray) -> np.ndarray:
    return mask | ~mask.any(-1, keepdims=True)  # a row with none: every action counts as legal


def _moved(agent):
    """``agent`` with its weights moved off their initialisation (a fresh head's near-ties
    would make any pick look fine)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in agent.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    return agent


QCFG = QAgentConfig(eps_start=1.0, eps_end=1.0, eps_eval=0.0)  # exploring: every action random; greedy: none
MODEL = ModelConfig(hidden_sizes=(16,))
AGENTS = {
    "ppo": lambda: PgAgent(EXAMPLE, gym.spaces.Discrete(A), MODEL, obs_space=SPACE),
    "ppo_lstm": lambda: PgAgent(EXAMPLE, gym.spaces.Discrete(A), replace(MODEL, lstm_size=8), obs_space=SPACE),
    "dqn": lambda: QAgent(EXAMPLE, gym.spaces.Discrete(A), MODEL, QCFG, obs_space=SPACE),
    "rainbow": lambda: QAgent(EXAMPLE, gym.spaces.Discrete(A), MODEL,
                              replace(QCFG, dueling=True, distributional=True), obs_space=SPACE),
    "qr_dqn": lambda: QAgent(EXAMPLE, gym.spaces.Discrete(A), MODEL, QCFG, obs_space=SPACE,
                             quantiles=QuantileHead(n_quantiles=8)),
    "iqn": lambda: QAgent(EXAMPLE, gym.spaces.Discrete(A), MODEL, QCFG, obs_space=SPACE,
                          quantiles=QuantileHead(n_cosines=8, acting_samples=4)),
    "r2d1": lambda: QAgent(EXAMPLE, gym.spaces.Discrete(A), replace(MODEL, lstm_size=8), QCFG, obs_space=SPACE),
}
torch.manual_seed(0)
BUILT = {name: _moved(make()) for name, make in AGENTS.items()}
MASKS = st.integers(1, 16).flatmap(lambda b: arrays(np.bool_, (b, A)))


@pytest.mark.parametrize("name", list(AGENTS))
@settings(max_examples=30, deadline=None)
@given(mask=MASKS)
def test_torch_agents_never_pick_an_illegal_action(name, mask):
    """The step the action-server, a torch-acting local sampler, serial mode and evaluation run."""
    agent, ok = BUILT[name], _legal(mask)
    obs = _obs(mask)
    for ctx in (StepContext(), EVALUATE):
        action, info = agent.step(map_leaves(torch.as_tensor, obs), ctx)
        assert ok[np.arange(len(mask)), action.numpy()].all(), (ctx.greedy, mask, action)
        assert torch.isfinite(info.value).all()


@pytest.mark.parametrize("name", ["ppo", "dqn", "rainbow", "qr_dqn"])
@settings(max_examples=30, deadline=None)
@given(mask=MASKS)
def test_numpy_acting_never_picks_an_illegal_action_and_matches_torch_greedy(name, mask):
    """A local sampler's numpy actor, built from the plan as it reads it from acting.json, and
    the ``Actor`` serial mode and local samplers wrap the agent in."""
    agent, ok = BUILT[name], _legal(mask)
    plan = json.loads(json.dumps(acting_plan(agent)))
    assert plan is not None and plan["mask"] == "action_mask"
    actor = numpy_actor(plan, state_arrays(agent), getattr(agent, "cfg", None), np.random.default_rng(0))
    obs, rows = _obs(mask), np.arange(len(mask))
    for ctx in (StepContext(), EVALUATE):
        action, _ = actor.step(obs, ctx)
        assert ok[rows, action].all(), (ctx.greedy, mask, action)
    with torch.no_grad():
        np.testing.assert_array_equal(actor.step(obs, EVALUATE)[0], agent.step(obs, EVALUATE)[0].numpy())
    wrapped = Actor(agent, np.random.SeedSequence(0))
    assert wrapped.fast is not None
    action, _ = wrapped(obs, rows, np.zeros(len(mask), bool), np.zeros(len(mask), np.float32), 0, len(mask))
    assert ok[rows, action].all()


def test_multi_discrete_masks_each_part():
    """MultiDiscrete([2, 3]): the mask is 2 + 3 entries, each part's in order (MaskablePPO's layout)."""
    space = gym.spaces.Dict({"action_mask": gym.spaces.MultiBinary(5), "x": gym.spaces.Box(-1, 1, (3,))})
    example = MultiObs(action_mask=np.ones(5, np.int8), x=np.zeros(3, np.float32))
    agent = _moved(PgAgent(example, gym.spaces.MultiDiscrete([2, 3]), MODEL, obs_space=space))
    mask = np.array([[1, 0, 0, 1, 0], [0, 1, 1, 0, 1]] * 32, np.int8)
    obs = MultiObs(action_mask=mask, x=np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32))
    actor = numpy_actor(acting_plan(agent), state_arrays(agent), None, np.random.default_rng(0))
    for ctx in (StepContext(), EVALUATE):
        for action in (agent.step(obs, ctx)[0].numpy(), actor.step(obs, ctx)[0]):
            assert mask[np.arange(64), action[:, 0]].all() and mask[np.arange(64), 2 + action[:, 1]].all()


def test_ppo_log_probs_and_entropy_are_over_the_legal_actions():
    agent = BUILT["ppo"]
    mask = np.random.default_rng(1).random((32, A)) < 0.5
    mask[0] = False  # no legal action: all count
    obs, ok = _obs(mask), torch.as_tensor(_legal(mask))
    action, info = agent.step(obs, StepContext())
    log_prob, entropy, _ = agent.evaluate(obs, action)
    logits, _ = agent._forward(map_leaves(torch.as_tensor, obs))
    for i in range(len(mask)):
        want = torch.distributions.Categorical(logits=logits[i][ok[i]].detach())
        pick = int(ok[i, :action[i]].sum())  # the action's index among the legal ones
        assert entropy[i].item() == pytest.approx(want.entropy().item(), abs=1e-5)
        assert log_prob[i].item() == pytest.approx(want.log_prob(torch.tensor(pick)).item(), abs=1e-5)
    np.testing.assert_allclose(info.log_prob.numpy(), log_prob.detach().numpy(), atol=1e-5)
    (entropy.sum() + log_prob.sum()).backward()  # finite, and nothing flows through an illegal logit
    assert all(torch.isfinite(p.grad).all() for p in agent.parameters() if p.grad is not None)
    agent.zero_grad()
    assert MASKED_LOGIT < -1e6


def _transitions(n: int, only: int, seed: int = 0) -> Transition:
    """n transitions of MaskedChoice observations whose bootstrap observations allow ``only``."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((n, A), bool)
    mask[:, only] = True
    return Transition(observation=map_leaves(torch.as_tensor, _obs(rng.random((n, A)) < 0.5, seed)),
                      action=torch.as_tensor(rng.integers(A, size=n)),
                      return_=torch.as_tensor(rng.random(n), dtype=torch.float32),
                      bootstrap_observation=map_leaves(torch.as_tensor, _obs(mask, seed + 1)),
                      bootstrap_discount=torch.full((n,), 0.9), is_weight=torch.ones(n),
                      policy_version=torch.zeros(n, dtype=torch.long), steps=None)


@pytest.mark.parametrize("name", ["dqn", "qr_dqn"])
@pytest.mark.parametrize("double", [False, True])
def test_dqn_bootstraps_from_the_best_legal_action(name, double):
    """With one legal action at every bootstrap observation, the target is r + d Q_target(s', that
    action) whatever the online and target nets think of the illegal ones."""
    torch.manual_seed(0)
    algo = DQN(_moved(AGENTS[name]()), DQNConfig(double=double))
    unmasked_differs = []
    for only in range(A):
        batch = _transitions(64, only)
        with torch.no_grad():
            q_next = algo.target.q_values(batch.bootstrap_observation)
        want = (batch.return_ + batch.bootstrap_discount * q_next[:, only]).mean().item()
        unmasked_differs.append(bool(q_next.argmax(-1).ne(only).any()))
        stats = algo.update(batch, 0.0).stats
        assert stats["target_mean"] == pytest.approx(want, rel=1e-5)
    # Unmasked, other actions would have been picked in every round but (at most) the one where
    # the legal action is the one the net prefers anyway.
    assert sum(unmasked_differs) >= A - 1, unmasked_differs


def test_r2d1_bootstraps_from_the_best_legal_action():
    """R2D1's targets: y_t = h(R_t + d_t h^-1(Q_target(s_{t+m}, a*))) with a* the masked argmax
    at the bootstrap step; with one legal action there, a* is that action."""
    L, n, only = 12, 4, 2
    torch.manual_seed(0)
    agent = _moved(AGENTS["r2d1"]())
    algo = R2D1(agent, R2D1Config(burn_in=2, n_step=3))
    g = torch.Generator().manual_seed(0)
    mask = np.zeros((L * n, A), bool)
    mask[:, only] = True
    obs = map_leaves(lambda x: torch.as_tensor(x).reshape(L, n, *x.shape[1:]), _obs(mask))
    action = torch.randint(A, (L, n), generator=g)
    batch = SequenceBatch(
        observation=obs, action=action, reward=torch.randn(L, n, generator=g),
        terminated=torch.zeros(L, n, dtype=torch.bool), truncated=torch.zeros(L, n, dtype=torch.bool),
        failed=torch.zeros(L, n, dtype=torch.bool), prev_action=torch.cat([torch.zeros(1, n, dtype=torch.long), action[:-1]]), prev_reward=torch.zeros(L, n),
        start_state=RnnState(h=torch.randn(n, 1, 8, generator=g), c=torch.randn(n, 1, 8, generator=g)),
        is_weight=torch.ones(n), policy_version=torch.zeros(n, dtype=torch.long))
    _, extra = algo.loss(batch)
    cfg = algo.cfg
    tg = sequence_targets(batch.reward, batch.terminated, batch.truncated, cfg.n_step, cfg.gamma, batch.failed)
    memory = Memory(prev_action=batch.prev_action, prev_reward=batch.prev_reward,
                    state=RnnState(h=batch.start_state.h[None], c=batch.start_state.c[None]))
    with torch.no_grad():
        q_target = algo.target.q_sequence(obs, memory)  # [L, n, A]
    q_boot = q_target[tg.bootstrap_index, torch.arange(n)[None], only]
    want = h(tg.return_ + tg.discount * h_inv(q_boot, cfg.value_rescale_eps), cfg.value_rescale_eps)
    trained = extra["mask"]
    assert trained.any() and q_target[tg.bootstrap_index, torch.arange(n)[None]].argmax(-1)[trained].ne(only).any()
    torch.testing.assert_close(extra["target"][trained], want[trained], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ config and env errors: one line


@pytest.mark.parametrize("overrides, message", [
    (["model.action_mask='legal'"], "model.action_mask = 'legal': the observation has no such key (it has "
                                    "action_mask, cue); name the mask's key, or set \"\" for no masking"),
    (["model.action_mask='cue'"], "model.action_mask: the mask 'cue' is Box(0.0, 1.0, (6,), float32); it must be "
                                  "MultiBinary(6) or a bool Box"),
    (["env.id='tests.envs_for_tests:make_wrong_mask_env'"],
     "model.action_mask: the mask 'action_mask' has shape (6,), the action space needs (7,) (one entry per action)"),
    (["env.id='CartPole-v1'", "model.action_mask='action_mask'"],
     "model.action_mask = 'action_mask': the observation has no such key (it has one array, not a Dict); name the "
     "mask's key, or set \"\" for no masking"),
])
def test_a_mask_the_env_does_not_have_is_one_config_error_line(overrides, message):
    exp = loading.load(CONFIGS / "masked_choice_ppo.toml", overrides)
    probe = make_env_group(exp.env, 1, 0)
    try:
        with pytest.raises(ConfigError) as e:
            make_agent(exp, probe)
    finally:
        probe.close()
    assert "\n" not in str(e.value) and str(e.value).endswith(message), str(e.value)


def test_a_mask_with_box_actions_is_a_config_error():
    """DDPG/TD3/SAC (and a Gaussian PPO) have no actions to mask: an env offering a mask says so."""
    example = MultiObs(action_mask=np.ones(2, np.int8), x=np.zeros(3, np.float32))
    box = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    for make in (lambda: PgAgent(example, box, MODEL), lambda: SacAgent(example, box, MODEL, QpgAgentConfig())):
        with pytest.raises(ValueError, match="model.action_mask: the observation has a mask 'action_mask', but masks "
                                             "need a Discrete or MultiDiscrete action space"):
            make()
    PgAgent(example, box, replace(MODEL, action_mask=""))  # turned off: the leaf is one more input


def test_auto_masks_only_where_the_key_is_and_empty_turns_masking_off():
    assert mask_path("auto", EXAMPLE, A, SPACE) == "action_mask"
    assert mask_path("auto", np.zeros(4, np.float32), 2) is None  # CartPole: nothing to mask
    assert mask_path("", EXAMPLE, A, SPACE) is None
    assert legal(_obs(np.zeros((2, A), bool)), "action_mask").all()


# ------------------------------------------------------------------ evaluation, serial mode, the pipeline


@pytest.mark.parametrize("config", ["masked_choice_ppo.toml", "masked_choice_dqn.toml"])
def test_evaluation_episodes_play_no_illegal_action(config):
    """Greedy evaluation (``rlpipe evaluate``, the evaluator service) of an untrained agent, a
    DQN one playing eps_eval = 1 (random legal actions): an illegal action costs 100 here, so
    any one would make its episode's return negative."""
    exp = loading.load(CONFIGS / config, ["env.kwargs='{\"penalty\": 100}'", "agent.eps_eval=1.0"]
                       if "dqn" in config else ["env.kwargs='{\"penalty\": 100}'"])
    probe = make_env_group(exp.env, 1, 0)
    agent = make_agent(exp, probe)
    probe.close()
    returns = play(exp, agent, episodes=32, envs=8).returns
    assert len(returns) == 32 and returns.min() >= 0, returns


def _serial_config(name: str, runs_dir: Path) -> dict:
    """The shipped PPO or DQN config; A2C on the PPO one's env, sampler and model; R2D1 on the
    DQN one's, with a small LSTM on 8-step sequences; PQN (a dict of the TOML's)."""
    cfg = tomllib.loads((CONFIGS / f"masked_choice_{'ppo' if name in ('ppo', 'a2c') else 'dqn'}.toml").read_text())
    if name == "a2c":
        cfg.update(algo={"name": "a2c", "lr": 3e-3, "gamma": 0.9}, sampler={"count": 1, "envs": 16, "horizon": 5})
    if name == "r2d1":
        cfg["model"].update(hidden_sizes=[32], activation="relu", lstm_size=16)
        cfg["replay"].update(table="sequence", capacity=10000, sequence_length=8, sequence_period=4,
                             samples_per_insert=2.0, min_size_to_sample=100)
        cfg["algo"] = {"name": "r2d1", "lr": 1e-3, "batch_size": 16, "burn_in": 0, "n_step": 1, "gamma": 0.9}
    if name == "pqn":  # the shipped CartPole config's network and settings, one hidden layer, gamma 0.9
        pqn = tomllib.loads((CONFIGS / "cartpole_pqn.toml").read_text())
        cfg.update(model=dict(pqn["model"], hidden_sizes=[64]), agent=dict(pqn["agent"], eps_decay_steps=3000),
                   sampler=pqn["sampler"], learner=pqn["learner"], algo=dict(pqn["algo"], gamma=0.9))
        del cfg["replay"]
    cfg["run"]["runs_dir"] = str(runs_dir)
    return cfg


@pytest.mark.learning
@pytest.mark.parametrize("name", ["ppo", "a2c", "dqn", "r2d1", "pqn"])
def test_serial_mode_learns_the_masked_task_without_an_illegal_action(tmp_path, name):
    result = api.train_serial(api.experiment(_serial_config(name, tmp_path)), out=io.StringIO())
    assert result["reason"] == "target" and result["mean_return"] >= 7.5, result
    rows = [r for r in rundirs.read_progress(Path(result["run_dir"])) if int(r["episodes"]) > 0]
    assert rows and all(float(r["mean_length"]) == 16 for r in rows), rows  # an illegal action ends one early


@pytest.mark.learning
@pytest.mark.parametrize("config, inference", [("masked_choice_ppo.toml", "local"),
                                               ("masked_choice_dqn.toml", "server")])
def test_the_pipeline_learns_the_masked_task_without_an_illegal_action(runs, config, inference):
    """PPO with a local-inference sampler (numpy acting), DQN with an action-server (torch)."""
    run = runs(config, f"sampler.inference={inference}")
    result = run.wait_result(90)
    assert result["reason"] == "target" and result["mean_return"] >= 7.5, result
    rows = [r for r in run.progress() if int(r["episodes"]) > 0]
    assert rows and all(float(r["mean_length"]) == 16 for r in rows), rows
    plan = json.loads((run.dir / "acting.json").read_text())["plan"]
    assert plan["mask"] == "action_mask" and plan["inputs"] == [["action_mask", 1.0], ["cue", 1.0]]
