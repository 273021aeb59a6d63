"""The acting step of feed-forward MLP agents in numpy, torch-free: the samplers' hot path
without torch's per-call cost, and without torch in a local-inference sampler at all.

On a batch of 8-32 CartPole observations a 64x64 policy's arithmetic is tiny; torch's
dispatch, autograd bookkeeping and tensor wrapping around the dozen small ops of
``PgAgent.step`` cost several times the same step in numpy, and were most of a
local-inference sampler's time on a CPU. And every local sampler paid for ``import torch``
at start-up (docs/benchmarks.md, "Numpy acting and one BLAS thread" and "Start-up and stop").

A ``NumpyActor`` is built from an *acting plan* and the agent's state as numpy arrays keyed
by parameter-segment field (``shared.transport.params``). The plan is plain data (JSON): which
state entries (or which member of an ensemble's stacked entries) are the weights and
biases of which layer, the activations, the action
space's shape, where the observation statistics are. ``shared.agents.actor.acting_plan``
makes it from a torch agent, for the agents whose acting is a plain stack of linear layers
on one vector observation: ``PgAgent`` (categorical: Discrete, MultiDiscrete; diagonal
Gaussian: Box) and ``QAgent`` (scalar, C51 or QR-DQN head, plain or dueling), feed-forward,
with or without observation normalisation, on the CPU; on one vector or on a Dict of leaves
the encoder flattens as they are (no image, no one-hot leaf), with an action mask among
them or not (``shared.agents.masking``: the same masked picks as the torch agents). Every
other agent (recurrent, image or one-hot leaves, IQN, DDPG/TD3/SAC) has no plan and acts in torch. IQN's step is not a
stack of linear layers on the observation: it draws K fractions per row, embeds them with
cosines and multiplies them into the features, so its head runs on K rows per observation;
the plan format does not describe that, and IQN acts in torch. An agent with groups
(``env.groups``, ``shared.agents.groups``) has a plan of plans, one a group's member, and
``NumpyGroupsActor`` runs each member on its group's rows alone (numpy pays per row, not per call
as torch does, so the rows are split rather than every member run on all of them).

Where the torch agent is at hand (action-server, serial mode) the arrays are views of its
tensors, so versions loaded into the agent in place are the ones acted with. The learner
writes its plan and its parameter segment's layout to ``acting.json`` in the run
directory; a local-inference sampler reads it and follows versions into arrays of its own,
never importing torch. Exploration draws from the numpy generator the actor is given.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from shared.agents.config import AgentInfo, QAgentConfig, QAgentInfo
from shared.agents import HALF_LOG_2PI, StepContext
from shared.agents.masking import legal, masked, random_legal
from shared.data.namedarraytuple import leaves
from shared.runtime import runfiles

_ACTIVATIONS = {"tanh": lambda x: np.tanh(x, out=x), "relu": lambda x: np.maximum(x, 0.0, out=x), None: None}


def acting_seed(run_seed: int, service: str, instance: int) -> np.random.SeedSequence:
    """The seed of one actor's exploration noise (a local-inference sampler, an action-server,
    the self-play opponent seat of a sampler): distinct for every one, and apart from the envs' seeds."""
    return np.random.SeedSequence([run_seed, ("sampler", "action_server", "opponent").index(service), instance])


class _Mlp:
    """Linear layers [(weight field, bias field, activation or None[, member])] on the state
    arrays: an ``nn.Linear``'s weight [out, in] and bias [out], or with ``member`` m that
    member's slice of an ``EnsembleMLP`` layer, weight [n, in, out] and bias [n, 1, out];
    ``stacked``: every member of the ensemble at once, [N, in] -> [n, N, out]."""

    def __init__(self, layers: list, arrays: Mapping[str, np.ndarray], stacked: bool = False) -> None:
        # Views: a version loaded into the arrays in place is seen at once.
        def weights(w: str, b: str, member: list) -> tuple[np.ndarray, np.ndarray]:
            if stacked:
                return arrays[w], arrays[b]
            if member:
                return arrays[w][member[0]], arrays[b][member[0], 0]
            return arrays[w].T, arrays[b]

        self.layers = [(*weights(w, b, member), _ACTIVATIONS[fn]) for w, b, fn, *member in layers]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        for w, b, fn in self.layers:
            x = x @ w
            x += b
            if fn is not None:
                x = fn(x)
        return x


