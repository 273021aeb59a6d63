"""One acting step for rows that act with different copies of one agent: the same network, each
copy with its own parameters (a self-play opponent's past versions, ``services.sampler.opponent``).

A forward pass a copy pays every kernel launch of the network once a copy, each on a few rows:
on the CPU that is most of a small network's cost. Here the copies' states are stacked
(``torch.func.stack_module_state``), the agent's ``acting_outputs`` runs once, vmapped over the
copies (``torch.func.vmap``: a linear layer becomes one batched matmul, a convolution one
grouped convolution), each copy on its own rows padded to as many as the copy with the most
has, and the agent's ``choose`` then picks every row's action in one go. A copy that no row
acts with runs too: taking it out of the stack would copy the other copies' weights every
step, which costs more than its pass. A row's outputs are its own copy's, to float rounding
(the batched kernels add up in another order than one copy's); its action draws its noise from
torch's generator as one copy's ``step`` does, in another order.

Only agents that keep nothing between steps and draw nothing in their forward pass can be
stacked (``stackable``): a recurrent agent's memory of its envs is its own copy's, and IQN
draws its fractions in the pass. Agents that act in numpy (``shared.agents.acting``) keep one
pass a copy: numpy's calls cost microseconds, and stacking would take them into torch.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from shared.agents import StepContext
from shared.agents import groups
from shared.agents.actor import Actor
from shared.data.namedarraytuple import map_leaves, numpify, torchify


def stackable(agent) -> bool:
    """Whether copies of ``agent`` can act stacked: it has ``acting_outputs`` and ``choose``, keeps
    no state between steps (not recurrent) and draws nothing in its forward pass (not IQN)."""
    return hasattr(agent, "acting_outputs") and hasattr(agent, "choose") and not getattr(agent, "recurrent", False) \
        and getattr(agent, "tau_embedding", None) is None


def stacked_actor(actor: Actor) -> StackedActor | None:
    """A ``StackedActor`` for copies of ``actor``'s agent, or None where they act in numpy or cannot be stacked."""
    return StackedActor() if actor.fast is None and stackable(actor.agent) else None


class _Outputs(nn.Module):
    """An agent's ``acting_outputs`` as a module's forward, for ``functional_call``."""

    def __init__(self, agent) -> None:
        super().__init__()
        self.agent = agent

    def forward(self, obs):
        return self.agent.acting_outputs(obs)


class StackedActor:
    """The acting step of rows each of which acts with one of a list of ``Actor``\\ s on copies of
    one ``stackable`` agent (one device). It holds the copies' states stacked, stacked again
    whenever the caller's ``key`` for what the copies hold changes."""

    def __init__(self) -> None:
        self.key = None
        self.model: _Outputs | None = None
        """The first copy's ``acting_outputs``, run with the stacked states in place of its own."""
        self.params: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}

    def __call__(self, actors: list[Actor], key, copy_of: np.ndarray, obs, env_index: np.ndarray, first: np.ndarray,
                 reward: np.ndarray, env_steps: int, envs_total: int):
        """As ``Actor.__call__`` (numpy in and out) for n rows, row i acting with
        ``actors[copy_of[i]]``. ``key``: equal between two calls only while every copy holds the
        same parameters (the versions the copies hold)."""
        counts = np.bincount(copy_of, minlength=len(actors))
        if np.count_nonzero(counts) == 1:
            return actors[copy_of[0]](obs, env_index, first, reward, env_steps, envs_total)
        agent = actors[0].agent
        ctx = StepContext(env_index=env_index, first=first, reward=reward, env_steps=env_steps, envs_total=envs_total)
        src, back = _padded_rows(copy_of, counts)
        with torch.inference_mode():
            if key != self.key:
                modules = [_Outputs(actor.agent) for actor in actors]
                self.params, self.buffers = stack_module_state(modules)
                self.model, self.key = modules[0], key
            obs = map_leaves(lambda x: x.to(agent.device), torchify(obs))
            rows = torch.from_numpy(src).to(agent.device)
            padded = map_leaves(lambda x: x[rows], obs)  # [copies, most rows, ...]
            # by_group's split reads each group's row count back: under vmap shapes stay fixed.
            with groups.split_min_rows(math.inf):
                outs = vmap(lambda p, b, x: functional_call(self.model, (p, b), (x,)))(self.params, self.buffers,
                                                                                       padded)
            at = torch.from_numpy(back).to(agent.device)
            action, info = agent.choose(tuple(out.flatten(0, 1)[at] for out in outs), obs, ctx)
        return numpify(action), numpify(info)


def _padded_rows(copy_of: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows [n] acting with copies ``copy_of``, each copy's ``counts`` of them: ``src`` int64
    [copies, most rows], the rows each copy runs (its own in order, its last again to fill; a copy
    without rows runs another's, whose outputs are not read), and ``back`` int64 [n], where each
    row's outputs are in that grid flattened."""
    n, most = len(copy_of), int(counts.max())
    order = np.argsort(copy_of, kind="stable")
    starts = np.cumsum(counts) - counts
    j = np.minimum(np.arange(most), np.maximum(counts, 1)[:, None] - 1)
    src = order[np.minimum(starts[:, None] + j, n - 1)]
    k = copy_of[order]
    back = np.empty(n, np.int64)
    back[order] = k * most + np.arange(n) - starts[k]
    return src, back
