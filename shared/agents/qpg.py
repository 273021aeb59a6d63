"""Q-policy-gradient agents for Box actions: an actor and Q-critics (DDPG, TD3, SAC).

- ``DeterministicAgent``: a deterministic actor mu(s) in [-1, 1]^A (tanh), explored with
  Gaussian or per-env Ornstein-Uhlenbeck noise (DDPG, TD3);
- ``SacAgent``: a tanh-squashed Gaussian actor with the change-of-variables log-prob (SAC).

Both work in *units* of the action Box: [-1, 1] per dimension, mapped linearly onto the
env's [low, high] by ``to_env`` (and back by ``to_unit``). Critics take unit actions, so
one set of hyperparameters fits any bounds; replay stores the env actions that were taken.
The target networks are the algorithm's (a deep copy, as in DQN), so ``state_dict()`` is
exactly what the learner publishes: batch renorm's running statistics (CrossQ's critics and
actor) among the buffers.

An actor with batch renorm (``ActorConfig.batch_renorm``) acts on its running statistics
whatever mode the module is in (``step``: each row's action depends on that row alone, and
acting moves no statistics); the algorithm says when it trains them (``actor_mode``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shared.agents.config import ActorConfig, CriticConfig, ModelConfig, QpgAgentConfig, QpgAgentInfo
from shared.agents import EXPLORE, HALF_LOG_2PI, StepContext
from shared.agents.masking import mask_path
from shared.agents.models import MLP, BatchRenorm, EnsembleMLP, has_cnn, make_encoder, make_obs_norm, obs_to
from shared.data.namedarraytuple import leading_len

ACTOR_HEAD_GAIN = 0.01  # actions start near the middle of the Box
_LOG_2 = math.log(2.0)


def tanh_gaussian_log_prob(u: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """log density [N] of a = tanh(u), u ~ Normal(mean, exp(log_std)) per dimension [N, A].

    Change of variables: log p(a) = log N(u) - sum log(1 - tanh(u)^2), with the stable
    form log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)).
    """
    gauss = -0.5 * ((u - mean) / log_std.exp()).square() - log_std - HALF_LOG_2PI
    return (gauss - 2.0 * (_LOG_2 - u - F.softplus(-2.0 * u))).sum(-1)


class Critics(nn.Module):
    """n Q-functions Q_i(s, a) side by side: the observation's encoder features (no trunk)
    and the unit action through an ``EnsembleMLP`` of ``critic.hidden_sizes`` (the model's
    widths when empty), with ``critic.outputs`` outputs each (a Q-value, or quantiles of the
    return) and, with ``critic.batch_renorm``, a ``BatchRenorm`` before each layer. Encoders
    with parameters (images) are one per critic; a parameter-free one (flatten) is shared."""

    def __init__(self, obs_example, model_cfg: ModelConfig, action_dim: int, critic: CriticConfig,
                 obs_space=None) -> None:
        super().__init__()
        n = critic.n
        cfg = dataclasses.replace(model_cfg, hidden_sizes=())
        encoder, feat_dim = make_encoder(obs_example, cfg, obs_space)
        self.encoders = nn.ModuleList([encoder, *(make_encoder(obs_example, cfg, obs_space)[0] for _ in range(n - 1))]
                                      if has_cnn(obs_example, cfg) else [encoder])
        self.n, self.outputs = n, critic.outputs
        norm = (functools.partial(BatchRenorm, n, momentum=critic.renorm_momentum, eps=critic.renorm_eps,
                                  warmup_steps=critic.renorm_warmup_steps) if critic.batch_renorm else None)
        self.mlp = EnsembleMLP(n, feat_dim + action_dim, tuple(critic.hidden_sizes or model_cfg.hidden_sizes),
                               model_cfg.activation, output_size=critic.outputs, norm=norm)

    def forward(self, obs, unit_action: torch.Tensor) -> torch.Tensor:
        """Q [n, N] (quantiles [n, N, outputs] with more than one output) for obs tree [N, ...]
        and unit actions [N, A]."""
        if len(self.encoders) == 1:
            features = self.encoders[0](obs).expand(self.n, -1, -1)
        else:
            features = torch.stack([encoder(obs) for encoder in self.encoders])
        x = torch.cat([features, unit_action.expand(self.n, -1, -1)], dim=-1)
        out = self.mlp(x)
        return out.squeeze(-1) if self.outputs == 1 else out


class QpgAgent(nn.Module):
    """What both agents share: the Box, the critics, random warm-up and evaluation acting.

    Subclasses give the actor: ``mean_action(obs)`` (evaluation) and ``explore(obs, ctx)``.
    """

    def __init__(self, obs_example, action_space: gym.Space, model_cfg: ModelConfig, cfg: QpgAgentConfig,
                 critic: CriticConfig, actor_outputs: int, obs_space: gym.Space | None = None,
                 actor: ActorConfig = ActorConfig()) -> None:
        super().__init__()
        if not isinstance(action_space, gym.spaces.Box):
            raise ValueError(f"{type(self).__name__}: action space {action_space} not supported; "
                             "DDPG, TD3 and SAC need a Box")
        low, high = (np.asarray(b, np.float64).reshape(-1) for b in (action_space.low, action_space.high))
        if not (np.isfinite(low).all() and np.isfinite(high).all() and (low < high).all()):
            raise ValueError(f"{type(self).__name__}: the action Box needs finite bounds with low < high, got "
                             f"low {action_space.low} high {action_space.high}")
        self.cfg = cfg
        self.action_shape = tuple(action_space.shape)
        self.action_dim = low.size
        self.register_buffer("low", torch.as_tensor(low, dtype=torch.float32), persistent=False)
        self.register_buffer("high", torch.as_tensor(high, dtype=torch.float32), persistent=False)
        mask_path(model_cfg.action_mask, obs_example, None, obs_space)  # a mask here is a config error: Box actions
        self.obs_norm = make_obs_norm(obs_example, model_cfg)
        norm = (functools.partial(BatchRenorm, 1, momentum=actor.renorm_momentum, eps=actor.renorm_eps,
                                  warmup_steps=actor.renorm_warmup_steps) if actor.batch_renorm else None)
        self.actor_encoder, feat_dim = make_encoder(obs_example, model_cfg, obs_space, norm=norm)
        self.actor_head = MLP(feat_dim, (), output_size=actor_outputs * self.action_dim, output_gain=ACTOR_HEAD_GAIN,
                              norm=norm)
        self.actor_norms = [m for part in (self.actor_encoder, self.actor_head) for m in part.modules()
                            if isinstance(m, BatchRenorm)]
        """The actor's batch renorm layers (none without ``actor.batch_renorm``); ``actor_mode`` sets them."""
        self.critics = Critics(obs_example, model_cfg, self.action_dim, critic, obs_space)

    @property
    def device(self) -> torch.device:
        return self.low.device

    def _actor_out(self, obs) -> torch.Tensor:
        return self.actor_head(self.actor_encoder(obs_to(obs, self.device, self.obs_norm)))

    def q(self, obs, unit_action: torch.Tensor) -> torch.Tensor:
        """Q_i(obs, a) of every critic: float32 [n_critics, N] for unit actions [N, A], with grad
        (quantile critics: [n_critics, N, quantiles])."""
        return self.critics(obs_to(obs, self.device, self.obs_norm), unit_action)

    def to_env(self, unit: torch.Tensor) -> torch.Tensor:
        """Unit actions [N, A] in [-1, 1] -> env actions [N, *shape] in [low, high]."""
        env = self.low + (unit + 1.0) * 0.5 * (self.high - self.low)
        return torch.minimum(torch.maximum(env, self.low), self.high).reshape(-1, *self.action_shape)

    def to_unit(self, env_action: torch.Tensor) -> torch.Tensor:
        """Env actions [N, *shape] -> unit actions [N, A] (what the critics take)."""
        flat = env_action.reshape(env_action.shape[0], self.action_dim).float()
        return (2.0 * (flat - self.low) / (self.high - self.low) - 1.0).clamp(-1.0, 1.0)

    @contextlib.contextmanager
    def actor_mode(self, training: bool):
        """The actor's batch renorm layers in training mode (batch statistics, which each pass
        moves) or eval mode (the running statistics) inside the block, as they were after it;
        nothing for an actor without batch renorm."""
        was = [m.training for m in self.actor_norms]
        for m in self.actor_norms:
            m.training = training  # leaves: what Module.train(mode) would set
        try:
            yield
        finally:
            for m, mode in zip(self.actor_norms, was):
                m.training = mode

    @torch.no_grad()
    def step(self, obs, ctx: StepContext = EXPLORE) -> tuple[torch.Tensor, QpgAgentInfo]:
        """Env actions float32 [B, *shape] for obs tree [B, ...], always within the Box:
        the actor's mean for a greedy context, uniform for the first ``random_steps`` env
        steps of the run, the actor explored as the subclass does after that. An actor with
        batch renorm acts on its running statistics (in serial mode the learner's agent, in
        training mode, acts too)."""
        if not self.actor_norms:
            return self._step(obs, ctx)
        with self.actor_mode(False):
            return self._step(obs, ctx)

    def _step(self, obs, ctx: StepContext) -> tuple[torch.Tensor, QpgAgentInfo]:
        if ctx.greedy:
            unit = self.mean_action(obs)
        elif ctx.env_steps < self.cfg.random_steps:
            n = leading_len(obs)
            unit = torch.rand(n, self.action_dim, device=self.device) * 2.0 - 1.0
        else:
            unit = self.explore(obs, ctx)
        return self.to_env(unit), QpgAgentInfo()

    def mean_action(self, obs) -> torch.Tensor:
        raise NotImplementedError

    def explore(self, obs, ctx: StepContext) -> torch.Tensor:
        raise NotImplementedError



