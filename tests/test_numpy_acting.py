"""The numpy acting step equals the torch agents' step: same greedy actions, log-probs and
values, samples from the same distributions; it follows parameter versions loaded in place,
and, built from the learner's acting.json on arrays of its own, the versions the learner
publishes."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest
import torch

from shared.transport import shm
from shared.agents.acting import acting_seed, check_plan, numpy_actor, read_acting_file, write_acting_file
from shared.agents.config import ModelConfig, PgAgentConfig, QAgentConfig, QpgAgentConfig
from shared.agents import EVALUATE, StepContext
from shared.agents.actor import Actor, acting_plan, state_arrays
from shared.agents.pg import PgAgent
from shared.agents.q import QAgent
from shared.agents.qpg import SacAgent
from shared.data.namedarraytuple import namedarraytuple
from shared.transport.params import ParamFollower, ParamWriter, StateArrays

OBS = np.zeros(4, np.float32)
ATOL = 2e-5


def _obs(n: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 2.0, (n, 4)).astype(np.float32)


def _normalised(agent) -> None:
    """Observation statistics far from the initial ones, so that normalising matters."""
    if agent.obs_norm is not None:
        agent.obs_norm.mean.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64))
        agent.obs_norm.var.copy_(torch.tensor([4.0, 0.25, 9.0, 1.0], dtype=torch.float64))


def _rng():
    return np.random.default_rng(0)


def _numpy_actor(agent):
    """The numpy actor on views of ``agent``'s tensors, its plan through JSON as a sampler reads it."""
    return numpy_actor(json.loads(json.dumps(acting_plan(agent))), state_arrays(agent), getattr(agent, "cfg", None), _rng())


PG_SPACES = {"discrete": gym.spaces.Discrete(3), "multi_discrete": gym.spaces.MultiDiscrete([2, 4]),
             "box": gym.spaces.Box(-1.0, 1.0, (2,), np.float32)}


@pytest.mark.parametrize("space", PG_SPACES)
@pytest.mark.parametrize("model", [ModelConfig(hidden_sizes=(64, 64)),
                                   ModelConfig(hidden_sizes=(32,), activation="relu", normalize_observations=True)])
@pytest.mark.parametrize("shared_encoder", [False, True])
def test_policy_gradient_agents_act_as_in_torch(space, model, shared_encoder):
    torch.manual_seed(0)
    agent = PgAgent(OBS, PG_SPACES[space], model, PgAgentConfig(shared_encoder=shared_encoder))
    _normalised(agent)
    actor, obs = _numpy_actor(agent), _obs()
    with torch.no_grad():
        want_action, want = agent.step(torch.from_numpy(obs), EVALUATE)
        action, info = actor.step(obs, EVALUATE)
        np.testing.assert_allclose(action, want_action.numpy(), atol=ATOL)  # the mode
        np.testing.assert_allclose(info.log_prob, want.log_prob.numpy(), atol=ATOL)
        np.testing.assert_allclose(info.value, want.value.numpy(), atol=ATOL)
        # Sampled actions carry their exact log-probs and the values of their observations.
        action, info = actor.step(obs, StepContext())
        log_prob, _, value = agent.evaluate(torch.from_numpy(obs), torch.from_numpy(action))
    assert action.dtype == want_action.numpy().dtype and action.shape == want_action.shape
    assert info.log_prob.dtype == info.value.dtype == np.float32
    np.testing.assert_allclose(info.log_prob, log_prob.numpy(), atol=ATOL)
    np.testing.assert_allclose(info.value, value.numpy(), atol=ATOL)


def test_categorical_samples_follow_the_softmax():
    torch.manual_seed(1)
    agent = PgAgent(OBS, gym.spaces.Discrete(3), ModelConfig(hidden_sizes=(8,)))
    with torch.no_grad():
        agent.twin.biases[-1][0, 0].copy_(torch.tensor([1.0, 0.0, -1.0]))  # a policy far from uniform
        obs = np.repeat(_obs(1), 30_000, axis=0)
        probs = torch.softmax(agent._forward(torch.from_numpy(obs[:1]))[0], -1)[0].numpy()
    action, _ = _numpy_actor(agent).step(obs, StepContext())
    np.testing.assert_allclose(np.bincount(action, minlength=3) / len(action), probs, atol=0.01)


def test_gaussian_samples_have_the_policy_mean_and_std():
    torch.manual_seed(2)
    agent = PgAgent(OBS, PG_SPACES["box"], ModelConfig(hidden_sizes=(8,)), PgAgentConfig(init_log_std=-0.5))
    obs = np.repeat(_obs(1), 30_000, axis=0)
    with torch.no_grad():
        mean = agent._forward(torch.from_numpy(obs[:1]))[0][0].numpy()
    action, _ = _numpy_actor(agent).step(obs, StepContext())
    np.testing.assert_allclose(action.mean(0), mean, atol=0.01)
    np.testing.assert_allclose(action.std(0), np.exp(-0.5), atol=0.01)


