"""Gymnasium environments for rlpipe: their config, how one is built, and a group of them
stepped inside one sampler process straight into preallocated ``[B, ...]`` arrays (the
``gymnasium`` backend; ``EnvGroup``'s contract is every backend's, see ``shared.envs.backends``).

Observation dtypes written by ``EnvGroup`` (stable, whatever the env returns):

=================  ==========================================================
space              example leaf
=================  ==========================================================
Box, float         float32, the space's shape
Box, bool          uint8 0/1 (MinAtar's ``[10, 10, C]`` channels-last maps)
Box, other ints    the space's dtype (Atari frames: uint8 ``[4, 84, 84]``)
Discrete           int64 scalar (the env's value, ``start`` included)
MultiDiscrete      int64, ``nvec``'s shape
MultiBinary        int8, the space's shape
Dict / Tuple       nested namedarraytuple: Dict keys sorted, Tuple fields f0, f1…
=================  ==========================================================

uint8 is not always pixels: MinAtar's maps hold 0/1, so a model scales inputs by the
observation space's ``high`` (1 or 255), never by a fixed 255.

Actions are given as ``example_action()`` describes: Discrete/MultiDiscrete as int64
indices from 0 (the space's ``start`` is added for the env), Box as float32 (clipped to the
bounds before the env sees them; the caller's array is not changed), MultiBinary as int8.

Wrapper names for ``EnvConfig.wrappers`` (order-free; applied inner to outer as listed in
``shared.envs.atari``): ``atari`` (DQN preprocessing, fire reset, sign reward, frame stack 4),
``episodic_life`` (ALE only), ``clip_reward`` (reward -> its sign), ``frame_stack:N``
(stack the last N observations on a new first axis; with ``atari`` it replaces the 4).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import keyword
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.wrappers import FrameStackObservation, TimeLimit, TransformReward

from shared.envs import atari, tasks
from shared.envs.step_limit import StepLimit, StepTimeout
from shared.data.namedarraytuple import is_nat, leaves, namedarraytuple
from shared.runtime.plugins import load_attribute
from shared.transport.wire import MAX_RETURN

tasks.register()


@dataclass(frozen=True)
class EnvConfig:
    id: str = "CartPole-v1"
    """A registered gymnasium id (ALE/…, MinAtar/… included), "module:callable" returning a gymnasium.Env,
    or "pettingzoo:<module>" for a multi-agent PettingZoo env (``shared.envs.pettingzoo_backend``)."""
    kwargs: str = ""
    """Keyword arguments for the env constructor as a JSON object, e.g. '{"repeat_action_probability": 0.0}'."""
    wrappers: tuple[str, ...] = ()
    """Wrapper names: "atari", "episodic_life", "clip_reward", "frame_stack:N" (any order)."""
    max_episode_steps: int = 0
    """Truncate episodes after this many agent steps (after Atari frame skip); 0 keeps the env's default."""
    backend: str = "gymnasium"
    """What steps a sampler's envs: "gymnasium" (one env after another in Python, ``EnvGroup``) or
    "envpool" (the whole batch in one call into EnvPool's C++ thread pool, ``shared.envs.envpool_backend``)."""
    threads: int = 0
    """Envpool backend: worker threads of each env group's pool; 0 = one per env, at most the CPUs
    this process may run on. The gymnasium backend has none (leave 0)."""
    step_timeout_s: float = 0.0
    """Seconds an env's ``step()`` or ``reset()`` may take: one that runs longer is interrupted and is
    an env failure like one that raised (the env recreated, the step a truncation marked failed,
    counted). 0: off. Gymnasium backend, pure-Python hangs only (``shared.envs.step_limit``): a C
    extension that holds the GIL is not interrupted, and the watchdog (``run.watchdog_s``) is the
    backstop; keep it well under that."""
    agent_id: bool = False
    """PettingZoo envs: add the one-hot of the agent's index (``possible_agents`` order) to each
    column's observation as its ``agent_id`` leaf, so that one shared policy can act differently
    per agent (``shared.envs.pettingzoo_backend``)."""
    global_state: bool = False
    """PettingZoo envs with a ``state()`` (and its ``state_space``): add the env's global state
    to each column's observation as its ``global_state`` leaf, which a policy-gradient agent's
    value network reads and its policy never does (a centralised value, MAPPO; see
    ``shared.agents.pg``). Policy-gradient algorithms only (PPO, A2C, IMPALA)."""
    groups: dict[str, str] = field(default_factory=dict)
    """PettingZoo envs: separate policies per agent group, each group named with an fnmatch pattern of
    its agents' names, e.g. ``{ adversaries = "adversary_*", good = "agent_*" }``; every agent in
    exactly one group. Each column's observation gets its group's index (in the order given) as its
    ``agent_group`` leaf, by which the agent routes the column to its group's networks
    (``shared.agents.groups``). Empty: one policy for all agents."""
    split_step: str = "auto"
    """Alternating sampler (two env groups, server inference) on the envpool backend: "on" starts
    each group's step in EnvPool's threads and collects it after the sampler has served the other
    group (``send``, then ``recv``), so that the sampler's own work overlaps the stepping; "off"
    steps each group in one call; "auto" is "off" for now, the faster on 2 CPUs with inference on
    the CPU (docs/benchmarks.md, "Sampling throughput"). The gymnasium backend steps in the
    sampler's thread: "auto" or "off" only."""