class DeterministicAgent(QpgAgent):
    """DDPG/TD3 agent: mu(s) = tanh(head(encoder(s))), explored with Gaussian or OU noise.

    OU noise keeps a state per env of the run (rows of ``ou_state``, by the context's global
    env index), reset to 0 when the env's observation starts an episode.
    """

    def __init__(self, obs_example, action_space: gym.Space, model_cfg: ModelConfig = ModelConfig(),
                 cfg: QpgAgentConfig = QpgAgentConfig(), critic: CriticConfig = CriticConfig(n=1),
                 obs_space: gym.Space | None = None, actor: ActorConfig = ActorConfig()) -> None:
        super().__init__(obs_example, action_space, model_cfg, cfg, critic, actor_outputs=1, obs_space=obs_space,
                         actor=actor)
        self.ou_state: torch.Tensor | None = None  # [envs_total, A], not a parameter: acting state

    def policy(self, obs) -> torch.Tensor:
        """mu(obs): unit actions [N, A], with grad (the actor loss differentiates through it)."""
        return torch.tanh(self._actor_out(obs))

    def mean_action(self, obs) -> torch.Tensor:
        return self.policy(obs)

    def explore(self, obs, ctx: StepContext) -> torch.Tensor:
        mu = self.policy(obs)
        if self.cfg.noise == "gaussian":
            noise = torch.randn_like(mu) * self.cfg.noise_scale
        else:
            noise = self.ou_noise(ctx, mu.shape[0])
        return (mu + noise).clamp(-1.0, 1.0)

    def ou_noise(self, ctx: StepContext, n: int) -> torch.Tensor:
        """Advance the OU state of the context's envs one step (after resetting those that
        start an episode) and return it: [n, A]."""
        index, total = ctx.rows(n)
        if self.ou_state is None or self.ou_state.shape[0] != total:
            self.ou_state = torch.zeros(total, self.action_dim, device=self.device)
        rows = torch.as_tensor(index, device=self.device)
        x = self.ou_state[rows]
        if ctx.first is not None:
            x = torch.where(torch.as_tensor(ctx.first, device=self.device)[:, None], torch.zeros_like(x), x)
        cfg = self.cfg
        x = x - cfg.ou_theta * x * cfg.ou_dt + cfg.noise_scale * math.sqrt(cfg.ou_dt) * torch.randn_like(x)
        self.ou_state[rows] = x
        return x


