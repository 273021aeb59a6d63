"""`rlpipe export`: the exported greedy policy acts as the agent in rlpipe does.

Each family's agent is built as the learner builds it, its weights moved off their
initialisation (a fresh policy head's logits are near-ties, where float rounding alone could
flip an argmax) and written by the learner's checkpoint writer into a run directory. Its export
in every format (ONNX run by onnxruntime, the others loaded back) then plays the same greedy
actions and values as the agent's own ``step`` on >= 500 observations from the env: PPO and
DQN on CartPole, SAC on Pendulum with a non-trivial observation normaliser, CrossQ with its
actor's and critics' batch renorm statistics moved off their start, recurrent PPO
step by step over 50-step episodes with its state fed back, PPO on a Dict observation
whose leaves are named inputs, and PPO and DQN with an action mask among their inputs.
"""

from __future__ import annotations

import json
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import numpy as np
import onnxruntime as ort
import pytest
import torch

from services.build import env_probe, make_agent
from services.learner.checkpoints import Checkpoints
from shared.agents import EVALUATE
from shared.agents.models import BatchRenorm
from shared.config import loading
from shared.envs.group import make_env
from shared.launch.artefacts import export
from shared.runtime.runfiles import RUN_CONFIG
from tests.pipeline import rlpipe_here

CONFIGS = Path(__file__).resolve().parents[1] / "deploy" / "configs"
OBSERVATIONS = 500


def config(name: str, **sections) -> dict:
    """A shipped config as a dict, with ``sections``' keys set over it."""
    cfg = tomllib.loads((CONFIGS / name).read_text())
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def checkpointed_run(run_dir: Path, cfg: dict, seed: int = 0) -> Path:
    """``run_dir`` holding ``cfg``'s resolved config and a checkpoint (through the learner's
    writer) of its agent with every parameter moved by N(0, 0.3) noise."""
    exp = loading.from_dict(cfg)
    run_dir.mkdir(parents=True)
    (run_dir / RUN_CONFIG).write_text(loading.dumps(exp))
    probe = env_probe(exp)
    agent = make_agent(exp, probe)
    probe.close()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in agent.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
        for norm in agent.modules():  # batch renorm (CrossQ) as after training: the export must use these
            if isinstance(norm, BatchRenorm):
                norm.running_mean.copy_(0.5 * torch.randn(norm.running_mean.shape, generator=gen))
                norm.running_var.copy_(0.3 + torch.rand(norm.running_var.shape, generator=gen))
        norm = getattr(agent, "obs_norm", None)
        if norm is not None:  # as if the run had seen observations: the export must fold these in
            norm.mean.copy_(torch.linspace(-0.5, 0.5, norm.mean.numel()).reshape(norm.mean.shape))
            norm.var.copy_(torch.linspace(0.2, 3.0, norm.var.numel()).reshape(norm.var.shape))
            norm.count.fill_(1000.0)
    Checkpoints(run_dir).save({"agent": agent.state_dict(), "version": 7, "env_steps": 4321})
    return run_dir


def runners(run_dir: Path, out: Path) -> dict:
    """format -> fn(list of numpy inputs) -> list of numpy outputs, each format exported to ``out``
    and loaded back as a user would: ONNX in onnxruntime, the others with torch."""
    found = {}
    for fmt in export.FORMATS:
        path = export.export(run_dir, fmt, out / fmt)
        if fmt == "onnx":
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            names = [i.name for i in session.get_inputs()]
            found[fmt] = lambda xs, s=session, n=names: s.run(None, dict(zip(n, xs)))
            continue
        module = torch.jit.load(str(path)) if fmt == "torchscript" else torch.export.load(str(path)).module()
        found[fmt] = lambda xs, m=module: _no_grad_numpy(m, xs)
    return found


@torch.no_grad()
def _no_grad_numpy(module, xs: list) -> list:
    return [t.numpy() for t in module(*(torch.as_tensor(x) for x in xs))]


def env_observations(exp, n: int = OBSERVATIONS) -> list:
    """``n`` observations of the run's env (numpy, as the agent gets them) under random actions."""
    env, _ = make_env(exp.env)
    env.action_space.seed(0)
    obs, _ = env.reset(seed=0)
    seen = []
    while len(seen) < n:
        seen.append(obs)
        obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            obs, _ = env.reset()
    env.close()
    return seen


def loaded(run_dir: Path):
    exp = loading.load(run_dir / RUN_CONFIG)
    agent, _ = export.load_agent(exp, run_dir)
    return exp, agent


FEED_FORWARD = {
    "ppo": (config("cartpole_ppo.toml"), "value"),
    "dqn": (config("cartpole_dqn.toml", agent={"eps_eval": 0.0}), "q_values"),
    "sac": (config("pendulum_sac.toml", model={"normalize_observations": True}), "q"),
    "crossq": (config("pendulum_crossq.toml", algo={"critic_hidden_sizes": [64, 64]}), "q"),  # actor batch renorm
}