class EnvError(RuntimeError):
    """An env misbehaved (raised, returned a NaN, infinite or huge reward, an observation with
    a NaN or an infinity, or a wrongly shaped/typed observation).

    ``env_indices``: the failed envs (call ``EnvGroup.recreate(i, obs_out)`` for each);
    ``finished``: the episodes that ended this step in the other envs, as ``step`` returns;
    ``failed_steps``: those of ``env_indices`` whose step itself failed, so that its outputs
    are no real transition (the others' step was real and only their reset failed); all of
    ``env_indices`` unless given.
    """

    def __init__(self, message: str, env_indices: tuple[int, ...], finished: list[tuple[int, float, int]],
                 failed_steps: tuple[int, ...] | None = None):
        super().__init__(message)
        self.env_indices = env_indices
        self.finished = finished
        self.failed_steps = env_indices if failed_steps is None else failed_steps


# ---------------------------------------------------------------- config

SPLIT_STEP = ("auto", "on", "off")
"""The values of ``env.split_step``."""

_FLAG_WRAPPERS = ("atari", "episodic_life", "clip_reward")
_ARG_WRAPPERS = ("frame_stack",)
_KNOWN_WRAPPERS = "atari, episodic_life, clip_reward, frame_stack:N (N >= 1)"


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _parse_wrappers(names: tuple[str, ...]) -> dict[str, int]:
    """{"atari": 0, "frame_stack": 4, ...} from the config's names; ValueError on a bad one."""
    parsed: dict[str, int] = {}
    for item in names:
        name, sep, arg = str(item).partition(":")
        if name in _FLAG_WRAPPERS and not sep:
            value = 0
        elif name in _ARG_WRAPPERS and sep and arg.isdigit() and int(arg) >= 1:
            value = int(arg)
        else:
            raise ValueError(f"env.wrappers: unknown or malformed wrapper {item!r}; known: {_KNOWN_WRAPPERS}")
        if name in parsed:
            raise ValueError(f"env.wrappers: {name!r} is given twice")
        parsed[name] = value
    return parsed


def _parse_kwargs(text: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"env.kwargs: not valid JSON ({e}); write a JSON object like '{{\"frameskip\": 1}}'"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"env.kwargs: expected a JSON object, got {type(value).__name__}")
    return value


def _register_ale() -> None:
    import ale_py

    gym.register_envs(ale_py)


def _register_minatar() -> None:
    import minatar.gym

    minatar.gym.register_envs()


PLUGINS = {"ALE": _register_ale, "MinAtar": _register_minatar}
"""The optional env families registered with gymnasium on their ids' first use, by namespace: the
id ``ALE/Pong-v5`` loads ale_py alone. Importing minatar imports matplotlib and seaborn for its
renderer (~1.5 s), so it is done only where a MinAtar id is asked for."""

_plugins_loaded: set[str] = set()


