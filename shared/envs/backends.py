"""The choice of env backend (``env.backend``): which class steps a sampler's envs, and the
config check of each. Every class keeps one contract (``shared.envs.group.EnvGroup``'s), so
the samplers, the evaluator and the probes of the services call ``make_env_group`` only.
A ``pettingzoo:<module>`` id is stepped by ``PettingZooGroup`` (one column per agent) on the
gymnasium backend.
"""

from __future__ import annotations

from shared.envs.envpool_backend import EnvPoolGroup, validate_envpool
from shared.envs.group import EnvConfig, EnvGroup, validate_gymnasium
from shared.envs.pettingzoo_backend import PettingZooGroup, columns_per_env, is_pettingzoo, validate_pettingzoo

__all__ = ["AnyEnvGroup", "columns_per_env", "make_env_group", "split_steps", "validate_env_config"]

AnyEnvGroup = EnvGroup | EnvPoolGroup | PettingZooGroup
"""What ``make_env_group`` returns: any backend's group, one interface."""

BACKENDS = {"gymnasium": (EnvGroup, validate_gymnasium), "envpool": (EnvPoolGroup, validate_envpool)}


def _backend(cfg: EnvConfig):
    if cfg.backend not in BACKENDS:
        raise ValueError(f"env.backend = {cfg.backend!r}: allowed: {', '.join(BACKENDS)}")
    if is_pettingzoo(cfg):
        if cfg.backend != "gymnasium":
            raise ValueError(f"env.backend = {cfg.backend!r}: PettingZoo envs ({cfg.id!r}) step on the 'gymnasium' "
                             "backend only")
        return PettingZooGroup, validate_pettingzoo
    for name, on in (("agent_id", cfg.agent_id), ("global_state", cfg.global_state)):
        if on:
            raise ValueError(f"env.{name} = true: {cfg.id!r} is a single-agent env; it is for "
                             "'pettingzoo:<module>' envs (set it false)")
    if cfg.groups:
        raise ValueError(f"env.groups: {cfg.id!r} is a single-agent env; agent groups are for "
                         "'pettingzoo:<module>' envs (leave it out)")
    return BACKENDS[cfg.backend]


def validate_env_config(cfg: EnvConfig) -> None:
    """Raise ValueError (one line naming the field, and for what a backend lacks, the backend)
    if ``cfg``'s backend cannot build its envs."""
    _backend(cfg)[1](cfg)


def make_env_group(cfg: EnvConfig, n_envs: int, base_seed: int) -> AnyEnvGroup:
    """``n_envs`` env columns of ``cfg`` on its backend (which checks ``cfg``): ``n_envs`` envs, env i
    seeded with ``base_seed + i``; for a PettingZoo env ``n_envs`` / N envs of N agents (see
    ``shared.envs.pettingzoo_backend``)."""
    return _backend(cfg)[0](cfg, n_envs, base_seed)


def split_steps(cfg: EnvConfig, groups: int) -> bool:
    """Whether a sampler with ``groups`` env groups of ``cfg`` steps them split-phase: each
    group's ``send`` first, then each one's ``recv`` (``env.split_step``). Only EnvPool steps in
    the background (the config check refuses "on" elsewhere), and only a second group gives the
    sampler something to do meanwhile. "auto" is "off": on 2 CPUs, with inference on the CPU,
    split steps measured no faster on Pong and slower on CartPole (docs/benchmarks.md,
    "Sampling throughput")."""
    return cfg.split_step == "on" and cfg.backend == "envpool" and groups >= 2
