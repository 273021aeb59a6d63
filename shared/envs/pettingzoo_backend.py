"""PettingZoo environments (``env.id = "pettingzoo:<module>"``): every (env, agent) pair is one
column of a sampler's batch, behind ``EnvGroup``'s interface and contract (``[B, ...]`` outputs,
terminated / truncated / final observation per column, a return and a length per agent's
episode, ``EnvError``), so that the sampler, replay and every algorithm take its steps unchanged.

``<module>`` is imported; one with ``parallel_env()`` is stepped through PettingZoo's Parallel API
(every live agent acts each step: MPE, butterfly, sisl), else its ``env()`` through the AEC API
(one agent acts a step: the classic board games). ``env.kwargs`` go to that constructor. All
agents must share one observation space and one action space (one shared policy acts for all of
them; ``env.groups``, below, relaxes the first); ``possible_agents`` order gives the columns: env k
of a group owns columns ``k * N .. k * N + N - 1`` (N agents), so ``sampler.envs`` counts columns
and is a multiple of N.
``env.agent_id`` adds the one-hot of the agent's index as the observation's ``agent_id`` leaf (a
Box observation becomes ``{"observation", "agent_id"}``). ``env.global_state`` adds the env's
``state()`` (shaped by its ``state_space``, a Box) as the ``global_state`` leaf, the same for
every column of an env at a step (the final observation's: the state the episode ended in);
a policy-gradient agent's value network reads it, its policy never does (``shared.agents.pg``).
``env.groups`` (group name -> fnmatch pattern of agent names, each agent in exactly one) adds each
column's group index, in the order the groups are given, as the ``agent_group`` leaf (int64, a
``Discrete(K)`` space), by which the agent routes the column to its group's networks
(``shared.agents.groups``). The agents then share one action space but may differ in the length
of a 1-D float Box observation (MPE's adversaries see less than the good agents): the column's
is the longest, a shorter one zero-padded at its end, so each group's network reads its own
agents' observations in their own layout (plus zeros). Agents of one group observe alike (one
network reads one layout); other groups' agents may differ.

What a column's step is, where its agent does not act:

- Waiting (AEC, not the agent's turn): a *pass*. The column's action mask (the env's
  ``action_mask``, required of AEC envs) allows action 0 only and the env never sees the action.
  It is a real step of the column: its reward is what the agent got from the others' moves (the
  opponent's winning move gives -1 there), and its observation is the position the agent waits
  in; so GAE and n-step targets carry the others' replies back to the agent's own move through
  the value of that position. The policy learns nothing there: with one legal action its
  log-probability is exactly 0 (``shared.agents.masking.MASKED_LOGIT``), so is its gradient and
  its entropy, and a Q agent's bootstrap picks the pass. (Masking the wait as ``failed`` would
  drop the opponent's reply from the agent's returns.) Its length counts the agent's own moves.
- Gone (the agent's episode ended while others play on, in either API): padding. The column is
  marked as the sampler marks a failed env step (``EnvGroup.padding``, which the sampler copies
  into ``Samples.failed``): truncated, reward 0, final observation = observation, no loss
  trains on it and no return crosses it, until the env resets and every column starts anew.

Seeds: env k is seeded ``base_seed + k * N`` (its first column's index, so no two envs of a
run share one) on the first reset; later resets continue its random stream.
"""

from __future__ import annotations

import fnmatch
import importlib
from typing import Any, NamedTuple

import numpy as np
from gymnasium import spaces

from shared.envs.group import (EnvConfig, EnvError, SplitStep, action_converter, check_common, check_observation,
                               first_line, leaf_arrays, obs_leaves, reward_problem, space_example)

PREFIX = "pettingzoo:"
MASK_KEY = "action_mask"
AGENT_ID_KEY = "agent_id"
STATE_KEY = "global_state"
"""The observation leaf of the env's global state (``env.global_state``); the key
``shared.agents.pg`` keeps from the policy."""
GROUP_KEY = "agent_group"
"""The observation leaf of the column's agent group (``env.groups``): its index, which
``shared.agents.groups`` routes by and no network reads as a feature."""
PASS = 0
"""The one legal action of a waiting column (the env never sees it)."""