class NumpyActor:
    """``step(obs, ctx) -> (action, info)`` like the agent's, on numpy arrays [B, ...]."""

    def __init__(self, plan: dict, arrays: Mapping[str, np.ndarray], rng: np.random.Generator) -> None:
        self.rng = rng
        self.trunks = [_Mlp(layers, arrays) for layers in plan["trunks"]]
        norm = plan["norm"]
        self.norm = None if norm is None else (arrays[norm["mean"]], arrays[norm["var"]], float(norm["clip"]))
        self.inputs = plan.get("inputs")
        """(path, scale) of the observation's leaves, flattened and concatenated; None: one vector as is."""
        self.value_inputs = plan.get("value_inputs")
        """The value trunk's (the second's) own ``inputs`` (a centralised value reads leaves the
        policy does not, ``shared.agents.pg``), or None: every trunk reads ``inputs``."""
        self.mask = plan.get("mask")
        """The action mask's path in the observation (``shared.agents.masking``), or None."""

    def __call__(self, obs, env_index: np.ndarray, first: np.ndarray, reward: np.ndarray, env_steps: int,
                 envs_total: int):
        """Actions and agent info for observations [N, ...] of the envs ``env_index`` (global
        indices), ``first`` [N] marking the rows whose observation starts an episode, ``reward``
        [N] the reward that led to each observation; ``env_steps`` is the run's count at the
        parameters' version (exploration schedules)."""
        return self.step(obs, StepContext(env_index=env_index, first=first, reward=reward, env_steps=env_steps,
                                          envs_total=envs_total))

    def _features(self, obs) -> list[np.ndarray]:
        x = self._flat(obs, self.inputs)
        if self.value_inputs is None:
            return [trunk(x) for trunk in self.trunks]
        policy, value = self.trunks
        return [policy(x), value(self._flat(obs, self.value_inputs))]

    def _flat(self, obs, inputs: list | None) -> np.ndarray:
        """The trunk input [N, size] of observations [N, ...]: ``inputs``' leaves, normalised."""
        if inputs is None:
            x = np.asarray(obs, dtype=np.float32)
        else:  # as the torch Encoder's flattening parts: each leaf [N, ...] -> float32 [N, size], times its scale
            tree = dict(leaves(obs))
            flat = [tree[path].reshape(len(tree[path]), -1).astype(np.float32) * np.float32(scale)
                    for path, scale in inputs]
            x = np.concatenate(flat, axis=1) if len(flat) > 1 else flat[0]
        if self.norm is not None:
            mean, var, clip = self.norm
            x = np.clip((x - mean.astype(np.float32)) / np.sqrt(var.astype(np.float32) + 1e-8), -clip, clip)
        return x