@pytest.mark.parametrize("dueling", [False, True])
@pytest.mark.parametrize("distributional", [False, True])
def test_q_agents_act_as_in_torch(dueling, distributional):
    torch.manual_seed(3)
    cfg = QAgentConfig(dueling=dueling, distributional=distributional, n_atoms=11, v_min=-5.0, v_max=5.0,
                       eps_eval=0.0, eps_start=1.0, eps_decay_steps=1000, eps_end=0.0)
    agent = QAgent(OBS, gym.spaces.Discrete(4), ModelConfig(hidden_sizes=(32, 32), activation="relu",
                                                           normalize_observations=True), cfg)
    _normalised(agent)
    actor, obs = _numpy_actor(agent), _obs()
    with torch.no_grad():
        q = agent.q_values(torch.from_numpy(obs)).numpy()
    action, info = actor.step(obs, EVALUATE)
    np.testing.assert_array_equal(action, q.argmax(-1))
    np.testing.assert_allclose(info.value, q.max(-1), atol=ATOL)
    # Each env's epsilon from the agent's schedule: 1 at step 0 (uniform), 0 once decayed (greedy).
    action, _ = actor.step(np.repeat(obs[:1], 20_000, axis=0), StepContext(env_steps=0))
    np.testing.assert_allclose(np.bincount(action, minlength=4) / len(action), 0.25, atol=0.015)
    action, _ = actor.step(obs, StepContext(env_steps=5_000))
    np.testing.assert_array_equal(action, q.argmax(-1))


def test_the_actor_follows_parameters_loaded_in_place():
    """Parameter versions are copied into the agent's tensors (shared.transport.params): the numpy views see them."""
    torch.manual_seed(4)
    agent = PgAgent(OBS, gym.spaces.Discrete(3), ModelConfig(hidden_sizes=(16,), normalize_observations=True))
    other = PgAgent(OBS, gym.spaces.Discrete(3), ModelConfig(hidden_sizes=(16,), normalize_observations=True))
    _normalised(other)
    actor, obs = _numpy_actor(agent), _obs()
    before = actor.step(obs, EVALUATE)[1].value.copy()
    agent.load_state_dict(other.state_dict())
    with torch.no_grad():
        want = other.step(torch.from_numpy(obs), EVALUATE)[1].value.numpy()
    after = actor.step(obs, EVALUATE)[1].value
    assert not np.allclose(before, want)
    np.testing.assert_allclose(after, want, atol=ATOL)


@pytest.mark.parametrize("family", ["pg", "q"])
def test_a_dict_of_flat_leaves_acts_in_numpy_as_in_torch(family):
    """Leaves the encoder flattens as they are (a float vector, a small uint8 map scaled by
    ``uint8_scale``) are concatenated in field order in numpy too."""
    Obs = namedarraytuple("Obs", ["img", "x"])
    example = Obs(img=np.zeros((2, 2), np.uint8), x=np.zeros(3, np.float32))
    torch.manual_seed(0)
    model = ModelConfig(hidden_sizes=(16,))
    agent = PgAgent(example, gym.spaces.Discrete(3), model) if family == "pg" else \
        QAgent(example, gym.spaces.Discrete(3), model, QAgentConfig(eps_eval=0.0))
    plan = acting_plan(agent)
    assert plan["inputs"] == [["img", pytest.approx(1 / 255)], ["x", 1.0]] and plan["mask"] is None
    rng = np.random.default_rng(0)
    obs = Obs(img=rng.integers(0, 256, (64, 2, 2)).astype(np.uint8), x=rng.normal(size=(64, 3)).astype(np.float32))
    with torch.no_grad():
        want_action, want = agent.step(obs, EVALUATE)
    action, info = _numpy_actor(agent).step(obs, EVALUATE)
    np.testing.assert_array_equal(action, want_action.numpy())
    np.testing.assert_allclose(info.value, want.value.numpy(), atol=ATOL)


def test_agents_the_numpy_step_does_not_cover_act_in_torch():
    recurrent = PgAgent(OBS, gym.spaces.Discrete(2), ModelConfig(hidden_sizes=(8,), lstm_size=8))
    image = QAgent(np.zeros((4, 84, 84), np.uint8), gym.spaces.Discrete(2), ModelConfig(encoder="nature_cnn"))
    continuous = SacAgent(OBS, PG_SPACES["box"], ModelConfig(hidden_sizes=(8,)), QpgAgentConfig())
    for agent in (recurrent, image, continuous):
        assert acting_plan(agent) is None
    # ...and the Actor runs them in torch, with the same call.
    actor = Actor(continuous, acting_seed(0, "sampler", 0))
    action, _ = actor(_obs(5), np.arange(5), np.zeros(5, bool), np.zeros(5, np.float32), 0, 5)
    assert action.shape == (5, 2) and np.all(np.abs(action) <= 1.0)