def _load_env_plugins(env_id: str) -> None:
    """Register with gymnasium the family of ``env_id``'s namespace, or every family (ALE,
    MinAtar) for an id of none of theirs, each once, where installed."""
    namespace = env_id.split("/", 1)[0]
    for family in [namespace] if namespace in PLUGINS else list(PLUGINS):
        if family in _plugins_loaded:
            continue
        _plugins_loaded.add(family)
        # minatar logs root-logger warnings about its optional plotting dependencies on import.
        logging.disable(logging.WARNING)
        try:
            PLUGINS[family]()
        except ImportError:
            pass
        finally:
            logging.disable(logging.NOTSET)


def _env_spec(env_id: str) -> gym.envs.registration.EnvSpec:
    if env_id not in gym.registry:
        _load_env_plugins(env_id)
    spec = gym.registry.get(env_id)
    if spec is None:
        close = difflib.get_close_matches(env_id, list(gym.registry), n=5, cutoff=0.5)
        hint = f"close registered ids: {', '.join(close)}" if close else "no close registered id"
        raise ValueError(f"env.id: unknown gymnasium id {env_id!r}; {hint}; or give 'module:callable'")
    return spec


def _env_callable(env_id: str) -> Callable[..., gym.Env]:
    fn = load_attribute(env_id, "env.id")
    if not callable(fn):
        raise ValueError(f"env.id = {env_id!r}: {type(fn).__name__} is not callable (an env is made by calling it)")
    return fn


def check_common(cfg: EnvConfig) -> tuple[dict[str, Any], dict[str, int]]:
    """The checks of ``cfg`` every backend shares; returns (its kwargs, its parsed wrappers).
    ValueError (one line naming the field) if one fails."""
    if not isinstance(cfg.id, str) or not cfg.id:
        raise ValueError("env.id: must be a non-empty string (a gymnasium id or 'module:callable')")
    kwargs = _parse_kwargs(cfg.kwargs)
    wrappers = _parse_wrappers(cfg.wrappers)
    if cfg.max_episode_steps < 0:
        raise ValueError(f"env.max_episode_steps: must be >= 0 (0 = env default), got {cfg.max_episode_steps}")
    if cfg.threads < 0:
        raise ValueError(f"env.threads: must be >= 0 (0 = one per env, at most the CPUs), got {cfg.threads}")
    if not (math.isfinite(cfg.step_timeout_s) and cfg.step_timeout_s >= 0):
        raise ValueError(f"env.step_timeout_s: must be >= 0 seconds (0 = off), got {cfg.step_timeout_s}")
    if cfg.split_step not in SPLIT_STEP:
        raise ValueError(f"env.split_step = {cfg.split_step!r}: allowed: {', '.join(map(repr, SPLIT_STEP))}")
    return kwargs, wrappers


def validate_gymnasium(cfg: EnvConfig) -> None:
    """Raise ValueError (one line naming the field and what is allowed) if the gymnasium backend
    cannot build ``cfg``'s envs."""
    kwargs, wrappers = check_common(cfg)
    if cfg.threads:
        raise ValueError(f"env.threads = {cfg.threads}: the gymnasium backend steps its envs in the sampler's "
                         "own thread; leave it 0 (or set env.backend = 'envpool')")
    if cfg.split_step == "on":
        raise ValueError("env.split_step = 'on': the gymnasium backend steps its envs in the sampler's own thread, "
                         "so nothing would overlap; leave it 'auto' (or set env.backend = 'envpool')")
    if ":" in cfg.id:
        _env_callable(cfg.id)
        return
    spec = _env_spec(cfg.id)
    entry = spec.entry_point if isinstance(spec.entry_point, str) else getattr(spec.entry_point, "__module__", "")
    ale_only = [w for w in ("atari", "episodic_life") if w in wrappers]
    if ale_only and not entry.startswith("ale_py"):
        raise ValueError(
            f"env.wrappers: {', '.join(ale_only)} only work with an ALE env (e.g. ALE/Pong-v5), not {cfg.id!r}"
        )
    if "atari" in wrappers and kwargs.get("frameskip", 1) != 1:
        raise ValueError("env.kwargs: 'atari' does its own frame skip; leave frameskip out or set it to 1")


def _sign(reward: float) -> float:
    return float((reward > 0) - (reward < 0))