class NumpyPgActor(NumpyActor):
    def __init__(self, plan: dict, arrays: Mapping[str, np.ndarray], rng: np.random.Generator) -> None:
        super().__init__(plan, arrays, rng)
        self.pi_head, self.v_head = _Mlp(plan["pi_head"], arrays), _Mlp(plan["v_head"], arrays)
        # Policy and value as members 0 and 1 of one ensemble (PgAgent's twin): both in one
        # batched matmul a layer, as in torch (docs/benchmarks.md, "Learner step").
        pi, v = plan["pi_head"], plan["v_head"]
        twin = len(self.trunks) == 1 and len(pi) == len(v) and all(
            len(a) == len(b) == 4 and a[:3] == b[:3] and (a[3], b[3]) == (0, 1) for a, b in zip(pi, v))
        self.twin = _Mlp(pi, arrays, stacked=True) if twin else None
        self.kind, self.nvec, self.action_shape = plan["kind"], plan["nvec"], tuple(plan["action_shape"])
        self.log_std = None if plan["log_std"] is None else arrays[plan["log_std"]]

    def step(self, obs: np.ndarray, ctx: StepContext) -> tuple[np.ndarray, AgentInfo]:
        features = self._features(obs)
        if self.twin is None:
            out, value = self.pi_head(features[0]), self.v_head(features[-1])[:, 0]
        else:
            out = self.twin(features[0])
            out, value = out[0], out[1, :, 0]
        if self.kind == "box":
            mean = out.reshape(-1, *self.action_shape)
            log_std = self.log_std.reshape(self.action_shape)
            noise = np.zeros_like(mean) if ctx.greedy else self.rng.standard_normal(mean.shape, dtype=np.float32)
            action = mean + noise * np.exp(log_std)
            log_prob = (-0.5 * noise * noise - log_std - HALF_LOG_2PI).reshape(len(mean), -1).sum(-1)
            return action, AgentInfo(log_prob=log_prob.astype(np.float32), value=value)
        out = masked(out, legal(obs, self.mask))
        picks, log_prob, start = [], np.zeros(len(out), np.float32), 0
        for n in self.nvec:
            logits = out[:, start:start + n]
            start += n
            # Gumbel-max, as PgAgent.step: argmax(logits + Gumbel noise) samples softmax(logits).
            pick = logits.argmax(-1) if ctx.greedy else \
                (logits - np.log(self.rng.standard_exponential(logits.shape, dtype=np.float32))).argmax(-1)
            top = logits.max(-1, keepdims=True)
            log_z = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
            log_prob += logits[np.arange(len(pick)), pick] - log_z
            picks.append(pick)
        action = picks[0] if self.kind == "discrete" else np.stack(picks, -1)
        return action.astype(np.int64), AgentInfo(log_prob=log_prob, value=value)


class NumpyQActor(NumpyActor):
    def __init__(self, plan: dict, arrays: Mapping[str, np.ndarray], rng: np.random.Generator,
                 cfg: QAgentConfig) -> None:
        super().__init__(plan, arrays, rng)
        self.cfg, self.n_actions, self.n_atoms = cfg, plan["n_actions"], plan["n_atoms"]
        self.advantage = _Mlp(plan["advantage"], arrays)
        self.value = None if plan["value"] is None else _Mlp(plan["value"], arrays)
        self.support = None if plan["support"] is None else arrays[plan["support"]]

    def step(self, obs: np.ndarray, ctx: StepContext) -> tuple[np.ndarray, QAgentInfo]:
        (features,) = self._features(obs)
        n = len(features)
        out = self.advantage(features).reshape(n, self.n_actions, self.n_atoms)
        if self.value is not None:
            out = self.value(features)[:, None, :] + out - out.mean(1, keepdims=True)
        if self.support is None:  # scalar Q (one atom) or QR-DQN's quantiles: their mean
            q = out.mean(-1)
        else:
            p = np.exp(out - out.max(-1, keepdims=True))
            q = (p * self.support).sum(-1) / p.sum(-1)
        eps = self.cfg.eps_eval if ctx.greedy else self.cfg.epsilon(ctx.env_steps, *ctx.rows(n))
        explore = self.rng.random(n) < eps
        ok = legal(obs, self.mask)
        random = self.rng.integers(self.n_actions, size=n) if ok is None else \
            random_legal(self.rng.random((n, self.n_actions)), ok)
        best = masked(q, ok, -np.inf)  # as QAgent._pick
        action = np.where(explore, random, best.argmax(-1))
        return action.astype(np.int64), QAgentInfo(value=best.max(-1).astype(np.float32))


