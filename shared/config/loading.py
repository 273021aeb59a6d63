"""Reading and writing an experiment: one TOML file, ``--set a.b=v`` overrides, every error one
line naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Optional
from shared.config.checks import check
from shared.algos import registry
from shared.config.schema import ConfigError, Experiment, SECTIONS


def load(path: str | Path, overrides: list[str] = (), check_ports: bool = False, check_env: bool = True) -> Experiment:
    """Read, override and validate an experiment file (``checks.check``; ``check_env = False``
    leaves out the checks that build or inspect the env: for a run's config, which its launch
    checked, read by a process that steps no env)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    return from_dict(apply_overrides(raw, overrides), check_ports=check_ports, check_env=check_env)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``section.key=value`` strings; values are TOML literals, else plain strings."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) != 2 or not all(parts):
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. sampler.count=4")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        section = raw.setdefault(parts[0], {})
        if not isinstance(section, dict):
            raise ConfigError(f"--set {item!r}: {parts[0]} is not a section")
        section[parts[1]] = value
    return raw


RETIRED = {("env", "seed"): (0, "run.seed seeds the envs")}
"""Keys that were removed: (section, key) -> (the default every run directory's resolved config
holds, what replaces the key). A run made before the removal still loads (its config.toml holds
the default, which is dropped); a config that sets another value is told what to set instead."""


def from_dict(raw: dict, check_ports: bool = False, check_env: bool = True) -> Experiment:
    known = set(SECTIONS) | {"algo", "agent"}
    for name in raw:
        if name not in known:
            raise ConfigError(f"unknown section [{name}]{_suggest(name, known)} (allowed: {', '.join(sorted(known))})")
    raw = _drop_retired(raw)
    sections = {name: _build(name, cls, raw.get(name, {})) for name, cls in SECTIONS.items()}
    algo_raw = dict(raw.get("algo", {}))
    algo_name = algo_raw.pop("name", "ppo")
    if not isinstance(algo_name, str):
        raise ConfigError(f"algo.name = {algo_name!r}: expected a string (a built-in name or 'module:attribute')")
    try:
        spec = registry.resolve(algo_name)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    algo = _build("algo", spec.config, algo_raw)
    agent = _build("agent", spec.agent.config, raw.get("agent", {}))
    exp = Experiment(algo_name=algo_name, algo=algo, agent=agent, **sections)
    check(exp, check_ports, check_env)
    return exp


def _drop_retired(raw: dict) -> dict:
    raw = dict(raw)
    for (section, key), (default, instead) in RETIRED.items():
        values = raw.get(section)
        if isinstance(values, dict) and key in values:
            if values[key] != default:
                raise ConfigError(f"{section}.{key} was removed: {instead}")
            raw[section] = {k: v for k, v in values.items() if k != key}
    return raw


def _build(section: str, cls: type, values) -> Any:
    """``cls`` from a TOML table: its fields' keys, or a flat section's ``KEYS`` (ReplayConfig:
    its parts' fields under one key each)."""
    if not isinstance(values, dict):
        raise ConfigError(f"[{section}] must be a table, got {type(values).__name__}")
    flat = hasattr(cls, "KEYS")
    hints = {key: cls.key_type(key) for key in cls.KEYS} if flat else typing.get_type_hints(cls)
    names = list(cls.KEYS) if flat else [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"unknown key {section}.{key}{_suggest(key, names)} (allowed: {', '.join(names)})")
        kwargs[key] = _coerce(f"{section}.{key}", hints[key], value)
    try:
        return cls.from_flat(kwargs) if flat else cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"[{section}]: {e}") from None


def _coerce(where: str, hint, value):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(where, inner[0], value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} = {value!r}: expected a list, got {type(value).__name__}")
        elem = args[0] if args else Any
        return tuple(_coerce(f"{where}[{i}]", elem, v) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} = {value!r}: expected a table, e.g. {{ name = \"value\" }}, "
                              f"got {type(value).__name__}")
        return {k: _coerce(f"{where}.{k}", args[1] if args else Any, v) for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (not isinstance(value, hint) or (hint is int and isinstance(value, bool))):
        raise ConfigError(f"{where} = {value!r}: expected {hint.__name__}, got {type(value).__name__}")
    return value


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def dumps(exp: Experiment) -> str:
    """The resolved experiment as TOML (what services read back from the run directory)."""
    out = []
    for name in [*SECTIONS, "agent"]:
        out.append(_section_toml(name, getattr(exp, name)))
    out.append(_section_toml("algo", exp.algo, {"name": exp.algo_name}))
    return "\n".join(out)


def _section_toml(name: str, obj, extra: Optional[dict] = None) -> str:
    lines = [f"[{name}]"]
    items = dict(extra or {})
    items.update(obj.flat() if hasattr(obj, "KEYS") else {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    for key, value in items.items():
        if value is not None:
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table: a key may be anything, so it is quoted
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