def is_pettingzoo(cfg: EnvConfig) -> bool:
    return cfg.id.startswith(PREFIX)


def _module(cfg: EnvConfig):
    name = cfg.id[len(PREFIX):]
    if not name:
        raise ValueError(f"env.id = {cfg.id!r}: name the env's module, e.g. 'pettingzoo:pettingzoo.classic.tictactoe_v3'")
    try:
        module = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - whatever the import raises, it is this field's error
        raise ValueError(f"env.id = {cfg.id!r}: cannot import module {name!r} ({first_line(e)}); "
                         "give a PettingZoo env module such as 'pettingzoo.classic.tictactoe_v3'") from None
    if not (callable(getattr(module, "parallel_env", None)) or callable(getattr(module, "env", None))):
        raise ValueError(f"env.id = {cfg.id!r}: module {name!r} has neither parallel_env() nor env(); "
                         "give a PettingZoo env module")
    return module


def _make_raw(cfg: EnvConfig, kwargs: dict[str, Any]):
    """(the PettingZoo env, whether it is a Parallel one)."""
    module = _module(cfg)
    parallel = callable(getattr(module, "parallel_env", None))
    try:
        return (module.parallel_env if parallel else module.env)(**kwargs), parallel
    except Exception as e:  # noqa: BLE001 - a bad kwarg or a broken env: this config's error
        raise ValueError(f"env.kwargs: {cfg.id!r} cannot be built with {kwargs} ({first_line(e)})") from None


def agent_groups(cfg: EnvConfig, agents: list[str]) -> list[int]:
    """Each agent's group index (``env.groups``, in the order given); ValueError (one line) for a
    pattern that matches no agent, or an agent in no group or in two."""
    names, patterns = list(cfg.groups), list(cfg.groups.values())
    for pattern in patterns:
        if not fnmatch.filter(agents, pattern):
            raise ValueError(f"env.groups: {pattern!r} matches no agent of {cfg.id!r} (agents: {', '.join(agents)})")
    out = []
    for a in agents:
        hits = [k for k, pattern in enumerate(patterns) if fnmatch.fnmatchcase(a, pattern)]
        if len(hits) != 1:
            which = "no group" if not hits else " and ".join(f"{names[k]} ({patterns[k]!r})" for k in hits)
            raise ValueError(f"env.groups: agent {a!r} of {cfg.id!r} is in {which}; every agent must be in exactly "
                             "one group")
        out.append(hits[0])
    return out


def _flat_box(space: spaces.Space) -> bool:
    return isinstance(space, spaces.Box) and len(space.shape) == 1 and np.issubdtype(space.dtype, np.floating)


def _padded(boxes: list[spaces.Box]) -> spaces.Box:
    """The 1-D float Box that holds each of ``boxes`` zero-padded at its end to the longest."""
    width = max(b.shape[0] for b in boxes)
    low, high = np.zeros(width, np.float32), np.zeros(width, np.float32)
    for b in boxes:
        n = b.shape[0]
        low[:n], high[:n] = np.minimum(low[:n], b.low), np.maximum(high[:n], b.high)
    return spaces.Box(low, high, dtype=np.float32)


class Layout(NamedTuple):
    """How an env's agents become columns (``_spaces``)."""
    agents: list[str]
    observation_space: spaces.Space
    """A column's: the agent's observation with the leaves the config adds."""
    action_space: spaces.Space
    masked: bool
    """The observation holds an action mask."""
    group_of: np.ndarray | None
    """Each agent's group index (``env.groups``), int64 [N], or None without groups."""
    pad_to: int
    """The column observation's length where agents' observations are zero-padded to it, else 0."""