class EpisodeTracker(gym.Wrapper):
    """Sums the true reward and counts agent steps of the current game. It sits under the
    reward clipping and episodic life wrappers, so it sees game score and game over."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.episode_return = 0.0
        self.episode_length = 0
        # (return, length) of the game that just ended, until the next reset.
        self.finished: Optional[tuple[float, int]] = None

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.episode_return += float(reward)
        self.episode_length += 1
        if terminated or truncated:
            self.finished = (self.episode_return, self.episode_length)
        return obs, reward, terminated, truncated, info

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.episode_return, self.episode_length, self.finished = 0.0, 0, None
        return self.env.reset(seed=seed, options=options)


def make_env(cfg: EnvConfig, render_mode: str | None = None) -> tuple[gym.Env, EpisodeTracker]:
    """Build one env with ``cfg``'s wrappers; returns (the outer env, its EpisodeTracker).
    ``render_mode`` (e.g. "rgb_array" for videos) goes to the env's constructor."""
    wrappers = _parse_wrappers(cfg.wrappers)
    kwargs = _parse_kwargs(cfg.kwargs)
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    use_atari = "atari" in wrappers
    limit = cfg.max_episode_steps
    # gym.make's own TimeLimit (which replaces the spec's) counts agent steps unless the
    # atari frame skip sits above it; then, and for callables, ours goes above the skip.
    limit_in_make = ":" not in cfg.id and not use_atari
    if ":" in cfg.id:
        env = _env_callable(cfg.id)(**kwargs)
        if not isinstance(env, gym.Env):
            raise ValueError(f"env.id: {cfg.id!r} returned {type(env).__name__}, not a gymnasium.Env")
    else:
        if use_atari:
            kwargs.setdefault("frameskip", 1)
            # AtariPreprocessing reads the screen from the emulator itself; a grayscale
            # obs_type spares the copy of an unused RGB frame on every emulator step.
            kwargs.setdefault("obs_type", "grayscale")
        elif limit:
            kwargs["max_episode_steps"] = limit
        _env_spec(cfg.id)  # its family registered here too: a service that reads a run's config checks no env
        # EnvGroup checks every observation itself; gymnasium's passive checker would only add a layer.
        env = gym.make(cfg.id, disable_env_checker=True, **kwargs)
    needs_ale = [w for w in ("atari", "episodic_life") if w in wrappers]
    if needs_ale and not atari.is_ale(env):
        raise ValueError(
            f"env.wrappers: {', '.join(needs_ale)} only work with an ALE env; {cfg.id!r} has no env.unwrapped.ale"
        )
    if use_atari:
        env = atari.preprocess(env)
    if limit and not limit_in_make:
        env = TimeLimit(env, limit)
    env = tracker = EpisodeTracker(env)
    if "episodic_life" in wrappers:
        env = atari.EpisodicLife(env)
    if use_atari and atari.needs_fire_reset(env):
        env = atari.FireReset(env)
    if use_atari or "clip_reward" in wrappers:
        env = TransformReward(env, _sign)
    stack = wrappers.get("frame_stack", 4 if use_atari else 0)
    if stack:
        env = FrameStackObservation(env, stack)
    return env, tracker


# ---------------------------------------------------------------- spaces -> arrays


class _Leaf(NamedTuple):
    """One array of an observation: where it is in the env's value and what we store."""

    name: str
    path: tuple[Any, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    accepted: set  # source dtypes already checked to cast safely to ``dtype``


def _field_name(key: Any, where: str) -> str:
    if not (isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key)) or key.startswith("_"):
        raise ValueError(f"env: {where} Dict key {key!r} must be a Python identifier not starting with '_'")
    return key


def _children(space: spaces.Space, where: str) -> list[tuple[str, Any, spaces.Space]]:
    """(field name, key in the env's value, subspace) of a Dict (keys sorted) or Tuple."""
    if isinstance(space, spaces.Dict):
        return [(_field_name(k, where), k, space.spaces[k]) for k in sorted(space.spaces)]
    return [(f"f{j}", j, sub) for j, sub in enumerate(space.spaces)]


def leaf_dtype(space: spaces.Space, role: str) -> tuple[tuple[int, ...], np.dtype]:
    if isinstance(space, spaces.Box):
        kind = space.dtype.kind
        if kind == "f":
            return space.shape, np.dtype(np.float32)
        if kind == "b":
            return space.shape, np.dtype(np.uint8 if role == "Observation" else np.int8)
        return space.shape, space.dtype
    if isinstance(space, spaces.Discrete):
        return (), np.dtype(np.int64)
    if isinstance(space, spaces.MultiDiscrete):
        return space.nvec.shape, np.dtype(np.int64)
    if isinstance(space, spaces.MultiBinary):
        return tuple(space.shape), np.dtype(np.int8)
    raise ValueError(
        f"env: {role.lower()} space {space} is not supported "
        "(Box, Discrete, MultiDiscrete, MultiBinary, Dict, Tuple)"
    )