def test_acting_processes_draw_different_noise():
    """Every sampler and action-server of a run gets its own stream (they all build the agent from run.seed)."""
    torch.manual_seed(5)
    agent = PgAgent(OBS, gym.spaces.Discrete(2), ModelConfig(hidden_sizes=(8,)))
    obs = np.repeat(_obs(1), 256, axis=0)
    draws = [Actor(agent, acting_seed(7, service, i))(obs, np.arange(256), np.zeros(256, bool),
                                                        np.zeros(256, np.float32), 0, 256)[0]
             for service, i in (("sampler", 0), ("sampler", 1), ("action_server", 0))]
    assert not np.array_equal(draws[0], draws[1]) and not np.array_equal(draws[0], draws[2])
    again = Actor(agent, acting_seed(7, "sampler", 0))(obs, np.arange(256), np.zeros(256, bool),
                                                       np.zeros(256, np.float32), 0, 256)[0]
    np.testing.assert_array_equal(again, draws[0])  # and the same seed replays the same draws


@pytest.mark.parametrize("make", [
    lambda: PgAgent(OBS, gym.spaces.Discrete(3), ModelConfig(hidden_sizes=(16,), normalize_observations=True)),
    lambda: QAgent(OBS, gym.spaces.Discrete(4), ModelConfig(hidden_sizes=(16,)),
                   QAgentConfig(dueling=True, distributional=True, n_atoms=5, eps_eval=0.0))])
def test_a_sampler_acts_from_acting_json_on_its_own_arrays_with_each_published_version(make, tmp_path, run_id):
    """What a torch-free local sampler does: acting.json, StateArrays and a ParamFollower."""
    torch.manual_seed(6)
    learner, obs = make(), _obs()
    writer = ParamWriter(learner, shm.segment_name(run_id, "learner", 0, "params"))
    write_acting_file(tmp_path, writer.descriptor["spec"], acting_plan(learner))
    published = read_acting_file(tmp_path)
    state = StateArrays(published["spec"])
    actor = numpy_actor(published["plan"], state.arrays, getattr(learner, "cfg", None), _rng())
    follower = ParamFollower(state, writer.descriptor["name"], shm.Owner(run_id, "learner"), recheck_s=0.0)
    try:
        for version in range(3):
            _normalised(learner) if version == 1 else torch.nn.init.normal_(next(learner.parameters()))
            writer.write(version)
            assert follower.poll() and follower.version == version
            with torch.no_grad():
                want_action, want = learner.step(torch.from_numpy(obs), EVALUATE)
            action, info = actor.step(obs, EVALUATE)
            np.testing.assert_array_equal(action, want_action.numpy())
            np.testing.assert_allclose(info.value, want.value.numpy(), atol=ATOL)
    finally:
        follower.close()
        writer.close()


def test_a_bad_acting_plan_or_layout_is_a_clear_error():
    agent = PgAgent(OBS, gym.spaces.Discrete(3), ModelConfig(hidden_sizes=(8,)))
    plan, arrays = acting_plan(agent), state_arrays(agent)
    with pytest.raises(ValueError, match="p_nowhere"):
        check_plan({**plan, "pi_head": [["p_nowhere", plan["pi_head"][0][1], None]]}, arrays)
    with pytest.raises(ValueError, match="activations.*'gelu'"):
        check_plan({**plan, "v_head": [[*plan["v_head"][0][:2], "gelu"]]}, arrays)
    with pytest.raises(ValueError, match="malformed"):
        check_plan({**plan, "trunks": 3}, arrays)
    w, b, fn, _ = plan["v_head"][0]  # the twin's value member: member 2 of 2, or a member of a 2-D weight
    with pytest.raises(ValueError, match=r"ensemble members \['p_twin__weights__0\[2\]'\]"):
        check_plan({**plan, "v_head": [[w, b, fn, 2]]}, arrays)
    with pytest.raises(ValueError, match=r"ensemble members \['p_flat\[0\]'\]"):
        check_plan({**plan, "v_head": [["p_flat", b, fn, 0]]}, {**arrays, "p_flat": np.zeros((8, 3), np.float32)})
    with pytest.raises(ValueError, match="not a parameter segment|layout of a parameter segment"):
        StateArrays({"type": "Other", "fields": [["x", {"dtype": "<f4", "shape": [2]}]]})