def _spaces(cfg: EnvConfig, raw, parallel: bool) -> Layout:
    """The column layout of ``raw``'s agents; ValueError (one line naming the field) for an env
    one shared policy (or, with ``env.groups``, one network layout) cannot act in."""
    agents = list(raw.possible_agents)
    if not agents:
        raise ValueError(f"env.id = {cfg.id!r}: the env has no agents")
    groups = agent_groups(cfg, agents) if cfg.groups else None
    obs_space, act_space = raw.observation_space(agents[0]), raw.action_space(agents[0])
    own = [raw.observation_space(a) for a in agents]
    for a, space in zip(agents[1:], own[1:]):
        fits = space == obs_space or groups is not None and _flat_box(space) and _flat_box(obs_space)
        if not fits or raw.action_space(a) != act_space:
            raise ValueError(f"env.id = {cfg.id!r}: agent {a!r} has other observation or action spaces than "
                             f"{agents[0]!r}; one shared policy needs the same for all agents" +
                             ("" if groups is None else " (with env.groups: one action space, and observations "
                              "the same or 1-D float Boxes of any length)"))
    for a, g, space in zip(agents, groups or (), own):  # one network reads one layout
        first = groups.index(g)
        if space != own[first]:
            raise ValueError(f"env.groups: {agents[first]!r} and {a!r} of {cfg.id!r} are both in group "
                             f"{list(cfg.groups)[g]!r} but observe {own[first]} and {space}; one group's network "
                             "reads one observation layout: give them groups of their own")
    pad_to = 0
    if any(space != obs_space for space in own):
        obs_space = _padded(own)
        pad_to = obs_space.shape[0]
    masked = isinstance(obs_space, spaces.Dict) and MASK_KEY in obs_space.spaces
    if not parallel and not masked:
        raise ValueError(f"env.id = {cfg.id!r}: a turn-based (AEC) env must give an {MASK_KEY!r} in a Dict "
                         "observation (waiting agents pass through it)")
    if masked and not isinstance(act_space, spaces.Discrete):
        raise ValueError(f"env.id = {cfg.id!r}: an {MASK_KEY!r} needs a Discrete action space, not {act_space}")
    fields = dict(obs_space.spaces) if isinstance(obs_space, spaces.Dict) else {"observation": obs_space}
    if masked:  # the classic games' int8 Box(0, 1): the masking code reads 0/1 leaves as MultiBinary
        fields[MASK_KEY] = spaces.MultiBinary(int(act_space.n))
    if cfg.agent_id:
        fields[AGENT_ID_KEY] = spaces.Box(0.0, 1.0, (len(agents),), np.float32)
    if groups is not None:
        if GROUP_KEY in fields:
            raise ValueError(f"env.groups: {cfg.id!r}'s observations have a {GROUP_KEY!r} key already")
        fields[GROUP_KEY] = spaces.Discrete(len(cfg.groups))
    if cfg.global_state:
        fields[STATE_KEY] = _state_space(cfg, raw, obs_space)
    if isinstance(obs_space, spaces.Dict) or len(fields) > 1:
        obs_space = spaces.Dict(fields)
    return Layout(agents, obs_space, act_space, masked, None if groups is None else np.asarray(groups, np.int64), pad_to)


def _state_space(cfg: EnvConfig, raw, obs_space: spaces.Space) -> spaces.Box:
    """The env's ``state_space``; ValueError (one line naming ``env.global_state``) if it has none."""
    space = getattr(raw, "state_space", None)
    if not isinstance(space, spaces.Box):
        raise ValueError(f"env.global_state = true: {cfg.id!r} gives no global state (a Box state_space and a "
                         "state()); set it false")
    if isinstance(obs_space, spaces.Dict) and STATE_KEY in obs_space.spaces:
        raise ValueError(f"env.global_state = true: {cfg.id!r}'s observations have a {STATE_KEY!r} key already")
    return space


def validate_pettingzoo(cfg: EnvConfig) -> None:
    """Raise ValueError (one line naming the field) if ``cfg``'s PettingZoo env cannot be stepped
    here: a module that is no PettingZoo env, bad kwargs, agents with different spaces, an
    ``env.global_state`` the env does not give."""
    kwargs, wrappers = check_common(cfg)
    if wrappers:
        raise ValueError(f"env.wrappers: {', '.join(cfg.wrappers)} are gymnasium wrappers; a PettingZoo env takes none")
    for name, value in (("env.threads", cfg.threads), ("env.max_episode_steps", cfg.max_episode_steps),
                        ("env.step_timeout_s", cfg.step_timeout_s)):
        if value:
            raise ValueError(f"{name} = {value}: not supported for PettingZoo envs; leave it 0 "
                             "(set the env's own limit in env.kwargs, e.g. max_cycles)")
    if cfg.split_step == "on":
        raise ValueError("env.split_step = 'on': PettingZoo envs step in the sampler's own thread; leave it 'auto'")
    raw, parallel = _make_raw(cfg, kwargs)
    try:
        _spaces(cfg, raw, parallel)
        if cfg.global_state:  # PettingZoo's base state() raises NotImplementedError: call it once
            raw.reset(seed=0)
            try:
                raw.state()
            except Exception as e:  # noqa: BLE001 - whatever it raises, the env gives no state
                raise ValueError(f"env.global_state = true: {cfg.id!r}'s state() raised {first_line(e)}; "
                                 "set it false") from None
    finally:
        raw.close()


