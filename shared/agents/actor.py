"""One agent step for a batch of observations: the same in the action-server, in
local-inference samplers that act in torch and in serial mode; and the acting plan of the
agents that can act in numpy (``shared.agents.acting``)."""

from __future__ import annotations

import numpy as np
import torch

from shared.agents.acting import numpy_actor
from shared.agents import StepContext
from shared.agents.pg import PgAgent
from shared.agents.q import QAgent
from shared.agents.models import MLP, Encoder, EnsembleMLP
from shared.data.namedarraytuple import numpify, torchify
from shared.envs.pettingzoo_backend import GROUP_KEY
from shared.transport.params import field_name

_ACTIVATION_NAMES = {torch.tanh: "tanh", torch.relu: "relu", None: None}


def seed_torch(seed: np.random.SeedSequence) -> None:
    """Seed the process's torch generator, which the torch acting path draws from."""
    torch.manual_seed(int(seed.generate_state(1)[0]))


def acting_plan(agent, fields: dict[int, str] | None = None) -> dict | None:
    """The numpy acting plan of ``agent`` (``shared.agents.acting``), or None where it must act in torch
    (on the CPU, that is: the plan says nothing of the device ``agent`` is on). ``fields``: the
    parameter-segment field of each of its tensors by ``id``, where ``agent`` is a member of the
    agent whose segment it is (``env.groups``); None: ``agent``'s own."""
    if getattr(agent, "recurrent", False) or getattr(agent, "tau_embedding", None) is not None:
        return None  # recurrent (with groups too), or IQN's sampled fractions (shared.agents.acting's docstring)
    if fields is None:
        fields = {id(t): field_name(k) for k, t in agent.state_dict(keep_vars=True).items()}
    if getattr(agent, "members", None) is not None:  # agent groups: each member's plan, rows routed by group
        members = [acting_plan(member, fields) for member in agent.members]
        return None if None in members else {"family": "groups", "group": GROUP_KEY, "members": members}

    def layers(mlp: MLP) -> list | None:
        if any(fn not in _ACTIVATION_NAMES for _, fn in mlp.plan) or any(n is not None for n in mlp.norms) or \
                any(n is not None for n in mlp.pre_norms):
            return None  # the plan format has no LayerNorm and no batch renorm
        return [(fields[id(linear.weight)], fields[id(linear.bias)], _ACTIVATION_NAMES[fn]) for linear, fn in mlp.plan]

    def member(twin: EnsembleMLP, m: int) -> list | None:
        if twin.fn not in _ACTIVATION_NAMES:
            return None
        last = len(twin.weights) - 1
        return [(fields[id(w)], fields[id(b)], None if k == last else _ACTIVATION_NAMES[twin.fn], m)
                for k, (w, b) in enumerate(zip(twin.weights, twin.biases))]

    def trunk(encoder: Encoder | None) -> list | None:
        flat = isinstance(encoder, Encoder) and (encoder.vector_only or encoder.flat_inputs() is not None)
        return layers(encoder.trunk) if flat else None

    norm = agent.obs_norm
    encoder = agent.encoder if isinstance(agent, QAgent) else getattr(agent, "pi_encoder", None)
    inputs = None if not isinstance(encoder, Encoder) or encoder.vector_only else encoder.flat_inputs()
    plan = {"norm": None if norm is None else
            {"mean": fields[id(norm.mean)], "var": fields[id(norm.var)], "clip": float(norm.clip)},
            "inputs": inputs and [list(i) for i in inputs], "mask": getattr(agent, "mask_path", None)}
    if isinstance(agent, PgAgent):
        plan.update(family="pg", trunks=[trunk(agent.pi_encoder)] + ([] if agent.v_encoder is None else
                                                                     [trunk(agent.v_encoder)]), kind=agent.kind)
        if agent.value_only:  # a centralised value reads leaves the policy does not
            value_inputs = agent.v_encoder.flat_inputs() if isinstance(agent.v_encoder, Encoder) else None
            if value_inputs is None:
                return None
            plan.update(value_inputs=[list(i) for i in value_inputs])
        if agent.twin is None:
            plan.update(pi_head=layers(agent.pi_head), v_head=layers(agent.v_head))
        else:
            plan.update(pi_head=member(agent.twin, 0), v_head=member(agent.twin, 1))
        box = agent.kind == "box"
        plan.update(nvec=[] if box else agent.nvec, action_shape=list(agent.action_shape) if box else [],
                    log_std=fields[id(agent.log_std)] if box else None)
        needed = [*plan["trunks"], plan["pi_head"], plan["v_head"]]
    elif isinstance(agent, QAgent):
        plan.update(family="q", trunks=[trunk(agent.encoder)], advantage=layers(agent.advantage),
                    value=None if agent.value is None else layers(agent.value), n_actions=agent.n_actions,
                    n_atoms=agent.n_atoms, support=None if agent.support is None else fields[id(agent.support)])
        needed = [*plan["trunks"], plan["advantage"]] + ([] if agent.value is None else [plan["value"]])
    else:
        return None
    return None if None in needed else plan


def state_arrays(agent) -> dict[str, np.ndarray]:
    """Numpy views of a CPU agent's state_dict tensors, by parameter-segment field."""
    return {field_name(k): t.numpy() for k, t in agent.state_dict().items()}


class Actor:
    """``agent``'s acting step on numpy observations: in numpy for the agents with an acting
    plan (on the CPU), drawing from a generator seeded with ``seed``, else in torch (from
    torch's generator)."""

    def __init__(self, agent, seed: np.random.SeedSequence) -> None:
        self.agent = agent
        plan = acting_plan(agent) if agent.device.type == "cpu" else None
        self.fast = None if plan is None else \
            numpy_actor(plan, state_arrays(agent), getattr(agent, "cfg", None), np.random.default_rng(seed))

    def __call__(self, obs, env_index: np.ndarray, first: np.ndarray, reward: np.ndarray, env_steps: int,
                 envs_total: int):
        """As ``NumpyActor.__call__``, numpy in and out."""
        if self.fast is not None:
            return self.fast(obs, env_index, first, reward, env_steps, envs_total)
        ctx = StepContext(env_index=env_index, first=first, reward=reward, env_steps=env_steps, envs_total=envs_total)
        with torch.inference_mode():  # cheaper than no_grad; nothing here is ever differentiated
            action, info = self.agent.step(torchify(obs), ctx)
        return numpify(action), numpify(info)