def space_example(space: spaces.Space, typename: str, role: str):
    """Zeros shaped and typed as one value of ``space`` (nested namedarraytuple for Dict/Tuple)."""
    if isinstance(space, (spaces.Dict, spaces.Tuple)):
        fields = _children(space, role.lower())
        cls = namedarraytuple(typename, [f for f, _, _ in fields])
        return cls(*(space_example(sub, f"{typename}_{f}", role) for f, _, sub in fields))
    shape, dtype = leaf_dtype(space, role)
    return np.zeros(shape, dtype=dtype)


def obs_leaves(space: spaces.Space, name: str = "observation", path: tuple = ()) -> list[_Leaf]:
    """The leaves of an observation in namedarraytuple field order (as ``leaves()`` walks)."""
    if isinstance(space, (spaces.Dict, spaces.Tuple)):
        return [
            leaf
            for f, key, sub in _children(space, "observation")
            for leaf in obs_leaves(sub, f"{name}.{f}", path + (key,))
        ]
    shape, dtype = leaf_dtype(space, "Observation")
    return [_Leaf(name, path, shape, dtype, set())]


def action_converter(space: spaces.Space, B: int, name: str = "action") -> Callable[[Any], list]:
    """A function from a ``[B, ...]`` action batch to the B values the envs expect."""
    if isinstance(space, (spaces.Dict, spaces.Tuple)):
        fields = _children(space, "action")
        convs = [action_converter(sub, B, f"{name}.{f}") for f, _, sub in fields]
        if isinstance(space, spaces.Dict):
            keys = [key for _, key, _ in fields]
            return lambda a: [dict(zip(keys, vals)) for vals in zip(*(c(x) for c, x in zip(convs, a)))]
        return lambda a: [tuple(vals) for vals in zip(*(c(x) for c, x in zip(convs, a)))]

    shape, dtype = leaf_dtype(space, "Action")
    batch_shape = (B,) + shape

    def checked(a) -> np.ndarray:
        a = np.asarray(a)
        if a.shape != batch_shape or (a.dtype.kind in "fc") != (dtype.kind in "fc"):
            raise ValueError(f"{name}: got {a.dtype}{list(a.shape)}, expected {dtype}{list(batch_shape)}")
        return a

    if isinstance(space, (spaces.Discrete, spaces.MultiDiscrete)):
        # numpy scalars/rows, as gymnasium's vector envs pass them: Discrete.contains checks a
        # numpy integer faster than a Python int, for which it builds an iinfo
        # (docs/benchmarks.md, "Sampling throughput").
        start = np.asarray(space.start, dtype=np.int64)
        return lambda a: list(checked(a) + start) if start.any() else list(checked(a))
    if isinstance(space, spaces.Box):
        low, high = space.low.astype(dtype), space.high.astype(dtype)
        clipped = np.empty(batch_shape, dtype=dtype)
        return lambda a: list(np.clip(checked(a), low, high, out=clipped))
    return lambda a: list(checked(a))


MAX_ABS_REWARD = MAX_RETURN
"""A reward beyond this (or NaN, or infinite) is an env failure: the bound replay's wire check
puts on an episode's return, which one such reward would break."""


def _non_finite(x: np.ndarray) -> bool:
    """Whether ``x`` (floating) holds a NaN or an infinity."""
    if x.size <= 16:  # classic control: a Python loop over a handful of floats beats any numpy call
        for v in x.flat:
            if not -np.inf < v < np.inf:  # False for NaN too
                return True
        return False
    if x.dtype.itemsize < 4:  # float16: its squares overflow from |x| = 256 on, and BLAS has no half type
        return not np.isfinite(x).all()
    # x.x is finite iff every element is (squares are >= 0, so infinities cannot cancel); one
    # BLAS call costs a third of isfinite().all(). It also overflows for finite |x| beyond ~1e19
    # in float32 (1e154 in float64): only then is x checked element by element.
    s = np.vdot(x, x)
    return not -np.inf < s < np.inf and not np.isfinite(x).all()