def not_two_player_game(cfg: EnvConfig) -> str | None:
    """Why ``cfg`` is no two-player turn-based PettingZoo game (the AEC API with an action mask: the
    classic board games), in words that follow "env.id = ...", or None when it is one."""
    if not is_pettingzoo(cfg):
        return "is a single-agent env"
    raw, parallel = _make_raw(cfg, check_common(cfg)[0])
    try:
        agents = len(raw.possible_agents)
    finally:
        raw.close()
    if parallel or agents != 2:
        return f"has {agents} agents{' acting together (the Parallel API)' if parallel else ''}"
    return None


def check_two_player_game(cfg: EnvConfig, what: str) -> None:
    """Raise ValueError (one line naming ``what`` and the env) unless ``cfg`` is a two-player
    turn-based PettingZoo game."""
    why = not_two_player_game(cfg)
    if why is not None:
        raise ValueError(f"{what}: needs a two-player turn-based PettingZoo game; env.id = {cfg.id!r} {why}")


def not_copyable_game(cfg: EnvConfig) -> str | None:
    """Why the heuristic player cannot look ahead in ``cfg``'s game (``players.copy_game`` fails on
    its first position), or None where it can."""
    from shared.envs.players import NotCopyable, copy_game

    raw, _ = _make_raw(cfg, check_common(cfg)[0])
    try:
        raw.reset(seed=0)
        copy_game(raw)
    except NotCopyable as e:
        return str(e)
    finally:
        raw.close()
    return None


ZERO_SUM_GAMES = 4
ZERO_SUM_MOVES = 2000
"""The random games (and the most moves over them) ``not_zero_sum_game`` plays."""


def not_zero_sum_game(cfg: EnvConfig) -> str | None:
    """Why ``cfg`` is no two-player zero-sum turn-based game, in words that follow "env.id = ...",
    or None when it may be one. PettingZoo declares no zero-sum flag, so the rule is: a two-player
    turn-based game (``not_two_player_game``) whose two agents' rewards sum to 0 after every move
    of ``ZERO_SUM_GAMES`` uniformly random games (at most ``ZERO_SUM_MOVES`` moves in all). A
    probe can show that a game is not zero-sum, not that it is: a game whose rewards only differ
    from zero-sum in positions random play does not reach passes."""
    why = not_two_player_game(cfg)
    if why is not None:
        return why
    raw, _ = _make_raw(cfg, check_common(cfg)[0])
    rng = np.random.default_rng(0)
    moves = 0
    try:
        for game in range(ZERO_SUM_GAMES):
            raw.reset(seed=game)
            while raw.agents and moves < ZERO_SUM_MOVES:
                mover = raw.agent_selection
                if raw.terminations.get(mover) or raw.truncations.get(mover):
                    raw.step(None)
                else:
                    raw.step(int(rng.choice(np.flatnonzero(raw.observe(mover)[MASK_KEY]))))
                    moves += 1
                total = float(sum(raw.rewards.values()))
                if abs(total) > 1e-6:
                    return (f"is not zero-sum: its agents' rewards summed to {total:g} after move {moves} of random "
                            "play")
    finally:
        raw.close()
    return None


def columns_per_env(cfg: EnvConfig) -> int:
    """The batch columns one env of ``cfg`` takes: its N agents (1 for a single-agent env)."""
    if not is_pettingzoo(cfg):
        return 1
    raw, _ = _make_raw(cfg, check_common(cfg)[0])
    try:
        return len(raw.possible_agents)
    finally:
        raw.close()


