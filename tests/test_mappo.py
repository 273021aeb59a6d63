"""A centralised value for PPO (MAPPO, ``env.global_state``): each column of a PettingZoo env
carries the env's ``state()`` as its ``global_state`` leaf; the value network reads it, the policy
(torch, the numpy acting plan, export) never does; a setting that cannot work is one
config-error line; deploy/configs/simple_spread_mappo.toml trains in serial mode and its greedy
policy plays and exports without the state."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("pettingzoo")
pytest.importorskip("mpe2")

from services.evaluator.episodes import load_agent, play
from shared.agents import EVALUATE
from shared.agents.actor import acting_plan, state_arrays
from shared.agents.acting import numpy_actor
from shared.agents.pg import PgAgent
from shared.config import loading
from shared.config.schema import ConfigError
from shared.data.namedarraytuple import torchify
from shared.envs.backends import make_env_group
from shared.envs.group import EnvConfig
from shared.launch import api
from shared.launch.artefacts.export import GreedyPolicy, example_inputs
from shared.runtime.runfiles import TB_DIR
from tensorboard.backend.event_processing import event_accumulator
from tests.pipeline import CONFIGS
from tests.test_envs import Buffers, step_beside_references

torch.set_num_threads(1)

MAPPO = CONFIGS / "simple_spread_mappo.toml"
SPREAD = EnvConfig(id="pettingzoo:mpe2.simple_spread_v3", agent_id=True, global_state=True)


def test_every_column_carries_its_envs_state_which_the_value_reads_and_the_policy_does_not():
    """2 simple_spread envs x 3 agents against two envs stepped by hand with the same seeds and
    actions, through an episode end (25 steps: the final observations carry the state the episode
    ended in) and the reset; then the agent: changing the state leaf changes V and no policy output,
    in torch and in the numpy acting plan."""
    from mpe2 import simple_spread_v3

    group = make_env_group(SPREAD, 6, 7)

    def check(buf, k, j, ref, own):
        np.testing.assert_array_equal(buf.obs.global_state[3 * k + j], ref.state())
        np.testing.assert_array_equal(buf.obs.observation[3 * k + j], own)

    def check_final(buf, k, ref):
        for j in range(3):
            np.testing.assert_array_equal(buf.final_obs.global_state[3 * k + j], ref.state())

    buf = step_beside_references(group, simple_spread_v3.parallel_env, check, check_final)
    rng = np.random.default_rng(1)
    group.close()

    agent = PgAgent(group.example_observation(), group.action_space, obs_space=group.observation_space)
    assert agent.pi_encoder.leaf_paths == ["agent_id", "observation"]
    assert agent.v_encoder.leaf_paths == ["agent_id", "global_state", "observation"]
    other = buf.obs._replace(global_state=rng.standard_normal(buf.obs.global_state.shape).astype(np.float32))
    action = torch.as_tensor(buf.actions)
    (logp, entropy, value), (logp2, entropy2, value2) = [agent.evaluate(torchify(o), action) for o in (buf.obs, other)]
    assert torch.equal(logp, logp2) and torch.equal(entropy, entropy2) and not torch.allclose(value, value2)
    plan = acting_plan(agent)
    assert plan is not None and [p for p, _ in plan["inputs"]] == ["agent_id", "observation"]
    assert [p for p, _ in plan["value_inputs"]] == ["agent_id", "global_state", "observation"]
    fast = numpy_actor(plan, state_arrays(agent), None, np.random.default_rng(0))
    (_, info), (_, info2) = [fast.step(o, EVALUATE) for o in (buf.obs, other)]
    np.testing.assert_array_equal(info.log_prob, info2.log_prob)
    np.testing.assert_allclose(info.value, value.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(info2.value, value2.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides, mentions", [
    (["env.id='pettingzoo:tests.pettingzoo_for_tests'", "env.kwargs=''", "sampler.envs=4"], "gives no global state"),
    (["env.id='pettingzoo:pettingzoo.classic.tictactoe_v3'", "env.kwargs=''", "sampler.envs=4"], "gives no global state"),
    (["env.id='CartPole-v1'", "env.kwargs=''", "env.agent_id=false", "sampler.envs=4"], "single-agent env"),
    (["agent.shared_encoder=true"], "agent.shared_encoder"),
    (["model.encoder='tests.extending_for_tests:LayerNormEncoder'"], "model.encoder"),
])
def test_a_global_state_that_cannot_work_is_one_config_error_line(overrides, mentions):
    with pytest.raises(ConfigError) as e:
        loading.load(MAPPO, overrides)
    assert "global_state" in str(e.value) and mentions in str(e.value) and "\n" not in str(e.value), e.value


def test_a_global_state_for_an_agent_without_a_value_network_is_one_config_error_line():
    with pytest.raises(ConfigError) as e:
        loading.load(CONFIGS / "cartpole_dqn.toml", [f"env.id='{SPREAD.id}'", "env.global_state=true",
                                                     "sampler.envs=3"])
    assert "env.global_state" in str(e.value) and "no value network" in str(e.value) and "\n" not in str(e.value)


def test_mappo_trains_in_serial_mode_and_its_policy_acts_and_exports_without_the_state(tmp_path):
    exp = loading.load(MAPPO, [f"run.runs_dir='{tmp_path}'", "run.max_env_steps=600", "sampler.envs=6",
                               "algo.epochs=2"])
    result = api.train_serial(exp, out=io.StringIO())
    assert result["reason"] == "budget" and result["updates"] >= 4 and result["skipped_updates"] == 0, result
    run_dir = Path(result["run_dir"])
    acc = event_accumulator.EventAccumulator(str(run_dir / TB_DIR))
    acc.Reload()
    losses = {t: [e.value for e in acc.Scalars(f"algo/{t}")] for t in ("policy_loss", "value_loss", "entropy")}
    assert all(v and np.isfinite(v).all() for v in losses.values()), losses

    agent, _ = load_agent(exp, run_dir)
    assert np.isfinite(play(exp, agent, episodes=3, envs=3).returns).all()  # rlpipe evaluate's episodes
    probe = make_env_group(exp.env, 3, 0)
    buf = Buffers(probe)
    probe.reset(buf.obs)
    probe.close()
    policy = GreedyPolicy(agent, probe.example_observation())
    assert policy.signature.inputs == ("agent_id", "observation") and policy.signature.outputs == ("action",)
    (action,) = policy(torch.as_tensor(buf.obs.agent_id), torch.as_tensor(buf.obs.observation))
    expected, _ = agent.step(torchify(buf.obs), EVALUATE)
    assert torch.equal(action, expected)
    assert [tuple(x.shape) for x in example_inputs(policy)] == [(3, 3), (3, 18)]