def reward_problem(reward: float) -> str | None:
    """What is wrong with a reward (NaN, infinite, beyond ``MAX_ABS_REWARD``), or None."""
    if reward != reward:
        return "reward is NaN"
    if not -MAX_ABS_REWARD <= reward <= MAX_ABS_REWARD:
        return f"reward is {reward!r} (not finite or beyond {MAX_ABS_REWARD:g})"
    return None


def check_observation(leaves: list[_Leaf], obs) -> list[np.ndarray] | str:
    """The leaves (``obs_leaves``) of one env observation as arrays, or what is wrong with it."""
    arrays = []
    for leaf in leaves:
        x = obs
        try:
            for key in leaf.path:
                x = x[key]
        except (KeyError, IndexError, TypeError):
            return f"{leaf.name} is missing from the observation {type(obs).__name__}"
        if type(x) is not np.ndarray:
            x = np.asarray(x)
        if x.shape != leaf.shape:
            return f"{leaf.name} has shape {x.shape}, expected {leaf.shape}"
        if x.dtype not in leaf.accepted:
            if not np.can_cast(x.dtype, leaf.dtype, "same_kind"):
                return f"{leaf.name} has dtype {x.dtype}, expected one that casts to {leaf.dtype}"
            leaf.accepted.add(x.dtype)
        if x.dtype.kind == "f" and _non_finite(x):
            return f"{leaf.name} contains NaN or an infinity"
        arrays.append(x)
    return arrays


def leaf_arrays(tree, B: int, n_leaves: int, what: str) -> list[np.ndarray]:
    arrays = [tree] if isinstance(tree, np.ndarray) else [x for _, x in leaves(tree)] if is_nat(tree) else []
    if len(arrays) != n_leaves or any(x.shape[:1] != (B,) for x in arrays):
        raise ValueError(f"EnvGroup: {what} must be a [B={B}, ...] buffer shaped like example_observation()")
    return arrays


# ---------------------------------------------------------------- the group


class SplitStep:
    """``send`` and ``recv`` over a group's ``step``, for groups whose envs step in this process
    (gymnasium's, PettingZoo's): the sampler's split-step protocol, as the EnvPool backend's,
    where here ``recv`` does the whole step."""

    _sent = None  # the actions of a split step in flight (send, then recv)

    def send(self, actions) -> None:
        """The first half of a split step: keeps (a reference to) ``actions`` for ``recv``, which
        steps the envs. Leave ``actions`` as they are until then."""
        if self._sent is not None:
            raise RuntimeError(f"{type(self).__name__}.send: the previous step was not received (call recv first)")
        self._sent = actions

    def recv(self, obs_out, reward_out, terminated_out, truncated_out, final_obs_out) -> list[tuple[int, float, int]]:
        """``step`` with the actions ``send`` kept: its outputs, return value and failures."""
        if self._sent is None:
            raise RuntimeError(f"{type(self).__name__}.recv: no step was sent")
        actions, self._sent = self._sent, None
        return self.step(actions, obs_out, reward_out, terminated_out, truncated_out, final_obs_out)


