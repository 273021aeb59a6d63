"""The EnvPool backend (``env.backend = "envpool"``): one call into EnvPool's C++ thread pool
steps a sampler's whole env batch, behind ``EnvGroup``'s interface and contract (spaces,
example observation and action, ``reset``/``step``/``recreate``/``close``, the ``[B, ...]``
outputs, the true game's returns and lengths, ``EnvError``), so that replay, the frame store,
n-step and sequence tables, GAE and every algorithm take its steps unchanged.

Ids: EnvPool's own task names (``CartPole-v1``, ``Pendulum-v1``, ``HalfCheetah-v5``,
``Pong-v5``...), and ``ALE/Name-v5`` for EnvPool's ``Name-v5`` so that a config switches
backend with one line. Observations must be one Box, actions Discrete or Box (EnvPool's
dict-observation tasks need the gymnasium backend).

Autoreset. EnvPool's gymnasium API resets an env whose episode ended on the *next* call that
names it, ignoring that call's action. ``step`` makes that call at once for the envs that
ended (one more call into the pool, only on steps where an episode ended), so one ``step``
gives, as EnvGroup's does, the episode's last observation in ``final_obs_out`` and the next
episode's first in ``obs_out``. (An explicit ``reset(env_id)`` would restart the whole game
after a life lost under episodic life; EnvPool's own autoreset continues it.)

Split-phase steps. ``send`` hands the actions to the pool and returns while its C++ threads
step the envs (the GIL released); ``recv`` waits for them and does the rest of ``step``
(``step`` is the two in a row). The pool stays in sync mode (``batch_size = num_envs``), so
``recv`` answers every env of the group, in env-index order: a pool with ``batch_size <
num_envs`` answers whichever envs finish first, and the sampler's segments need a fixed
column per env. The alternating sampler keeps one pool per env group and overlaps them
(``env.split_step``, docs/architecture.md, "Env backends").

Returns and lengths. The pool runs without reward clipping: rewards are summed here per env
(the game's score) and clipped to their sign afterwards when the wrappers ask for it; a
length counts the agent steps of the whole game (every life under episodic life).

Atari (the ``atari`` wrapper, required: EnvPool always preprocesses the screen) maps onto
EnvPool's options: noop reset (``noop_max`` 30), frame skip 4 with a max-pool over the last two
frames, 84x84 grey (INTER_AREA, as gymnasium's AtariPreprocessing), ``stack_num`` 4 (or
``frame_stack:N``) channels first, fire reset, ``episodic_life`` when listed; reward clipping
here. What still differs from the gymnasium backend's wrappers:

- Fire reset presses FIRE only (ours: FIRE, then RIGHT as baselines does), and EnvPool's reset
  steps count in no game length (ours count the two presses).
- After a life lost under episodic life, EnvPool continues the game without a no-op step (ours
  spends one, counted in the length) and its frame stack keeps the earlier life's frames where
  ours starts afresh, repeating the first frame. The frame store, which rebuilds stacks that
  restart at each episode start, skips the K - 1 steps after each life lost.
- Sticky actions: ``ALE/Name-v5`` gets ALE v5's ``repeat_action_probability`` 0.25 unless
  ``env.kwargs`` sets it; EnvPool's own names keep EnvPool's default 0. ``frameskip`` 1 in
  kwargs (what the gymnasium backend's ``atari`` needs) is accepted and means nothing here.
- The truncation limit counts agent steps (27000 by default, ALE v5's 108k frames) in both.

Any env: a step that both ends the episode and reaches ``max_episode_steps`` is a truncation
only (EnvPool reports ``terminated = done and not truncated``; gymnasium reports both), so
that one step bootstraps from the final observation where gymnasium's would not.

Seeds. EnvPool takes one seed per env: env i gets ``base_seed + i``, the numbers the gymnasium
backend uses, but EnvPool's own generators, so start states differ from gymnasium's for the
same seed; two pools with the same seeds play the same episodes for the same actions. Later
resets continue each env's stream. One env of a pool cannot be reseeded: ``recreate(i)`` after
a bad value resets env i (its stream continues); after the pool itself raised it is rebuilt
whole, env j seeded ``base_seed + j + k * B`` on its k-th rebuild.
"""

