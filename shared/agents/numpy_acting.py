"""The acting step of feed-forward MLP agents in numpy: the samplers' hot path without torch's
per-call cost.

On a batch of 8-32 CartPole observations a 64x64 policy's arithmetic takes a few
microseconds; torch's dispatch, autograd bookkeeping and tensor wrapping around the dozen
small ops of ``PgAgent.step`` take ~300 µs a call on this machine's CPU, which was most of a
local-inference sampler's time. The same step in numpy takes ~70 µs.

``numpy_actor(agent)`` returns a ``NumpyActor`` for the agents whose acting is a plain
stack of linear layers on one vector observation: ``PgAgent`` (categorical: Discrete,
MultiDiscrete; diagonal Gaussian: Box) and ``QAgent`` (scalar or C51 head, plain or
dueling), feed-forward, with or without observation normalisation, on the CPU. For every
other agent (recurrent, image or dict observations, DDPG/TD3/SAC) it returns None and the
caller acts in torch. The actor holds numpy views of the agent's parameter and buffer
tensors: parameter versions are loaded into those tensors in place (``shared.params``), so
the views always see the version the agent holds. Exploration draws from the numpy
generator it is given.
"""

from __future__ import annotations

import numpy as np
import torch

from shared.agent_config import AgentInfo, QAgentInfo
from shared.agents import StepContext
from shared.agents.pg import _HALF_LOG_2PI, PgAgent
from shared.agents.q import QAgent
from shared.models import MLP, Encoder

_ACTIVATIONS = {torch.tanh: np.tanh, torch.relu: lambda x: np.maximum(x, 0.0, out=x)}


def _view(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


class _Mlp:
    """An ``MLP``'s layers as (weight.T view [in, out], bias view [out], activation or None)."""

    def __init__(self, mlp: MLP) -> None:
        self.layers = [(_view(linear.weight).T, _view(linear.bias), None if fn is None else _ACTIVATIONS[fn])
                       for linear, fn in mlp.plan]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        for w, b, fn in self.layers:
            x = x @ w
            x += b
            if fn is not None:
                x = fn(x)
        return x


def _trunk(encoder: Encoder | None) -> _Mlp | None:
    """The encoder's MLP trunk if it takes one vector leaf as is, else None."""
    if encoder is None or not encoder.vector_only or any(fn not in _ACTIVATIONS for _, fn in encoder.trunk.plan):
        return None
    return _Mlp(encoder.trunk)


class NumpyActor:
    """``step(obs, ctx) -> (action, info)`` like the agent's, on numpy arrays [B, ...]."""

    def __init__(self, agent, trunks: list[_Mlp], rng: np.random.Generator) -> None:
        self.agent, self.trunks, self.rng = agent, trunks, rng
        norm = agent.obs_norm
        self.norm = None if norm is None else (_view(norm.mean), _view(norm.var), float(norm.clip))

    def _features(self, obs: np.ndarray) -> list[np.ndarray]:
        x = np.asarray(obs, dtype=np.float32)
        if self.norm is not None:
            mean, var, clip = self.norm
            x = np.clip((x - mean.astype(np.float32)) / np.sqrt(var.astype(np.float32) + 1e-8), -clip, clip)
        return [trunk(x) for trunk in self.trunks]


class NumpyPgActor(NumpyActor):
    def __init__(self, agent: PgAgent, trunks: list[_Mlp], rng: np.random.Generator) -> None:
        super().__init__(agent, trunks, rng)
        self.pi_head, self.v_head = _Mlp(agent.pi_head), _Mlp(agent.v_head)
        self.log_std = _view(agent.log_std) if agent.kind == "box" else None

    def step(self, obs: np.ndarray, ctx: StepContext) -> tuple[np.ndarray, AgentInfo]:
        agent, features = self.agent, self._features(obs)
        out, value = self.pi_head(features[0]), self.v_head(features[-1])[:, 0]
        if agent.kind == "box":
            mean = out.reshape(-1, *agent.action_shape)
            log_std = self.log_std.reshape(agent.action_shape)
            noise = np.zeros_like(mean) if ctx.greedy else self.rng.standard_normal(mean.shape, dtype=np.float32)
            action = mean + noise * np.exp(log_std)
            log_prob = (-0.5 * noise * noise - log_std - _HALF_LOG_2PI).reshape(len(mean), -1).sum(-1)
            return action, AgentInfo(log_prob=log_prob.astype(np.float32), value=value)
        picks, log_prob, start = [], np.zeros(len(out), np.float32), 0
        for n in agent.nvec:
            logits = out[:, start:start + n]
            start += n
            # Gumbel-max, as PgAgent.step: argmax(logits + Gumbel noise) samples softmax(logits).
            pick = logits.argmax(-1) if ctx.greedy else \
                (logits - np.log(self.rng.standard_exponential(logits.shape, dtype=np.float32))).argmax(-1)
            top = logits.max(-1, keepdims=True)
            log_z = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
            log_prob += logits[np.arange(len(pick)), pick] - log_z
            picks.append(pick)
        action = picks[0] if agent.kind == "discrete" else np.stack(picks, -1)
        return action.astype(np.int64), AgentInfo(log_prob=log_prob, value=value)


class NumpyQActor(NumpyActor):
    def __init__(self, agent: QAgent, trunks: list[_Mlp], rng: np.random.Generator) -> None:
        super().__init__(agent, trunks, rng)
        self.advantage = _Mlp(agent.advantage)
        self.value = None if agent.value is None else _Mlp(agent.value)
        self.support = None if agent.support is None else _view(agent.support)

    def step(self, obs: np.ndarray, ctx: StepContext) -> tuple[np.ndarray, QAgentInfo]:
        agent, (features,) = self.agent, self._features(obs)
        n = len(features)
        out = self.advantage(features).reshape(n, agent.n_actions, agent.n_atoms)
        if self.value is not None:
            out = self.value(features)[:, None, :] + out - out.mean(1, keepdims=True)
        if self.support is None:
            q = out[..., 0]
        else:
            p = np.exp(out - out.max(-1, keepdims=True))
            q = (p * self.support).sum(-1) / p.sum(-1)
        eps = agent.cfg.eps_eval if ctx.greedy else agent.epsilon(ctx.env_steps, *ctx.rows(n))
        explore = self.rng.random(n) < eps
        action = np.where(explore, self.rng.integers(agent.n_actions, size=n), q.argmax(-1))
        return action.astype(np.int64), QAgentInfo(value=q.max(-1).astype(np.float32))


def numpy_actor(agent, rng: np.random.Generator) -> NumpyActor | None:
    """A numpy actor for ``agent`` (module doc), or None where it must act in torch."""
    if agent.device.type != "cpu" or getattr(agent, "core", None) is not None:
        return None
    if isinstance(agent, PgAgent):
        trunks = [_trunk(agent.pi_encoder)] + ([] if agent.v_encoder is None else [_trunk(agent.v_encoder)])
        return None if None in trunks else NumpyPgActor(agent, trunks, rng)
    if isinstance(agent, QAgent):
        trunk = _trunk(agent.encoder)
        return None if trunk is None else NumpyQActor(agent, [trunk], rng)
    return None
