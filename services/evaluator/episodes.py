"""Greedy episodes on held-out env seeds: the loop `rlpipe evaluate` and the evaluator service share.

Every agent acts for evaluation (``EVALUATE``): policy-gradient agents with the mode of
their policy, Q agents epsilon-greedily with ``agent.eps_eval`` from the config, Q-policy-
gradient agents with the actor's mean action. Episode returns are the true game scores (EnvGroup's
tracker sits below reward clipping and episodic life). The envs are seeded from
``run.seed + eval.seed_offset`` and made afresh for each evaluation, so every evaluation of a
run plays the same start states.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Callable, NamedTuple

import gymnasium as gym
import numpy as np
import torch

from services.learner.checkpoints import Checkpoints, Unloadable  # noqa: F401 (load_agent raises it)
from shared.runtime.runfiles import CHECKPOINT
from shared.agents import EVALUATE
from shared.config.schema import Experiment
from shared.config.topology import topology
from shared.envs.backends import columns_per_env, make_env_group
from shared.envs.group import EnvGroup, EpisodeTracker, make_env
from shared.envs.pettingzoo_backend import GROUP_KEY
from services.build import env_probe, make_agent, step_buffers
from shared.data.namedarraytuple import numpify, torchify
from shared.runtime import heartbeat
from services.evaluator import matches

MakeEnv = Callable[..., tuple[gym.Env, EpisodeTracker]]


class CannotRender(ValueError):
    """The env cannot render RGB frames, so no video can be recorded of it."""


class Episodes(NamedTuple):
    """Greedy episodes' returns [n] (float64) and, in an env with agent groups (``env.groups``),
    the group index of each episode's agent [n] (None without groups)."""

    returns: np.ndarray
    group: np.ndarray | None


