"""The agents: one ``AgentSpec`` a kind, named by the algorithms that train them.

An agent spec says what the ``[agent]`` section holds (its config dataclass), which agent
info each step carries (its ``family``: the layout samplers, replay and the learner size
their buffers by, without importing torch) and how to build the torch module. This module
is torch-free: the builders import their agent class when called.

An out-of-tree agent is an ``AgentSpec`` of the user's own; an out-of-tree algorithm names it
in its ``AlgoSpec.agent`` (docs/extending.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from shared.agents.config import FAMILIES, PgAgentConfig, QAgentConfig, QpgAgentConfig, QuantileHead

MakeAgent = Callable[..., Any]
"""``make(obs_example, action_space, model_cfg, agent_cfg, algo_cfg, obs_space=None) -> torch.nn.Module``:
``obs_example`` is one env's observation (numpy, or a namedarraytuple of them), ``action_space``
the env's gymnasium space, then the run's ``[model]``, ``[agent]`` and ``[algo]`` sections;
``obs_space`` (keyword) is the env's observation space, which tells ``make_encoder`` the
Discrete and MultiDiscrete leaves it one-hot encodes."""


@dataclass(frozen=True)
class AgentSpec:
    name: str
    """What error messages and logs call it."""
    config: type
    """The frozen dataclass of the ``[agent]`` section (its defaults when the section is absent)."""
    family: str
    """The agent info its steps carry, one of ``shared.agents.config.FAMILIES``: pg (log-prob
    and value), q (max Q), qpg (nothing); recurrent variants add the ``Memory``."""
    make: MakeAgent
    """Builds the agent (see ``MakeAgent``)."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"AgentSpec {self.name!r}: family {self.family!r} is not one of {', '.join(FAMILIES)}")


def _pg(obs_example, action_space, model_cfg, agent_cfg, algo_cfg, obs_space=None):
    from shared.agents.pg import PgAgent

    return PgAgent(obs_example, action_space, model_cfg, agent_cfg, obs_space=obs_space)


def _q(obs_example, action_space, model_cfg, agent_cfg, algo_cfg, obs_space=None):
    from shared.agents.q import QAgent

    return QAgent(obs_example, action_space, model_cfg, agent_cfg, obs_space=obs_space)


def _quantile(obs_example, action_space, model_cfg, agent_cfg, algo_cfg, obs_space=None):
    from shared.agents.q import QAgent

    return QAgent(obs_example, action_space, model_cfg, agent_cfg, obs_space=obs_space,
                  quantiles=QuantileHead(n_quantiles=algo_cfg.n_quantiles))


def _implicit_quantile(obs_example, action_space, model_cfg, agent_cfg, algo_cfg, obs_space=None):
    from shared.agents.q import QAgent

    return QAgent(obs_example, action_space, model_cfg, agent_cfg, obs_space=obs_space,
                  quantiles=QuantileHead(n_cosines=algo_cfg.n_cosines, acting_samples=algo_cfg.n_acting_taus,
                                         merge_hidden_sizes=tuple(algo_cfg.merge_hidden_sizes)))


def _deterministic(obs_example, action_space, model_cfg, agent_cfg, algo_cfg, obs_space=None):
    from shared.agents.qpg import DeterministicAgent

    return DeterministicAgent(obs_example, action_space, model_cfg, agent_cfg, critic=algo_cfg.critic(),
                              obs_space=obs_space, actor=algo_cfg.actor())


def _sac(obs_example, action_space, model_cfg, agent_cfg, algo_cfg, obs_space=None):
    from shared.agents.qpg import SacAgent

    return SacAgent(obs_example, action_space, model_cfg, agent_cfg, critic=algo_cfg.critic(), obs_space=obs_space,
                    actor=algo_cfg.actor())


PG = AgentSpec("pg", PgAgentConfig, "pg", _pg)
"""Actor-critic (``PgAgent``): A2C, PPO."""
Q = AgentSpec("q", QAgentConfig, "q", _q)
"""Q-network (``QAgent``, C51 and dueling as options): the DQN family, R2D1, PQN."""
QUANTILE = AgentSpec("quantile", QAgentConfig, "q", _quantile)
"""Q-network with ``algo.n_quantiles`` quantiles per action at fixed fractions: QR-DQN."""
IMPLICIT_QUANTILE = AgentSpec("implicit_quantile", QAgentConfig, "q", _implicit_quantile)
"""Q-network with quantiles at sampled fractions (cosine embedding, ``algo.n_cosines``): IQN."""
DETERMINISTIC = AgentSpec("deterministic", QpgAgentConfig, "qpg", _deterministic)
"""Deterministic actor and the Q-critics ``algo_cfg.critic()`` describes (``QpgConfig``): DDPG, TD3."""
SAC = AgentSpec("sac", QpgAgentConfig, "qpg", _sac)
"""Squashed-Gaussian actor (``algo_cfg.actor()``) and the Q-critics ``algo_cfg.critic()`` describes:
SAC, TQC (quantile critics), CrossQ (batch-renormalized critics and actor)."""
