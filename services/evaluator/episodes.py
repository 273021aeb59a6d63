"""Greedy evaluation of a run's latest checkpoint on held-out env seeds (in one process).

Every agent acts for evaluation (``EVALUATE``): policy-gradient agents with the mode of
their policy, Q agents epsilon-greedily with ``agent.eps_eval`` from the config, Q-policy-
gradient agents with the actor's mean action. Episode returns are the true game scores (EnvGroup's
tracker sits below reward clipping and episodic life).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from services.learner.learner import CHECKPOINT
from shared.agents import EVALUATE
from shared.config import Experiment
from shared.envs import EnvGroup
from shared.factory import env_probe, example_step, make_agent
from shared.layout import slot_spec
from shared.namedarraytuple import from_spec, numpify, torchify

HELD_OUT_SEED = 1_000_003  # far from the seeds samplers use (seed + 10007 * instance + env)


def evaluate(exp: Experiment, run_dir: Path, episodes: int = 10, envs: int = 8) -> dict:
    """Mean, std, min and max return of ``episodes`` greedy episodes of the latest checkpoint."""
    torch.set_num_threads(1)
    path = Path(run_dir) / CHECKPOINT
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: the learner writes one every "
                                f"{exp.learner.checkpoint_interval_s:g} s")
    probe = env_probe(exp)
    agent = make_agent(exp, probe)
    state = torch.load(path, map_location="cpu", weights_only=True)
    agent.load_state_dict(state["agent"])
    agent.eval()
    example = example_step(exp, probe)
    probe.close()
    n = max(1, min(envs, episodes))
    group = EnvGroup(exp.env, n, exp.run.seed + HELD_OUT_SEED)
    slot = from_spec(slot_spec(example, n))
    final_obs = from_spec(slot_spec(example, n)).observation  # written on episode ends, not read
    reward, terminated, truncated = np.zeros(n, np.float32), np.zeros(n, bool), np.zeros(n, bool)
    returns: list[float] = []
    group.reset(slot.observation)
    first = np.ones(n, bool)  # per-env state (recurrent agents) resets at each episode start
    try:
        while len(returns) < episodes:
            with torch.no_grad():
                action, _ = agent.step(torchify(slot.observation), replace(EVALUATE, first=first, reward=reward))
            slot.action[:] = numpify(action)
            ended = group.step(slot.action, slot.observation, reward, terminated, truncated, final_obs)
            np.logical_or(terminated, truncated, out=first)
            returns.extend(ret for _, ret, _ in ended)
    finally:
        group.close()
    r = np.array(returns[:episodes])
    return {"episodes": len(r), "mean_return": float(r.mean()), "std_return": float(r.std()),
            "min_return": float(r.min()), "max_return": float(r.max()), "policy_version": state["version"],
            "env_steps": state["env_steps"]}