from __future__ import annotations

import difflib
import os
import warnings
from typing import Any, Callable

import numpy as np
from gymnasium import spaces

from shared.envs.group import (MAX_ABS_REWARD, EnvConfig, EnvError, check_common, first_line, leaf_arrays,
                               leaf_dtype, space_example)

ALE_PREFIX = "ALE/"
ALE_V5_STICKY = 0.25
"""ALE v5's repeat_action_probability, given to ``ALE/Name-v5`` ids (EnvPool's default is 0)."""

# Options rlpipe sets itself (from the env section, the group's size and its seeds).
_SET_HERE = {
    "num_envs": "the sampler's envs", "batch_size": "the sampler's envs", "num_threads": "env.threads",
    "seed": "run.seed", "env_seed": "run.seed", "max_episode_steps": "env.max_episode_steps",
    "stack_num": "the 'atari' and 'frame_stack:N' wrappers", "episodic_life": "the 'episodic_life' wrapper",
    "reward_clip": "the 'clip_reward' and 'atari' wrappers", "max_num_players": "one player",
    "thread_affinity_offset": "no pinning", "gym_reset_return_info": "gymnasium's reset",
    "base_path": "EnvPool's installation",
}

MakePool = Callable[..., Any]
"""``make_pool(task_id, **options)`` -> an EnvPool gymnasium pool (``envpool.make_gymnasium``)."""


def _envpool():
    try:
        import envpool
    except ImportError:
        raise ValueError("env.backend = 'envpool': the envpool package is not installed (pip install envpool); "
                         "or set env.backend = 'gymnasium'") from None
    return envpool


def task_id(env_id: str) -> str:
    """EnvPool's name for ``env_id`` (``ALE/Pong-v5`` -> ``Pong-v5``)."""
    return env_id[len(ALE_PREFIX):] if env_id.startswith(ALE_PREFIX) else env_id


def _is_atari(envpool, task: str) -> bool:
    return envpool.registration.registry.specs[task][0] == "envpool.atari"


def pool_options(cfg: EnvConfig) -> tuple[str, dict[str, Any], bool]:
    """(EnvPool task id, its options except num_envs/seeds/threads, whether rewards are clipped
    here) for ``cfg``; ValueError (one line naming the field, the backend and what it lacks)
    for what EnvPool cannot provide."""
    kwargs, wrappers = check_common(cfg)
    if ":" in cfg.id:
        raise ValueError(f"env.id = {cfg.id!r}: env.backend = 'envpool' cannot build a 'module:callable' env "
                         "(EnvPool runs only its own C++ envs); set env.backend = 'gymnasium'")
    envpool = _envpool()
    task = task_id(cfg.id)
    known = envpool.list_all_envs()
    if task not in known:
        close = difflib.get_close_matches(task, known, n=5, cutoff=0.6)
        hint = f"close EnvPool ids: {', '.join(close)}" if close else "no close EnvPool id"
        raise ValueError(f"env.id: env.backend = 'envpool' has no env {cfg.id!r} ({hint}); "
                         "set env.backend = 'gymnasium' for gymnasium's envs")
    atari = _is_atari(envpool, task)
    options: dict[str, Any] = {}
    if atari:
        if "atari" not in wrappers:
            raise ValueError(f"env.wrappers: env.backend = 'envpool' always preprocesses {cfg.id}'s screen (frame skip, "
                             "84x84 grey, frame stack); list 'atari', or set env.backend = 'gymnasium' for raw frames")
        if kwargs.get("frameskip", 1) != 1:
            raise ValueError("env.kwargs: 'atari' does its own frame skip; leave frameskip out or set it to 1")
        kwargs.pop("frameskip", None)
        options.update(stack_num=wrappers.get("frame_stack", 4), episodic_life="episodic_life" in wrappers)
        if cfg.id.startswith(ALE_PREFIX):
            options["repeat_action_probability"] = ALE_V5_STICKY
    else:
        ale_only = [w for w in ("atari", "episodic_life") if w in wrappers]
        if ale_only:
            raise ValueError(f"env.wrappers: {', '.join(ale_only)} only work with an Atari env, not {cfg.id!r}")
        if "frame_stack" in wrappers:
            raise ValueError(f"env.wrappers: env.backend = 'envpool' stacks frames of Atari envs only (EnvPool's "
                             f"stack_num), not of {cfg.id!r}; set env.backend = 'gymnasium' for frame_stack:N")
    own = envpool.make_spec(task).config._fields
    for key in kwargs:
        if key in _SET_HERE:
            raise ValueError(f"env.kwargs: {key!r} is set by rlpipe on env.backend = 'envpool' ({_SET_HERE[key]}), "
                             "not by kwargs")
        if key not in own:
            allowed = ", ".join(k for k in own if k not in _SET_HERE) or "none"
            raise ValueError(f"env.kwargs: env.backend = 'envpool' has no option {key!r} for {task}; its options: "
                             f"{allowed}")
    options.update(kwargs)
    if "reward_clip" in own:
        options["reward_clip"] = False  # clipped here, after the true score is summed
    if cfg.max_episode_steps:
        options["max_episode_steps"] = cfg.max_episode_steps
    return task, options, atari or "clip_reward" in wrappers