class SacAgent(QpgAgent):
    """SAC agent: a = tanh(u), u ~ Normal(mean(s), std(s)); log std squashed into
    [log_std_min, log_std_max] by a tanh (Haarnoja et al. 2018; CleanRL's bounds)."""

    def __init__(self, obs_example, action_space: gym.Space, model_cfg: ModelConfig = ModelConfig(),
                 cfg: QpgAgentConfig = QpgAgentConfig(), critic: CriticConfig = CriticConfig(n=2),
                 obs_space: gym.Space | None = None, actor: ActorConfig = ActorConfig()) -> None:
        super().__init__(obs_example, action_space, model_cfg, cfg, critic, actor_outputs=2, obs_space=obs_space,
                         actor=actor)

    def _mean_log_std(self, obs) -> tuple[torch.Tensor, torch.Tensor]:
        mean, raw = self._actor_out(obs).chunk(2, dim=-1)
        lo, hi = self.cfg.log_std_min, self.cfg.log_std_max
        return mean, lo + 0.5 * (hi - lo) * (torch.tanh(raw) + 1.0)

    def sample(self, obs) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised unit actions [N, A] and their log-probs [N] (in unit space), with grad."""
        mean, log_std = self._mean_log_std(obs)
        u = mean + log_std.exp() * torch.randn_like(mean)
        return torch.tanh(u), tanh_gaussian_log_prob(u, mean, log_std)

    def mean_action(self, obs) -> torch.Tensor:
        return torch.tanh(self._mean_log_std(obs)[0])

    def explore(self, obs, ctx: StepContext) -> torch.Tensor:
        return self.sample(obs)[0]