@pytest.mark.parametrize("family", list(FEED_FORWARD))
def test_a_feed_forward_export_acts_as_the_agent(tmp_path, family):
    cfg, head = FEED_FORWARD[family]
    run_dir = checkpointed_run(tmp_path / "run", cfg)
    exp, agent = loaded(run_dir)
    obs = np.stack(env_observations(exp)).astype(np.float32)
    with torch.inference_mode():
        action, info = agent.step(torch.as_tensor(obs), EVALUATE)
        if family == "ppo":
            expected_head = info.value
        elif family == "dqn":
            expected_head = agent.q_values(torch.as_tensor(obs))
        else:  # Q_i(s, greedy action) of both critics, [B, 2]
            expected_head = agent.q(torch.as_tensor(obs), agent.to_unit(action)).T
    action, expected_head = action.numpy(), expected_head.numpy()
    if family not in ("sac", "crossq"):
        assert len(np.unique(action)) > 1  # both actions occur: a constant policy would prove little
    for fmt, run in runners(run_dir, tmp_path / "out").items():
        got_action, got_head = run([obs])
        if family in ("sac", "crossq"):
            np.testing.assert_allclose(got_action, action, atol=1e-5, err_msg=fmt)
        else:
            np.testing.assert_array_equal(got_action, action, err_msg=fmt)
        np.testing.assert_allclose(got_head, expected_head, rtol=1e-4, atol=1e-4, err_msg=fmt)
        meta = json.loads((tmp_path / "out" / fmt / export.METADATA).read_text())
        assert [o["name"] for o in meta["outputs"]] == ["action", head]
        assert meta["obs_normalised_inside"] == (family == "sac") and meta["env_steps"] == 4321


def test_the_sac_export_folds_the_observation_normaliser_in(tmp_path):
    """Against the agent without its normaliser, the export's actions differ: it is in the graph."""
    run_dir = checkpointed_run(tmp_path / "run", FEED_FORWARD["sac"][0])
    exp, agent = loaded(run_dir)
    obs = torch.as_tensor(np.stack(env_observations(exp, 50)))
    run = runners(run_dir, tmp_path / "out")["onnx"]
    with torch.inference_mode():
        with_norm = agent.step(obs, EVALUATE)[0].numpy()
        agent.obs_norm = None
        without = agent.step(obs, EVALUATE)[0].numpy()
    got = run([obs.numpy()])[0]
    np.testing.assert_allclose(got, with_norm, atol=1e-5)
    assert np.abs(got - without).max() > 1e-2


def balancing_episodes(exp, episodes: int, steps: int):
    """``episodes`` CartPole episodes of ``steps`` steps each, the cart driven by a PD rule on
    its full state (the agent only watches, so that every episode lasts ``steps``): yields
    (observation, reward that led to it, first of its episode)."""
    env, _ = make_env(replace(exp.env, max_episode_steps=steps))
    for episode in range(episodes):
        obs, _ = env.reset(seed=episode)
        reward, first = 0.0, True
        for _ in range(steps):
            yield obs, reward, first
            _, _, theta, theta_dot = env.unwrapped.state
            obs, reward, terminated, truncated, _ = env.step(int(theta + 0.5 * theta_dot > 0))
            first = False
            assert not terminated
    env.close()


def test_a_recurrent_export_carries_its_state_as_inputs_and_outputs(tmp_path):
    """Recurrent PPO on CartPole without velocities (normalised observations, the previous
    action as an LSTM input): 10 episodes of 50 steps, one step at a time, the exported
    policy fed back its own ``h_out``, ``c_out`` and action, zeroed at each episode start."""
    run_dir = checkpointed_run(tmp_path / "run", config("cartpole_novel_ppo_lstm.toml"))
    exp, agent = loaded(run_dir)
    steps = list(balancing_episodes(exp, episodes=10, steps=50))
    assert len(steps) == OBSERVATIONS
    expected = []
    with torch.inference_mode():
        for obs, reward, first in steps:
            ctx = replace(EVALUATE, first=np.array([first]), reward=np.array([reward], np.float32))
            action, info = agent.step(torch.as_tensor(obs[None]), ctx)
            expected.append((int(action[0]), float(info.value[0])))
    actions = np.array([a for a, _ in expected])
    assert 0.1 < actions.mean() < 0.9
    for fmt, run in runners(run_dir, tmp_path / "out").items():
        meta = json.loads((tmp_path / "out" / fmt / export.METADATA).read_text())
        assert [i["name"] for i in meta["inputs"]] == ["obs", "h", "c", "prev_action"]
        assert [o["name"] for o in meta["outputs"]] == ["action", "value", "h_out", "c_out"]
        cores = meta["inputs"][1]["shape"][1]  # 2: the policy's and the value's LSTM
        assert meta["inputs"][1]["shape"] == ["B", cores, exp.model.lstm_size] and cores == 2
        h = c = np.zeros((1, cores, exp.model.lstm_size), np.float32)
        prev = np.zeros(1, np.int64)
        got = []
        for obs, _, first in steps:
            if first:
                h, c, prev = np.zeros_like(h), np.zeros_like(c), np.zeros_like(prev)
            action, value, h, c = run([obs[None].astype(np.float32), h, c, prev])
            prev = action
            got.append((int(action[0]), float(value[0])))
        np.testing.assert_array_equal([a for a, _ in got], actions, err_msg=fmt)
        np.testing.assert_allclose([v for _, v in got], [v for _, v in expected], atol=1e-4, err_msg=fmt)