class NumpyGroupsActor:
    """An agent with groups: ``step(obs, ctx) -> (action, info)`` with each row acted for by its
    group's member actor (the observation's ``plan["group"]`` leaf, the group's index)."""

    def __init__(self, plan: dict, arrays: Mapping[str, np.ndarray], agent_cfg, rng: np.random.Generator) -> None:
        self.group = plan["group"]
        self.members = [numpy_actor(member, arrays, agent_cfg, rng) for member in plan["members"]]

    __call__ = NumpyActor.__call__

    def step(self, obs, ctx: StepContext):
        group = np.asarray(getattr(obs, self.group))
        n = len(group)
        index, total = ctx.rows(n)
        action = info = None
        for k, member in enumerate(self.members):
            rows = np.flatnonzero(group == k)
            if not rows.size:
                continue
            mine = dataclasses.replace(ctx, env_index=index[rows], envs_total=total,
                                       first=None if ctx.first is None else ctx.first[rows],
                                       reward=None if ctx.reward is None else ctx.reward[rows])
            a, i = member.step(obs[rows], mine)
            if action is None:
                action = np.zeros((n, *a.shape[1:]), a.dtype)
                info = type(i)(*(np.zeros((n, *x.shape[1:]), x.dtype) for x in i))
            action[rows] = a
            info[rows] = i
        return action, info


def numpy_actor(plan: dict, arrays: Mapping[str, np.ndarray], agent_cfg, rng: np.random.Generator
                ) -> NumpyActor | NumpyGroupsActor:
    """The actor a plan describes, on ``arrays`` (field -> array); ``agent_cfg``: the run's
    agent config (a Q agent's exploration schedule)."""
    if plan.get("family") == "groups":
        if not isinstance(plan.get("group"), str) or not plan.get("members"):
            raise ValueError(f"acting plan: malformed (a groups plan needs a group path and member plans): "
                             f"{str(plan)[:200]}")
        return NumpyGroupsActor(plan, arrays, agent_cfg, rng)
    check_plan(plan, arrays)
    if plan["family"] == "pg":
        return NumpyPgActor(plan, arrays, rng)
    return NumpyQActor(plan, arrays, rng, agent_cfg)


def check_plan(plan, arrays: Mapping[str, np.ndarray]) -> None:
    """ValueError naming what is wrong, unless ``plan`` is a pg or q plan whose every layer,
    statistic and support names an entry of ``arrays`` and whose activations are known."""
    try:
        heads = {"pg": ("pi_head", "v_head"), "q": ("advantage", "value")}[plan["family"]]
        layers = [layer for group in [*plan["trunks"], *(plan[h] for h in heads)] if group for layer in group]
        fields = [f for w, b, *_ in layers for f in (w, b)] + [plan.get(k) for k in ("log_std", "support")]
        if plan["norm"] is not None:
            fields += [plan["norm"]["mean"], plan["norm"]["var"]]
        missing = [f for f in fields if f is not None and f not in arrays]
        bad = [fn for _, _, fn, *_ in layers if fn not in _ACTIVATIONS]
        members = [(w, m) for w, _, _, *m in layers if m and w in arrays]
        strays = [f"{w}[{m[0]}]" for w, m in members
                  if not (isinstance(m[0], int) and arrays[w].ndim == 3 and 0 <= m[0] < len(arrays[w]))]
        inputs, mask = (plan.get("inputs") or []) + (plan.get("value_inputs") or []), plan.get("mask")
        if not all(isinstance(path, str) and float(scale) > 0 for path, scale in inputs) or \
                not isinstance(mask, (str, type(None))):
            raise ValueError("inputs and value_inputs must be [path, scale > 0] pairs and mask a path or None")
        if plan.get("value_inputs") is not None and len(plan["trunks"]) != 2:
            raise ValueError("value_inputs need a policy trunk and a value trunk")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"acting plan: malformed ({type(e).__name__}: {e}): {str(plan)[:200]}") from None
    if missing or bad or strays:
        raise ValueError(f"acting plan: entries {missing} are not in the parameter state, activations {bad} "
                         f"unknown, ensemble members {strays} not in a stacked [n, in, out] entry")


def write_acting_file(run_dir: Path, spec, plan: dict | None) -> None:
    """The learner's: its parameter segment's layout and its acting plan (None: act in torch), atomically."""
    path = Path(run_dir) / runfiles.ACTING_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"spec": spec, "plan": plan}))
    os.replace(tmp, path)


def read_acting_file(run_dir: Path) -> dict | None:
    """``{"spec", "plan"}`` as the learner wrote it, or None while there is none."""
    try:
        return json.loads((Path(run_dir) / runfiles.ACTING_FILE).read_text())
    except FileNotFoundError:
        return None