def validate_envpool(cfg: EnvConfig) -> None:
    """Raise ValueError (one line naming the field, the backend and what it lacks) if EnvPool
    cannot provide ``cfg``'s envs as rlpipe takes them."""
    if cfg.step_timeout_s:
        raise ValueError(f"env.step_timeout_s = {cfg.step_timeout_s:g}: env.backend = 'envpool' steps its envs in C++ "
                         "threads that no signal interrupts; leave it 0 (the watchdog, run.watchdog_s, kills a sampler "
                         "whose pool hangs) or set env.backend = 'gymnasium'")
    task, options, _ = pool_options(cfg)
    envpool = _envpool()
    try:
        spec = envpool.make_spec(task, **options)
    except (AssertionError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"env.kwargs: EnvPool refuses the options of {task}: {first_line(e)}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # EnvPool's float64 bounds cast to float32 Boxes
        obs_space, act_space = spec.gymnasium_observation_space, spec.gymnasium_action_space
    if not isinstance(obs_space, spaces.Box):
        raise ValueError(f"env.id: env.backend = 'envpool' takes one Box observation; {task}'s is {obs_space}; "
                         "set env.backend = 'gymnasium'")
    if not isinstance(act_space, (spaces.Discrete, spaces.Box)):
        raise ValueError(f"env.id: env.backend = 'envpool' takes Discrete or Box actions; {task}'s are {act_space}; "
                         "set env.backend = 'gymnasium'")


def default_threads(n_envs: int) -> int:
    """One worker thread per env, at most the CPUs this process may run on."""
    return max(1, min(n_envs, len(os.sched_getaffinity(0))))


class EnvPoolGroup:
    """B envs of one EnvPool pool (sync mode: every call steps them all), auto-reset, writing
    into [B, ...] arrays; the contract of ``shared.envs.group.EnvGroup``.

    A step may be split in two: ``send`` starts it in the pool's threads and returns, ``recv``
    waits for it and writes what ``step`` writes, so that the sampler's alternating groups
    step while it serves the other group (``env.split_step``)."""

    def __init__(self, cfg: EnvConfig, n_envs: int, base_seed: int, make_pool: MakePool | None = None):
        """``n_envs`` = B envs; env i is seeded with ``base_seed + i``. ``make_pool``: builds the
        pool (``envpool.make_gymnasium`` unless given)."""
        validate_envpool(cfg)
        if n_envs < 1:
            raise ValueError(f"EnvPoolGroup: n_envs must be >= 1, got {n_envs}")
        self.cfg, self.n_envs, self.base_seed = cfg, n_envs, base_seed
        self._task, self._options, self._clip = pool_options(cfg)
        self._episodic_life = bool(self._options.get("episodic_life"))
        self._make_pool = make_pool or _envpool().make_gymnasium
        self._generation = 0
        self._pool = self._new_pool()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.observation_space: spaces.Space = self._pool.observation_space
            self.action_space: spaces.Space = self._pool.action_space
        self._example_obs = space_example(self.observation_space, "Observation", "Observation")
        self._example_act = space_example(self.action_space, "Action", "Action")
        self._float_obs = self._example_obs.dtype.kind == "f"
        self._ids = np.arange(n_envs, dtype=np.int32)
        act_shape, act_dtype = leaf_dtype(self.action_space, "Action")
        self._act_batch = ((n_envs,) + act_shape, act_dtype)
        self._discrete = isinstance(self.action_space, spaces.Discrete)
        if self._discrete:
            self._n_actions = int(self.action_space.n)
            self._start = int(self.action_space.start)
            self._env_actions = np.zeros(n_envs, np.int32)
        else:
            self._low = self.action_space.low.astype(act_dtype)
            self._high = self.action_space.high.astype(act_dtype)
            self._env_actions = np.zeros((n_envs,) + act_shape, act_dtype)
        self._return = np.zeros(n_envs, np.float64)  # the current game's score so far, per env
        self._length = np.zeros(n_envs, np.int64)
        self._fresh: np.ndarray | None = None  # a rebuilt pool's first observations ...
        self._unclaimed: set[int] = set()  # ... of the envs whose recreate has not come yet
        self._sent: tuple[dict[int, str], str | None] | None = None  # a step in flight: its failures so far
        self.padding = np.zeros(n_envs, bool)
        """Never set: every env is in an episode (``EnvGroup.padding``)."""

    def _new_pool(self):
        B, k = self.n_envs, self._generation
        seeds = [self.base_seed + i + k * B for i in range(B)]
        threads = self.cfg.threads or default_threads(B)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self._make_pool(self._task, num_envs=B, batch_size=B, num_threads=threads, seed=seeds,
                                   **self._options)

    def example_observation(self):
        """One observation (no leading dims), as ``EnvGroup.example_observation``."""
        return self._example_obs

    def example_action(self):
        """One action (no leading dims) in the form ``step`` takes."""
        return self._example_act

    def close(self) -> None:
        self._sent = None
        if self._pool is not None:
            self._pool.close()

    # -- internals

    def _describe(self, i: int, problem: str) -> str:
        return f"env {self.cfg.id!r} #{i}: {problem}"

    def _bad_rows(self, obs: np.ndarray) -> np.ndarray | None:
        """Indices of the rows of ``obs`` [n, ...] with a NaN or an infinity (None when all are finite)."""
        if not self._float_obs:
            return None
        finite = np.isfinite(obs).reshape(len(obs), -1).all(axis=1)
        return None if finite.all() else np.flatnonzero(~finite)

    def _to_env(self, actions) -> np.ndarray | None:
        """Fill ``self._env_actions`` from ``actions`` [B, ...]; the envs whose discrete action is
        out of range (they get action ``start`` and fail this step), else None."""
        a = np.asarray(actions)
        shape, dtype = self._act_batch
        if a.shape != shape or (a.dtype.kind in "fc") != (dtype.kind in "fc"):
            raise ValueError(f"action: got {a.dtype}{list(a.shape)}, expected {dtype}{list(shape)}")
        if not self._discrete:
            np.clip(a, self._low, self._high, out=self._env_actions)
            return None
        bad = (a < 0) | (a >= self._n_actions)
        np.add(a, self._start, out=self._env_actions, casting="unsafe")
        if not bad.any():
            return None
        self._env_actions[bad] = self._start
        return np.flatnonzero(bad)

    def _in_order(self, info, *arrays):
        """``arrays`` reordered by env id (sync mode answers in the order asked; this keeps us honest)."""
        ids = info["env_id"]
        if len(ids) == self.n_envs and np.array_equal(ids, self._ids):
            return arrays
        order = np.argsort(ids, kind="stable")
        return tuple(None if x is None else x[order] for x in arrays)

    def _pool_failed(self, problem: str, finished) -> None:
        """The pool raised: every env failed; it is rebuilt by the next ``recreate``."""
        try:
            self._pool.close()
        except Exception:  # noqa: BLE001 - the pool is broken anyway; we only free it
            pass
        self._pool = None
        raise EnvError(self._describe(0, problem) + f" (the whole pool of {self.n_envs} envs failed)",
                       tuple(range(self.n_envs)), finished)

    # -- public

    def reset(self, obs_out) -> None:
        """Reset every env and write the B initial observations into ``obs_out[B, ...]``.

        The first call starts env i from seed ``base_seed + i``; later calls continue the envs'
        random streams. Raises EnvError naming the envs that failed.
        """
        dst = leaf_arrays(obs_out, self.n_envs, 1, "obs_out")[0]
        self._return[:] = 0.0
        self._length[:] = 0
        try:
            obs, info = self._pool.reset()
        except Exception as e:  # noqa: BLE001 - any env failure is reported, not fatal
            self._pool_failed(f"reset raised {first_line(e)}", [])
        (obs,) = self._in_order(info, obs)
        dst[:] = obs
        bad = self._bad_rows(obs)
        if bad is not None:
            message = "; ".join(self._describe(int(i), "reset observation contains NaN or an infinity") for i in bad)
            raise EnvError(message, tuple(int(i) for i in bad), [])

    def step(
        self, actions, obs_out, reward_out, terminated_out, truncated_out, final_obs_out
    ) -> list[tuple[int, float, int]]:
        """Step every env once, in one call into the pool, and reset the ones whose episode
        ended; the arguments, outputs, return value and failures are ``EnvGroup.step``'s.

        Returns ``(env_index, episode_return, episode_length)`` for each game that ended: the
        true score (before reward clipping) and length in agent steps of the whole game.
        Raises EnvError after the step if some envs failed (an out-of-range action, a NaN or
        infinite observation, a reward beyond ``MAX_ABS_REWARD``; every env if the pool
        raised); call ``recreate(i, obs_out)`` for each index in it before the next step.
        """
        self.send(actions)
        return self.recv(obs_out, reward_out, terminated_out, truncated_out, final_obs_out)

    def send(self, actions) -> None:
        """Start one step of every env with ``actions`` [B, ...] and return at once: the pool's
        C++ threads step the envs while the caller goes on (another group, the action-server's
        reply). ``recv`` writes the outputs; one ``send`` at a time. The actions are copied."""
        if self._sent is not None:
            raise RuntimeError("EnvPoolGroup.send: the previous step was not received (call recv first)")
        if self._pool is None:
            raise RuntimeError("EnvPoolGroup.send: the pool failed; recreate its envs first")
        bad_action = self._to_env(actions)
        failures: dict[int, str] = {}
        if bad_action is not None:
            a = np.asarray(actions)
            for i in bad_action:
                failures[int(i)] = f"action {int(a[i])} is outside Discrete({self._n_actions})"
        self._fresh, self._unclaimed = None, set()
        raised = None
        try:
            self._pool.send(self._env_actions, self._ids)
        except Exception as e:  # noqa: BLE001 - any env failure is reported (by recv), not fatal
            raised = f"step raised {first_line(e)}"
        self._sent = (failures, raised)

    def recv(self, obs_out, reward_out, terminated_out, truncated_out, final_obs_out) -> list[tuple[int, float, int]]:
        """Wait for the step ``send`` started, reset the envs whose episode ended, and write the
        outputs; the outputs, return value and failures are ``EnvGroup.step``'s (``step`` is
        ``send`` then ``recv``)."""
        if self._sent is None:
            raise RuntimeError("EnvPoolGroup.recv: no step was sent")
        (failures, raised), self._sent = self._sent, None
        B = self.n_envs
        obs_dst = leaf_arrays(obs_out, B, 1, "obs_out")[0]
        final_dst = leaf_arrays(final_obs_out, B, 1, "final_obs_out")[0]
        if raised is None:
            try:
                obs, reward, terminated, truncated, info = self._pool.recv(reset=False, return_info=True)
            except Exception as e:  # noqa: BLE001 - any env failure is reported, not fatal
                raised = f"step raised {first_line(e)}"
        if raised is not None:
            final_dst[:] = obs_dst
            reward_out[:], terminated_out[:], truncated_out[:] = 0.0, False, True
            self._pool_failed(raised, [])
        game_over = info["terminated"].astype(bool) if self._episodic_life else None
        obs, reward, terminated, truncated, game_over = self._in_order(info, obs, reward, terminated, truncated,
                                                                       game_over)
        bad_obs = self._bad_rows(obs)
        for i in () if bad_obs is None else bad_obs:
            failures.setdefault(int(i), "observation contains NaN or an infinity")
        if not (np.abs(reward) <= MAX_ABS_REWARD).all():  # False for NaN too
            for i in np.flatnonzero(~(np.abs(reward) <= MAX_ABS_REWARD)):
                failures.setdefault(int(i), f"reward is {float(reward[i])!r} (NaN, not finite or beyond "
                                            f"{MAX_ABS_REWARD:g})")
        self._return += reward
        self._length += 1
        reward_out[:] = np.sign(reward) if self._clip else reward
        terminated_out[:] = terminated
        truncated_out[:] = truncated
        if failures:
            failed = np.fromiter(failures, np.int64)
            final_dst[failed] = obs_dst[failed]  # the observation the action was taken on
            keep = obs_dst[failed].copy()
            obs_dst[:] = obs
            obs_dst[failed] = keep
            reward_out[failed], terminated_out[failed], truncated_out[failed] = 0.0, False, True
            done = (terminated | truncated) & ~np.isin(self._ids, failed)
        else:
            obs_dst[:] = obs
            done = terminated | truncated
        finished: list[tuple[int, float, int]] = []
        failed_steps = tuple(sorted(failures))  # before the resets add theirs
        if done.any():
            ended = np.flatnonzero(done)
            final_dst[ended] = obs[ended]
            over = done if game_over is None else done & (game_over | truncated)
            for i in np.flatnonzero(over):
                finished.append((int(i), float(self._return[i]), int(self._length[i])))
            self._return[over] = 0.0
            self._length[over] = 0
            self._autoreset(ended.astype(np.int32), obs_dst, failures)
        if failures:
            message = "; ".join(self._describe(i, problem) for i, problem in sorted(failures.items()))
            raise EnvError(message, tuple(sorted(failures)), finished, failed_steps)
        return finished

    def _autoreset(self, ended: np.ndarray, obs_dst: np.ndarray, failures: dict[int, str]) -> None:
        """EnvPool's reset of the envs ``ended`` (their next call, its action ignored), now;
        writes their first observations into ``obs_dst``."""
        try:
            self._pool.send(self._env_actions[ended], ended)
            obs, _, _, _, info = self._pool.recv(reset=False, return_info=True)
        except Exception as e:  # noqa: BLE001 - any env failure is reported, not fatal
            for i in ended:
                failures[int(i)] = f"reset raised {first_line(e)}"
            return
        ids = info["env_id"]
        bad = self._bad_rows(obs)
        if bad is not None:
            for j in bad:
                failures[int(ids[j])] = "reset observation contains NaN or an infinity"
            good = np.ones(len(ids), bool)
            good[bad] = False
            obs_dst[ids[good]] = obs[good]
        else:
            obs_dst[ids] = obs

    def recreate(self, i: int, obs_out) -> None:
        """Start env i afresh and write its first observation into ``obs_out[i]``.

        After a bad value, env i is reset (EnvPool cannot reseed one env; its stream
        continues). After the pool raised, the first ``recreate`` rebuilds the pool, env j
        seeded ``base_seed + j + k * B`` on the k-th rebuild, and each ``recreate(j)`` writes
        env j's new first observation. Raises EnvError if that fails too.
        """
        dst = leaf_arrays(obs_out, self.n_envs, 1, "obs_out")[0]
        self._return[i], self._length[i] = 0.0, 0
        if self._pool is None:
            self._generation += 1
            try:
                self._pool = self._new_pool()
                obs, info = self._pool.reset()
            except Exception as e:  # noqa: BLE001 - reported as the env's failure
                self._pool = None
                raise EnvError(self._describe(i, f"after recreate: rebuilding the pool raised {first_line(e)}"),
                               (i,), []) from None
            (self._fresh,) = self._in_order(info, obs)
            self._unclaimed = set(range(self.n_envs))
        if i in self._unclaimed:
            obs = self._fresh[i:i + 1]
            self._unclaimed.discard(i)
        else:
            try:
                obs, _ = self._pool.reset(np.array([i], np.int32))
            except Exception as e:  # noqa: BLE001 - reported as the env's failure
                raise EnvError(self._describe(i, f"after recreate: reset raised {first_line(e)}"), (i,), []) from None
        if self._bad_rows(obs) is not None:
            raise EnvError(self._describe(i, "after recreate: observation contains NaN or an infinity"), (i,), [])
        dst[i] = obs[0]