class PettingZooGroup(SplitStep):
    """B columns = B / N PettingZoo envs of N agents each, stepped one after another, auto-reset,
    writing into [B, ...] arrays (``EnvGroup``'s contract; see the module docstring)."""

    def __init__(self, cfg: EnvConfig, n_envs: int, base_seed: int):
        """``n_envs`` = B columns, a multiple of the env's N agents; env k is seeded with
        ``base_seed + k * N`` on the first reset."""
        validate_pettingzoo(cfg)
        self.cfg, self.n_envs, self.base_seed = cfg, n_envs, base_seed
        self._kwargs = check_common(cfg)[0]
        first, self._parallel = _make_raw(cfg, self._kwargs)
        layout = _spaces(cfg, first, self._parallel)
        self.agents, self.observation_space, self.action_space = layout.agents, layout.observation_space, \
            layout.action_space
        self._masked, self._group_of, self._pad_to = layout.masked, layout.group_of, layout.pad_to
        self._column_of = {a: j for j, a in enumerate(self.agents)}
        """agent -> its column j within an env's N columns: looked up per agent every step."""
        N = len(self.agents)
        if n_envs < N or n_envs % N:
            first.close()
            raise ValueError(f"sampler.envs: {cfg.id!r} has {N} agents, each one column; a group of {n_envs} columns "
                             f"is no multiple of {N}")
        self._raws = [first] + [_make_raw(cfg, self._kwargs)[0] for _ in range(n_envs // N - 1)]
        self._example_obs = space_example(self.observation_space, "Observation", "Observation")
        self._example_act = space_example(self.action_space, "Action", "Action")
        self._obs_leaves = obs_leaves(self.observation_space)
        self._to_env_actions = action_converter(self.action_space, n_envs)
        self._one_hot = np.eye(N, dtype=np.float32)
        if self._masked:
            self._pass_mask = np.zeros(int(self.action_space.n), np.int8)
            self._pass_mask[PASS] = 1
        self.padding = np.zeros(n_envs, bool)
        """Per column: its last step was padding (its agent gone), no transition; see the module docstring."""
        self._gone = np.zeros(n_envs, bool)  # the column's agent left its episode; padding until the env resets
        self._return = np.zeros(n_envs, np.float64)
        self._length = np.zeros(n_envs, np.int64)
        self._generation = [0] * len(self._raws)
        self._seeded = False

    def example_observation(self):
        """One column's observation (no leading dims): ndarray, or namedarraytuple for a Dict."""
        return self._example_obs

    def example_action(self):
        """One column's action (no leading dims) in the form ``step`` takes."""
        return self._example_act

    def game(self, k: int):
        """Env k's PettingZoo env (columns ``k * N ..``), in a live state between steps: an env
        whose episode ended is reset within the step that ended it. For reading it, or for a
        scripted player to choose a move on (``shared.envs.players``); the group steps it."""
        return self._raws[k]

    def close(self) -> None:
        for raw in self._raws:
            raw.close()

    # -- internals

    def _columns(self, k: int) -> range:
        N = len(self.agents)
        return range(k * N, (k + 1) * N)

    def _column_obs(self, obs, j: int, to_move: bool, state) -> dict | Any:
        """Agent j's observation as the column presents it (mask of a waiting agent: the pass),
        with the env's global ``state`` (None without ``env.global_state``)."""
        if isinstance(self.observation_space, spaces.Dict):
            out = dict(obs) if isinstance(obs, dict) else {"observation": self._padded(obs)}
            if self._masked and not to_move:
                out[MASK_KEY] = self._pass_mask
            if self.cfg.agent_id:
                out[AGENT_ID_KEY] = self._one_hot[j]
            if state is not None:
                out[STATE_KEY] = state
            if self._group_of is not None:
                out[GROUP_KEY] = self._group_of[j]
            return out
        return obs

    def _padded(self, obs):
        """A Box observation zero-padded at its end to the column's length (``env.groups`` with agents
        whose observations differ in length); as it is otherwise."""
        if not self._pad_to or np.shape(obs)[0] == self._pad_to:
            return obs
        return np.pad(np.asarray(obs, np.float32), (0, self._pad_to - np.shape(obs)[0]))

    def _state(self, k: int):
        """Env k's global state now, or None without ``env.global_state``."""
        return self._raws[k].state() if self.cfg.global_state else None

    def _observations(self, k: int, state) -> dict[str, Any]:
        """agent -> its current column observation of env k (agents still in the episode), with
        the env's ``state`` (``_state``)."""
        raw = self._raws[k]
        if self._parallel:
            return {a: self._column_obs(o, self._column_of[a], True, state) for a, o in self._last_obs[k].items()}
        return {a: self._column_obs(raw.observe(a), j, a == raw.agent_selection and not self._over(k), state)
                for j, a in enumerate(self.agents) if a in raw.agents}

    def _over(self, k: int) -> bool:
        """Whether every agent of env k has left its episode."""
        raw = self._raws[k]
        if self._parallel:
            return not raw.agents
        return all(raw.terminations.get(a, True) or raw.truncations.get(a, True) for a in raw.agents)

    def _write(self, dst: list[np.ndarray], i: int, obs, where: str) -> None:
        got = check_observation(self._obs_leaves, obs)
        if isinstance(got, str):
            raise _Broken(f"{where}: {got}")
        for d, x in zip(dst, got):
            d[i] = x

    def _reset_env(self, k: int, seed: int | None, dst: list[np.ndarray]) -> None:
        raw = self._raws[k]
        if self._parallel:
            obs, _ = raw.reset(seed=seed)
            self._last_obs[k] = obs
        else:
            raw.reset(seed=seed)
        cols = self._columns(k)
        self._gone[cols.start:cols.stop] = False
        self._return[cols.start:cols.stop] = 0.0
        self._length[cols.start:cols.stop] = 0
        current = self._observations(k, self._state(k))
        for j, i in enumerate(cols):
            self._write(dst, i, current[self.agents[j]], "reset")

    def _step_env(self, k: int, env_actions: list, dst, final_dst, reward_out, terminated_out, truncated_out,
                  finished: list) -> None:
        """Step env k once; its columns' outputs as ``step`` documents."""
        raw, cols = self._raws[k], self._columns(k)
        if self._parallel:
            live = list(raw.agents)
            obs, rewards, terms, truncs, _ = raw.step({a: env_actions[cols[self._column_of[a]]] for a in live})
            self._last_obs[k] = {a: o for a, o in obs.items() if not (terms.get(a) or truncs.get(a))}
            moved = set(live)
        else:
            mover = raw.agent_selection
            raw.step(env_actions[cols[self._column_of[mover]]])
            # A turn-based env hands the turn to agents that left so that they can be removed.
            while raw.agents and not self._over(k) and (raw.terminations[raw.agent_selection]
                                                        or raw.truncations[raw.agent_selection]):
                raw.step(None)
            obs = {a: raw.observe(a) for a in self.agents if a in raw.agents}
            rewards, terms, truncs = raw.rewards, raw.terminations, raw.truncations
            moved = {mover}
        state = self._state(k)
        current = self._observations(k, state)
        for j, a in enumerate(self.agents):
            i = cols[j]
            if self._gone[i]:
                self.padding[i] = True
                reward_out[i], terminated_out[i], truncated_out[i] = 0.0, False, True
                for d, f in zip(dst, final_dst):
                    f[i] = d[i]
                continue
            reward = float(rewards.get(a, 0.0))
            problem = reward_problem(reward)
            if problem is not None:
                raise _Broken(f"agent {a!r}: {problem}")
            term, trunc = bool(terms.get(a, True)), bool(truncs.get(a, False))
            reward_out[i], terminated_out[i], truncated_out[i] = reward, term, trunc
            self._return[i] += reward
            self._length[i] += a in moved
            if term or trunc:
                final = self._column_obs(obs[a], j, False, state) if a in obs else current.get(a)
                # Its padding steps (until the env resets) are taken in its last observation.
                self._write(final_dst, i, final, "step")
                self._write(dst, i, final, "step")
                finished.append((i, float(self._return[i]), int(self._length[i])))
                self._gone[i] = True
            else:
                self._write(dst, i, current[a], "step")
        if self._over(k):
            self._reset_env(k, None, dst)

    # -- public

    def reset(self, obs_out) -> None:
        """Reset every env and write the B initial observations into ``obs_out[B, ...]``; the first
        call seeds env k with ``base_seed + k * N``. Raises EnvError naming the envs that failed."""
        dst = leaf_arrays(obs_out, self.n_envs, len(self._obs_leaves), "obs_out")
        self._last_obs: list[dict] = [{} for _ in self._raws]
        failures = []
        for k in range(len(self._raws)):
            try:
                self._reset_env(k, None if self._seeded else self.base_seed + self._columns(k).start, dst)
            except Exception as e:  # noqa: BLE001 - any env failure is reported, not fatal
                failures.append((k, f"reset raised {first_line(e)}"))
        self._seeded = True
        self._raise(failures, [])

    def step(self, actions, obs_out, reward_out, terminated_out, truncated_out, final_obs_out
             ) -> list[tuple[int, float, int]]:
        """Step every env once (``EnvGroup.step``'s contract, per column) and reset those whose
        agents have all left. ``self.padding[i]`` says whether column i's step was padding.

        Returns ``(column, episode_return, episode_length)`` for each agent whose episode ended:
        the sum of its rewards and the count of its own moves. An env that raised or returned a
        bad value fails all its columns (``EnvError``: its first column in ``env_indices``,
        ``recreate`` rebuilds the whole env; all its columns in ``failed_steps``)."""
        B, n_leaves = self.n_envs, len(self._obs_leaves)
        dst = leaf_arrays(obs_out, B, n_leaves, "obs_out")
        final_dst = leaf_arrays(final_obs_out, B, n_leaves, "final_obs_out")
        env_actions = self._to_env_actions(actions)
        self.padding[:] = False
        finished: list[tuple[int, float, int]] = []
        failures: list[tuple[int, str]] = []
        for k in range(len(self._raws)):
            done_before = len(finished)
            try:
                self._step_env(k, env_actions, dst, final_dst, reward_out, terminated_out, truncated_out, finished)
            except Exception as e:  # noqa: BLE001 - any env failure is reported, not fatal
                del finished[done_before:]
                failures.append((k, f"step raised {first_line(e)}" if not isinstance(e, _Broken) else str(e)))
                for i in self._columns(k):
                    reward_out[i], terminated_out[i], truncated_out[i] = 0.0, False, True
                    for d, f in zip(dst, final_dst):
                        f[i] = d[i]
        self._raise(failures, finished, failed_steps=True)
        return finished

    def recreate(self, i: int, obs_out) -> None:
        """Close the env of column i, build it anew, reset it (its k-th rebuild seeded
        ``base_seed + first column + k * B``) and write its columns' observations into ``obs_out``."""
        N = len(self.agents)
        k = i // N
        try:
            self._raws[k].close()
        except Exception:  # noqa: BLE001 - the old env is broken anyway; we only free it
            pass
        self._generation[k] += 1
        self._raws[k] = _make_raw(self.cfg, self._kwargs)[0]
        dst = leaf_arrays(obs_out, self.n_envs, len(self._obs_leaves), "obs_out")
        try:
            self._reset_env(k, self.base_seed + k * N + self._generation[k] * self.n_envs, dst)
        except Exception as e:  # noqa: BLE001 - the new env fails too: the sampler's error
            raise EnvError(self._describe(k, f"after recreate: {first_line(e)}"), (i,), []) from None

    def _describe(self, k: int, problem: str) -> str:
        return f"env {self.cfg.id!r} #{k} (columns {self._columns(k).start}..{self._columns(k).stop - 1}): {problem}"

    def _raise(self, failures: list[tuple[int, str]], finished: list, failed_steps: bool = False) -> None:
        if failures:
            message = "; ".join(self._describe(k, p) for k, p in failures)
            firsts = tuple(self._columns(k).start for k, _ in failures)
            steps = tuple(i for k, _ in failures for i in self._columns(k)) if failed_steps else None
            raise EnvError(message, firsts, finished, steps)


class _Broken(Exception):
    """An env returned a bad value (reward, observation); the message says which."""