def play(exp: Experiment, agent: torch.nn.Module, episodes: int, envs: int, make: MakeEnv | None = None) -> Episodes:
    """``episodes`` greedy episodes of ``agent``, played in ``min(envs, episodes)`` envs side by
    side on the held-out seeds: on the run's env backend, or gymnasium envs built by ``make``
    when given."""
    per_env = columns_per_env(exp.env)  # a multi-agent env's agents each play an episode
    n = -(-max(1, min(envs, episodes)) // per_env) * per_env
    seed = topology(exp).eval_seed
    env_group = make_env_group(exp.env, n, seed) if make is None else EnvGroup(exp.env, n, seed, make=make)
    try:
        slot, final_obs, reward, terminated, truncated, first = step_buffers(exp, env_group, n)
        column_group = getattr(slot.observation, GROUP_KEY) if exp.env.groups else None  # fixed per column
        returns: list[float] = []
        groups: list[int] = []
        env_group.reset(slot.observation)
        while len(returns) < episodes:
            heartbeat.beat()
            with torch.inference_mode():
                action, _ = agent.step(torchify(slot.observation), replace(EVALUATE, first=first, reward=reward))
            slot.action[:] = numpify(action)
            ended = env_group.step(slot.action, slot.observation, reward, terminated, truncated, final_obs)
            np.logical_or(terminated, truncated, out=first)
            for column, ret, _ in ended:
                returns.append(ret)
                if column_group is not None:
                    groups.append(int(column_group[column]))
    finally:
        env_group.close()
    return Episodes(np.array(returns[:episodes], np.float64),
                    None if column_group is None else np.array(groups[:episodes]))


def by_group(exp: Experiment, played: Episodes) -> dict:
    """``group_returns``: each agent group's mean return and episodes, in ``env.groups``' order
    (a group's agents may want opposite things, so the mean over all says little); {} without groups."""
    if played.group is None:
        return {}
    out = {}
    for k, name in enumerate(exp.env.groups):
        mine = played.returns[played.group == k]
        if len(mine):
            out[name] = {"mean_return": float(mine.mean()), "episodes": len(mine)}
    return {"group_returns": out}


def summary(returns: np.ndarray, policy_version: int, env_steps: int) -> dict:
    """The numbers an evaluation reports: episodes, mean, std, min and max return, and the
    policy version and the run's env steps it was measured at."""
    return {"episodes": len(returns), "mean_return": float(returns.mean()), "std_return": float(returns.std()),
            "min_return": float(returns.min()), "max_return": float(returns.max()),
            "policy_version": int(policy_version), "env_steps": int(env_steps)}


def match(exp: Experiment, agent: torch.nn.Module, opponent: str, episodes: int, policy_version: int,
          env_steps: int, rival: torch.nn.Module | None = None, tactics: bool = False) -> dict:
    """``episodes`` greedy games of ``agent`` against ``opponent`` (``matches.OPPONENTS``, or the
    name of another run whose agent is ``rival``; a two-player turn-based game), half of them
    (rounded up) in each seat: the ``summary`` of the policy seat's returns, the ``opponent`` and
    its ``matches.rates`` per seat; with ``tactics`` its missed wins and blocks per seat too
    (``matches.tactic_counts``)."""
    games = matches.play_games(exp, agent, opponent if rival is None else rival, -(-episodes // 2), env_steps,
                               tactics)
    counts = {} if games.tactics is None else matches.tactic_counts(games.tactics)
    return {**summary(np.concatenate([games.first, games.second]), policy_version, env_steps), "opponent": opponent,
            **matches.rates(games.first, games.second), **counts}


def recording(directory: Path) -> MakeEnv:
    """A ``make`` for ``play`` that records the first episode of its env as an mp4 in ``directory``.

    Raises CannotRender (one line) for an env that cannot render RGB frames."""

    def make(cfg) -> tuple[gym.Env, EpisodeTracker]:
        try:
            env, tracker = make_env(cfg, render_mode="rgb_array")
        except TypeError as e:
            if "render_mode" not in str(e):
                raise
            raise CannotRender(f"env {cfg.id} cannot render (its constructor takes no render_mode): "
                               "no video can be recorded") from None
        if env.render_mode != "rgb_array":
            env.close()
            modes = env.metadata.get("render_modes", [])
            raise CannotRender(f"env {cfg.id} cannot render RGB frames (render modes: {', '.join(modes) or 'none'}): "
                               "no video can be recorded")
        return gym.wrappers.RecordVideo(env, str(directory), episode_trigger=lambda episode: episode == 0,
                                        name_prefix="eval", disable_logger=True), tracker

    return make


def record_episode(exp: Experiment, agent: torch.nn.Module, path: Path) -> float:
    """Play one greedy episode (the first held-out seed) on gymnasium's env and record it to
    ``path`` (an mp4); its return. CannotRender for an env without RGB frames."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        folder = Path(tmp) / "video"  # one RecordVideo makes (it warns of one that exists)
        (ret,) = play(on_gymnasium(exp), agent, 1, 1, recording(folder)).returns
        (recorded,) = folder.glob("*.mp4")
        os.replace(recorded, path)  # whole or not at all, for W&B's reader in the learner
    return float(ret)


def load_agent(exp: Experiment, run_dir: Path) -> tuple[torch.nn.Module, dict]:
    """The run's agent on the CPU in eval mode with its latest checkpoint loaded, or the previous
    one where the latest cannot be (as the learner resumes: ``Checkpoints.load``), and that
    checkpoint's state (``agent``, ``version``, ``env_steps``, ...). FileNotFoundError (one
    line) where the learner has written none yet; Unloadable naming both files where neither loads."""
    probe = env_probe(exp)
    agent = make_agent(exp, probe)
    probe.close()
    loaded = []

    def apply(state: dict) -> None:
        agent.load_state_dict(state["agent"])
        loaded.append(state)

    if Checkpoints(Path(run_dir)).load(torch.device("cpu"), apply) is None:
        raise FileNotFoundError(f"no checkpoint at {Path(run_dir) / CHECKPOINT}: the learner writes one every "
                                f"{exp.learner.checkpoint_interval_s:g} s")
    return agent.eval(), loaded[-1]


def evaluate(exp: Experiment, run_dir: Path, episodes: int, video: Path | None = None,
             opponent: str | None = None, rival: tuple[Experiment, Path] | None = None,
             tactics: bool = False) -> dict:
    """``summary`` of ``episodes`` greedy episodes of the run's latest checkpoint; with
    ``video`` they are played in one env and the first one is recorded there. With an
    ``opponent`` they are games against it (``match``); with ``rival`` (another run's config and
    directory, checked by ``matches.check_opponent``) against that run's latest checkpoint, recorded with the
    ``opponent`` its directory's name, its ``opponent_version`` and ``opponent_env_steps``; ``tactics``:
    the games' missed wins and blocks too (``match``).
    ValueError (one line naming ``--opponent``) where the rival run has no checkpoint to load."""
    torch.set_num_threads(1)
    agent, state = load_agent(exp, run_dir)
    if rival is not None:
        try:
            other, theirs = load_agent(*rival)
        except (FileNotFoundError, Unloadable) as e:
            raise ValueError(f"--opponent {rival[1].name}: {e}") from e
        return {**match(exp, agent, rival[1].name, episodes, state["version"], state["env_steps"], other.eval(),
                        tactics),
                "opponent_version": int(theirs["version"]), "opponent_env_steps": int(theirs["env_steps"])}
    if opponent is not None:
        return match(exp, agent, opponent, episodes, state["version"], state["env_steps"], tactics=tactics)
    if video is None:
        played = play(exp, agent, episodes, exp.eval.envs)
    else:
        played = play(on_gymnasium(exp), agent, episodes, 1, recording(Path(video)))
    return {**summary(played.returns, state["version"], state["env_steps"]), **by_group(exp, played)}


def on_gymnasium(exp: Experiment) -> Experiment:
    """``exp`` on gymnasium's env, for videos: frames come from there (EnvPool renders none), and
    the policy plays the same task."""
    return replace(exp, env=replace(exp.env, backend="gymnasium", threads=0))
