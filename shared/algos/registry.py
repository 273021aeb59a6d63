"""The one place an algorithm is declared: an ``AlgoSpec`` each, looked up by ``algo.name``.

A spec says everything the rest of rlpipe needs to run an algorithm: the dataclass of its
``[algo]`` section, the agent it trains (``shared.agents.registry``), the batches it learns
from (which fixes the replay tables it may use, the learner's batch layout and whether the
on-policy lag bound applies), whether it trains recurrent agents, and how to build it. No
other module names an algorithm.

``algo.name`` is a built-in name (``ALGOS``) or a ``"module:attribute"`` reference to an
``AlgoSpec`` in the user's own code (docs/extending.md); ``resolve`` turns either into the
spec, with a one-line ValueError naming what is wrong. This module is torch-free: the
launcher, replay and torch-free samplers read specs; ``make`` imports the algorithm's module
only when the learner builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from shared.agents import registry as agents
from shared.agents.registry import AgentSpec
from shared.algos.hparams import (A2CConfig, CrossQConfig, DDPGConfig, DQNConfig, ImpalaConfig, IQNConfig, PPOConfig,
                                  PQNConfig, QRDQNConfig, R2D1Config, SACConfig, TD3Config, TQCConfig)
from shared.replay.kinds import BATCH_KINDS, BatchKind
from shared.runtime.plugins import is_reference, load_attribute



@dataclass(frozen=True)
class AlgoSpec:
    name: str
    """What logs and progress call it (a built-in's ``algo.name``)."""
    config: type
    """The frozen dataclass of the ``[algo]`` section, a docstring per field."""
    agent: AgentSpec
    """The agent it trains."""
    batch: str
    """What it learns from: a key of ``shared.replay.kinds.BATCH_KINDS`` (segments, transitions, sequences)."""
    make: Callable[[Any, Any], Any]
    """``make(agent, cfg)``: the algorithm object, with ``update(batch, progress) -> Update`` (its
    diagnostics, and new priorities for prioritized tables: ``shared.algos.update``),
    ``state_dict()`` and ``load_state_dict(state)``."""
    recurrent: bool = False
    """It trains recurrent agents (``model.lstm_size > 0``) on whole sequences."""

    def __post_init__(self) -> None:
        if self.batch not in BATCH_KINDS:
            raise ValueError(f"AlgoSpec {self.name!r}: batch {self.batch!r} is not one of {', '.join(BATCH_KINDS)}")

    @property
    def batch_kind(self) -> BatchKind:
        return BATCH_KINDS[self.batch]

    @property
    def on_policy(self) -> bool:
        return self.batch_kind.on_policy

    @property
    def tables(self) -> tuple[str, ...]:
        """The ``replay.table`` values that serve its batches."""
        return tuple(self.batch_kind.tables)


def _ppo(agent, cfg):
    from shared.algos.ppo import PPO

    return PPO(agent, cfg)


def _a2c(agent, cfg):  # IMPALA is A2C with ImpalaConfig's V-trace targets and the paper's settings
    from shared.algos.a2c import A2C

    return A2C(agent, cfg)


def _dqn(agent, cfg):  # QR-DQN and IQN too: the agent's head picks the loss (shared/algos/dqn.py)
    from shared.algos.dqn import DQN

    return DQN(agent, cfg)


def _pqn(agent, cfg):
    from shared.algos.pqn import PQN

    return PQN(agent, cfg)


def _r2d1(agent, cfg):
    from shared.algos.r2d1 import R2D1

    return R2D1(agent, cfg)


def _ddpg(agent, cfg):  # TD3 is DDPG with TD3Config's twin critics, target smoothing and policy delay
    from shared.algos.qpg import DDPG

    return DDPG(agent, cfg)


def _sac(agent, cfg):  # CrossQ is SAC with CrossQConfig's batch-renormalized critics and no target networks
    from shared.algos.qpg import SAC

    return SAC(agent, cfg)


def _tqc(agent, cfg):
    from shared.algos.qpg import SAC, TruncatedQuantiles

    return SAC(agent, cfg, TruncatedQuantiles(cfg.drop_per_net))


ALGOS: dict[str, AlgoSpec] = {spec.name: spec for spec in (
    AlgoSpec("ppo", PPOConfig, agents.PG, "segments", _ppo, recurrent=True),
    AlgoSpec("a2c", A2CConfig, agents.PG, "segments", _a2c, recurrent=True),
    AlgoSpec("impala", ImpalaConfig, agents.PG, "segments", _a2c, recurrent=True),
    AlgoSpec("dqn", DQNConfig, agents.Q, "transitions", _dqn),
    AlgoSpec("qr_dqn", QRDQNConfig, agents.QUANTILE, "transitions", _dqn),
    AlgoSpec("iqn", IQNConfig, agents.IMPLICIT_QUANTILE, "transitions", _dqn),
    AlgoSpec("pqn", PQNConfig, agents.Q, "segments", _pqn),
    AlgoSpec("r2d1", R2D1Config, agents.Q, "sequences", _r2d1, recurrent=True),
    AlgoSpec("ddpg", DDPGConfig, agents.DETERMINISTIC, "transitions", _ddpg),
    AlgoSpec("td3", TD3Config, agents.DETERMINISTIC, "transitions", _ddpg),
    AlgoSpec("sac", SACConfig, agents.SAC, "transitions", _sac),
    AlgoSpec("tqc", TQCConfig, agents.SAC, "transitions", _tqc),
    AlgoSpec("crossq", CrossQConfig, agents.SAC, "transitions", _sac),
)}
"""The built-in algorithms by ``algo.name``."""


def resolve(name: str) -> AlgoSpec:
    """The spec ``algo.name`` names: a built-in, or a ``module:attribute`` reference to an
    ``AlgoSpec``. ValueError, one line naming the field, otherwise."""
    if is_reference(name):
        spec = load_attribute(name, "algo.name")
        if not isinstance(spec, AlgoSpec):
            raise ValueError(f"algo.name = {name!r}: {type(spec).__name__} is not an AlgoSpec "
                             "(shared.algos.registry.AlgoSpec; docs/extending.md)")
        return spec
    if name not in ALGOS:
        raise ValueError(f"algo.name = {name!r}: allowed: {', '.join(sorted(ALGOS))}, or 'module:attribute' "
                         "naming an AlgoSpec")
    return ALGOS[name]


def recurrent_names() -> list[str]:
    """The built-in algorithms that train recurrent agents (for error messages)."""
    return [name for name, spec in ALGOS.items() if spec.recurrent]