class EnvGroup(SplitStep):
    """B gymnasium envs stepped one after another, auto-reset, writing into [B, ...] arrays."""

    def __init__(self, cfg: EnvConfig, n_envs: int, base_seed: int,
                 make: Callable[[EnvConfig], tuple[gym.Env, EpisodeTracker]] = make_env):
        """``n_envs`` = B envs, each built by ``make(cfg)``; env i is seeded with ``base_seed + i``
        on the first reset."""
        validate_gymnasium(cfg)
        if n_envs < 1:
            raise ValueError(f"EnvGroup: n_envs must be >= 1, got {n_envs}")
        self.cfg = cfg
        self._make = make
        self.n_envs = n_envs
        self.base_seed = base_seed
        self._envs: list[gym.Env] = []
        self._trackers: list[EpisodeTracker] = []
        for _ in range(n_envs):
            env, tracker = make(cfg)
            self._envs.append(env)
            self._trackers.append(tracker)
        # The gymnasium spaces of the wrapped env (Atari: the stacked frames, not the screen).
        self.observation_space: spaces.Space = self._envs[0].observation_space
        self.action_space: spaces.Space = self._envs[0].action_space
        self._example_obs = space_example(self.observation_space, "Observation", "Observation")
        self._example_act = space_example(self.action_space, "Action", "Action")
        self._obs_leaves = obs_leaves(self.observation_space)
        self._to_env_actions = action_converter(self.action_space, n_envs)
        self._generation = [0] * n_envs
        self._seeded = False
        self._limit = StepLimit(cfg.step_timeout_s) if cfg.step_timeout_s else None
        self.padding = np.zeros(n_envs, bool)
        """Per column: its last step was padding, no transition (``PettingZooGroup``'s agents that left);
        never here, where every env is in an episode."""

    def example_observation(self):
        """One observation (no leading dims): ndarray, or namedarraytuple for Dict/Tuple."""
        return self._example_obs

    def example_action(self):
        """One action (no leading dims) in the form ``step`` takes."""
        return self._example_act

    def close(self) -> None:
        for env in self._envs:
            env.close()

    # -- internals

    def _describe(self, i: int, problem: str) -> str:
        return f"env {self.cfg.id!r} #{i}: {problem}"

    def _raise_failures(self, failures: list[tuple[int, str]], finished: list[tuple[int, float, int]],
                        failed_steps: tuple[int, ...] | None = None) -> None:
        if failures:
            message = "; ".join(self._describe(i, problem) for i, problem in failures)
            raise EnvError(message, tuple(i for i, _ in failures), finished, failed_steps)

    def _reset_env(self, i: int, seed: Optional[int]) -> list[np.ndarray] | str:
        """Called inside ``_limited()`` where a step limit is set."""
        limit = self._limit
        try:
            obs, _ = self._call(functools.partial(self._envs[i].reset, seed=seed))
        except Exception as e:  # noqa: BLE001 - any env failure is reported, not fatal
            return f"reset raised {first_line(e)}"
        except StepTimeout:
            return limit.problem("reset")
        return check_observation(self._obs_leaves, obs)

    def _call(self, fn, *args):
        """``fn(*args)``, an env call, timed where a step limit is set (inside ``_limited()``)."""
        return fn(*args) if self._limit is None else self._limit.call(fn, *args)

    def _limited(self):
        """The window in which env calls are timed (``env.step_timeout_s``): a batch step, a reset."""
        return self._limit if self._limit is not None else contextlib.nullcontext()

    # -- public

    def reset(self, obs_out) -> None:
        """Reset every env and write the B initial observations into ``obs_out[B, ...]``.

        The first call seeds env i with ``base_seed + i``; later calls continue the envs'
        random streams. Raises EnvError naming the envs that failed (the others are reset).
        """
        dst = leaf_arrays(obs_out, self.n_envs, len(self._obs_leaves), "obs_out")
        failures = []
        with self._limited():
            for i in range(self.n_envs):
                got = self._reset_env(i, None if self._seeded else self.base_seed + i)
                if isinstance(got, str):
                    failures.append((i, got))
                    continue
                for d, x in zip(dst, got):
                    d[i] = x
        self._seeded = True
        self._raise_failures(failures, [])

    def step(
        self, actions, obs_out, reward_out, terminated_out, truncated_out, final_obs_out
    ) -> list[tuple[int, float, int]]:
        """Step every env once and reset the ones whose episode ended.

        ``actions``: ``[B, ...]`` as ``example_action()``; Box actions are clipped to the
        bounds for the env (``actions`` is not changed) and reach it as rows of a buffer
        reused next step. Writes ``reward_out[B]`` (float,
        after reward wrappers), ``terminated_out[B]``, ``truncated_out[B]`` (bool),
        ``obs_out[B, ...]`` (the next observation: the reset one where an episode ended) and,
        where an episode ended, ``final_obs_out[i]`` (the last observation of the episode).

        Returns ``(env_index, episode_return, episode_length)`` for each game that ended:
        the true score (before reward clipping) and length in agent steps of the whole game
        (all lives under episodic life, where a life lost ends the training episode only).

        Raises EnvError after stepping all envs if some failed. For an env i whose step failed
        (``EnvError.failed_steps``; the sampler marks the step ``Samples.failed``):
        ``reward_out[i] = 0``, ``terminated_out[i] = False``, ``truncated_out[i] = True``,
        ``final_obs_out[i]`` = what ``obs_out[i]`` held before the step, ``obs_out[i]``
        unchanged; (if only its auto-reset failed, the step's outputs are real). Call
        ``recreate(i, obs_out)`` for each index in the error before the next step.

        With ``env.step_timeout_s``, a step (or auto-reset) that runs past it is interrupted and
        fails as one that raised.
        """
        if self._limit is None:
            return self._step(actions, obs_out, reward_out, terminated_out, truncated_out, final_obs_out)
        with self._limit:
            return self._step(actions, obs_out, reward_out, terminated_out, truncated_out, final_obs_out)

    def _step(self, actions, obs_out, reward_out, terminated_out, truncated_out, final_obs_out):
        B = self.n_envs
        n_leaves = len(self._obs_leaves)
        obs_dst = leaf_arrays(obs_out, B, n_leaves, "obs_out")
        final_dst = leaf_arrays(final_obs_out, B, n_leaves, "final_obs_out")
        env_actions = self._to_env_actions(actions)
        finished: list[tuple[int, float, int]] = []
        failures: list[tuple[int, str]] = []
        failed_steps: list[int] = []
        limit = self._limit
        for i, env in enumerate(self._envs):
            try:
                if limit is None:
                    obs, reward, terminated, truncated, _ = env.step(env_actions[i])
                else:
                    obs, reward, terminated, truncated, _ = limit.call(env.step, env_actions[i])
                reward = float(reward)
            except Exception as e:  # noqa: BLE001 - any env failure is reported, not fatal
                got = f"step raised {first_line(e)}"
            except StepTimeout:
                got = limit.problem("step")
            else:
                # One chained comparison per env step (False for NaN too); the message only on failure.
                got = (check_observation(self._obs_leaves, obs) if -MAX_ABS_REWARD <= reward <= MAX_ABS_REWARD
                       else reward_problem(reward))
            if isinstance(got, str):
                failures.append((i, got))
                failed_steps.append(i)
                reward_out[i], terminated_out[i], truncated_out[i] = 0.0, False, True
                for d, f in zip(obs_dst, final_dst):
                    f[i] = d[i]
                continue
            reward_out[i] = reward
            terminated_out[i] = terminated
            truncated_out[i] = truncated
            if terminated or truncated:
                for d, x in zip(final_dst, got):
                    d[i] = x
                game = self._trackers[i].finished
                if game is not None:
                    finished.append((i, game[0], game[1]))
                got = self._reset_env(i, None)
                if isinstance(got, str):
                    failures.append((i, got))
                    continue
            for d, x in zip(obs_dst, got):
                d[i] = x
        self._raise_failures(failures, finished, tuple(failed_steps))
        return finished

    def recreate(self, i: int, obs_out) -> None:
        """Close env i, build it anew, reset it and write its observation into ``obs_out[i]``.

        The k-th rebuild of env i is seeded with ``base_seed + i + k * B``, so a failure
        that its old seed led to is not replayed. Raises EnvError if the new env fails too
        (its build or reset raised or, with ``env.step_timeout_s``, ran past it; the old env's
        ``close()`` has the limit too, and one that fails is given up).
        """
        with self._limited():
            try:
                self._call(self._envs[i].close)
            except (Exception, StepTimeout):  # noqa: BLE001 - the old env is broken anyway; we only free it
                pass
            self._generation[i] += 1
            try:
                env, tracker = self._call(self._make, self.cfg)
            except Exception as e:  # noqa: BLE001 - reported as the env's failure
                raise EnvError(self._describe(i, f"after recreate: make raised {first_line(e)}"), (i,), []) from None
            except StepTimeout:
                raise EnvError(self._describe(i, f"after recreate: {self._limit.problem('make')}"), (i,), []) from None
            self._envs[i], self._trackers[i] = env, tracker
            got = self._reset_env(i, self.base_seed + i + self._generation[i] * self.n_envs)
        if isinstance(got, str):
            raise EnvError(self._describe(i, f"after recreate: {got}"), (i,), [])
        dst = leaf_arrays(obs_out, self.n_envs, len(self._obs_leaves), "obs_out")
        for d, x in zip(dst, got):
            d[i] = x