def dict_export(tmp_path: Path, cfg: dict, n: int):
    """A Dict-observation run's ONNX session, ``n`` env observations as its inputs {key: [n, ...]},
    and the agent's greedy step on them (action, info)."""
    run_dir = checkpointed_run(tmp_path / "run", cfg)
    exp, agent = loaded(run_dir)
    observations = env_observations(exp, n)
    batch = {k: np.stack([o[k] for o in observations]) for k in observations[0]}
    probe = env_probe(exp)
    tree = type(probe.example_observation())(**batch)
    probe.close()
    with torch.inference_mode():
        action, info = agent.step(tree, EVALUATE)
    path = export.export(run_dir, "onnx", tmp_path / "out")
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), batch, action, info


def test_each_leaf_of_a_dict_observation_is_a_named_input(tmp_path):
    session, batch, action, info = dict_export(tmp_path, {"env": {"id": "tests.envs_for_tests:make_image_cartpole"}},
                                               64)
    assert [(i.name, i.type) for i in session.get_inputs()] == [("image", "tensor(uint8)"), ("state", "tensor(float)")]
    got_action, got_value = session.run(None, batch)
    np.testing.assert_array_equal(got_action, action.numpy())
    np.testing.assert_allclose(got_value, info.value.numpy(), atol=1e-4)


@pytest.mark.parametrize("name", ["masked_choice_ppo.toml", "masked_choice_dqn.toml"])
def test_an_action_mask_is_an_input_and_the_export_plays_the_agents_legal_actions(tmp_path, name):
    """rlpipe/MaskedChoice-v0 (about half of the actions illegal at each step): the export's
    greedy actions are the agent's on 500 env observations, every one legal; with the mask
    input set to all ones they differ, so the mask is in the graph, not in the weights."""
    cfg = config(name, agent={"eps_eval": 0.0}) if "dqn" in name else config(name)
    session, batch, action, _ = dict_export(tmp_path, cfg, OBSERVATIONS)
    assert [(i.name, i.type) for i in session.get_inputs()] == [("action_mask", "tensor(int8)"), ("cue", "tensor(float)")]
    got = session.run(None, batch)[0]
    np.testing.assert_array_equal(got, action.numpy())
    assert batch["action_mask"].astype(bool)[np.arange(OBSERVATIONS), got].all()
    unmasked = session.run(None, {**batch, "action_mask": np.ones_like(batch["action_mask"])})[0]
    assert (unmasked != got).mean() > 0.1


# ------------------------------------------------------------------ bad input: one line each


def test_export_of_a_run_without_a_checkpoint_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / RUN_CONFIG).write_text(loading.dumps(loading.from_dict({})))
    out = rlpipe_here("export", str(run_dir))
    assert out.returncode == 2
    assert out.stderr.strip() == (f"rlpipe: export: no checkpoint at {run_dir / 'checkpoints/latest.pt'}: "
                                  "the learner writes one every 10 s")


def test_an_unknown_format_is_one_line(tmp_path):
    run_dir = checkpointed_run(tmp_path / "run", {})
    out = rlpipe_here("export", str(run_dir), "--format", "tflite")
    assert out.returncode == 2
    assert out.stderr.strip() == "rlpipe: export: --format tflite: unknown format; use one of onnx, torchscript, exported"


@pytest.mark.parametrize("missing", ["onnx", "onnxscript", "onnxruntime"])
def test_a_missing_package_names_the_extra_to_install(tmp_path, monkeypatch, missing):
    run_dir = checkpointed_run(tmp_path / "run", {})
    monkeypatch.setitem(sys.modules, missing, None)  # what `import` makes of a package that is not there
    out = rlpipe_here("export", str(run_dir), "--out", str(tmp_path / "x"))
    assert out.returncode == 2
    assert out.stderr.strip() == f"rlpipe: export: the {missing} package is not installed: pip install 'rlpipe[export]'"
    assert not (tmp_path / "x" / "policy.onnx").exists()


def test_rlpipe_export_writes_the_file_and_says_where(tmp_path):
    run_dir = checkpointed_run(tmp_path / "run", {})
    out = rlpipe_here("export", str(run_dir), "--format", "exported", "--out", str(tmp_path / "x"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "x" / "policy.pt2").exists() and (tmp_path / "x" / export.METADATA).exists()
    assert str(tmp_path / "x" / "policy.pt2") in out.stdout
