"""Cross-field and value checks of a built ``Experiment``: one ConfigError line naming the field each.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import math
import os
from pathlib import Path
from shared.envs.backends import columns_per_env, validate_env_config
from shared.envs.pettingzoo_backend import not_copyable_game, not_zero_sum_game
from shared.config.endpoints import port_free, tcp_offsets
from shared.algos import registry
from shared.algos.hparams import PQNConfig
from shared.replay.selectors import WEIGHT_NORMS
from shared.runtime.plugins import is_reference, load_attribute
from shared.config.schema import (AUTOCAST, ConfigError, Experiment, INFERENCE, OPPONENTS, POOLS, SCHEDULE_BY, SCRIPTED,
                                  WANDB_MODES)
from shared.config.topology import SAMPLER_SEED_STRIDE, topology


def check(exp: Experiment, check_ports: bool, check_env: bool = True) -> None:
    """Cross-field and value checks; one line naming the field each. ``check_env``: also the checks
    that build or inspect the env (its id, spaces, agents, whether a game is zero-sum)."""
    positive = {
        "sampler.count": exp.sampler.count, "sampler.envs": exp.sampler.envs, "sampler.horizon": exp.sampler.horizon,
        "sampler.ring": exp.sampler.ring, "sampler.timeout_ms": exp.sampler.timeout_ms,
        "action_server.count": exp.action_server.count, "action_server.max_batch": exp.action_server.max_batch,
        "replay.capacity": exp.replay.storage.capacity, "learner.batch_segments": exp.learner.batch_segments,
        "learner.prefetch": exp.learner.prefetch, "learner.timeout_ms": exp.learner.timeout_ms,
        "learner.count": exp.learner.count, "learner.threads": exp.learner.threads,
        "run.max_env_steps": exp.run.max_env_steps, "run.return_window": exp.run.return_window,
        "run.max_skipped_updates": exp.run.max_skipped_updates,
    }
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name} = {value}: must be >= 1")
    for name, value in (("run.watchdog_s", exp.run.watchdog_s), ("run.watchdog_startup_s", exp.run.watchdog_startup_s)):
        if not value >= 0:
            raise ConfigError(f"{name} = {value}: must be >= 0 (seconds; run.watchdog_s = 0 turns the watchdog off)")
    for name, section in (("sampler", exp.sampler), ("action_server", exp.action_server)):
        if section.max_count and section.max_count < section.count:
            raise ConfigError(f"{name}.count = {section.count}: above {name}.max_count = {section.max_count}")
    if exp.learner.autocast not in AUTOCAST:
        raise ConfigError(f"learner.autocast = {exp.learner.autocast!r}: allowed: {', '.join(AUTOCAST)}")
    if exp.run.schedule_by not in SCHEDULE_BY:
        raise ConfigError(f"run.schedule_by = {exp.run.schedule_by!r}: allowed: {', '.join(SCHEDULE_BY)}")
    if exp.run.schedule_by == "budget" and exp.learner.count > 1:
        raise ConfigError(f"run.schedule_by = 'budget' with learner.count = {exp.learner.count}: each rank's clock "
                          "would anneal its optimizer's rate apart from the others'; use 'env_steps'")
    if exp.sampler.inference not in INFERENCE:
        raise ConfigError(f"sampler.inference = {exp.sampler.inference!r}: allowed: {', '.join(INFERENCE)}")
    if exp.sampler.alternating and exp.sampler.envs < 2 and exp.sampler.inference != "local":
        raise ConfigError(f"sampler.envs = {exp.sampler.envs}: alternating mode needs >= 2 (or set sampler.alternating = false)")
    spec = exp.algo_spec
    on_policy = spec.on_policy
    if exp.replay.table not in spec.tables:
        raise ConfigError(f"replay.table = {exp.replay.table!r}: {spec.name} learns from {spec.batch}; it needs one of: "
                          f"{', '.join(spec.tables)}")
    if not on_policy and not isinstance(getattr(exp.algo, "batch_size", None), int):
        raise ConfigError(f"algo.name = {exp.algo_name!r}: an algorithm that learns from {spec.batch} needs an int "
                          f"batch_size field in its config ({spec.config.__name__})")
    if on_policy and exp.replay.release_on_sample and exp.learner.batch_segments > exp.sampler.count * exp.sampler.ring:
        raise ConfigError(f"learner.batch_segments = {exp.learner.batch_segments}: at most sampler.count * sampler.ring "
                          f"= {exp.sampler.count * exp.sampler.ring} while replay.release_on_sample holds the samplers' "
                          "ring slots until a batch is sampled")
    capacity, transitions = exp.replay.storage.capacity, exp.replay.transitions
    if on_policy and capacity < exp.learner.batch_segments:
        raise ConfigError(f"replay.capacity = {capacity}: must be >= learner.batch_segments ({exp.learner.batch_segments})")
    columns = exp.sampler.envs * exp.learner.batch_segments
    if on_policy and columns % exp.learner.count:
        raise ConfigError(f"learner.count = {exp.learner.count}: each rank trains on an equal share of a batch's "
                          f"sampler.envs * learner.batch_segments = {columns} env columns; pick a divisor of {columns}")
    if spec.batch_kind.recurrent:
        _check_sequences(exp)
    elif not on_policy and capacity < topology(exp).total_envs * (exp.sampler.horizon + transitions.n_step):
        raise ConfigError(f"replay.capacity = {capacity}: must hold at least (horizon + n_step) steps "
                          f"of all {topology(exp).total_envs} envs (sampler.max_count)")
    if exp.replay.snapshot_interval_s and not (exp.replay.persist and exp.replay.snapshot_interval_s >= 1):
        raise ConfigError(f"replay.snapshot_interval_s = {exp.replay.snapshot_interval_s}: snapshots need "
                          "replay.persist = true and at least 1 s between them (0 = none; with replay.persist = false "
                          "set it to 0)")
    if exp.replay.storage.frame_store and on_policy:
        raise ConfigError("replay.frame_store = true: only the off-policy tables (uniform, prioritized, sequence) store "
                          "frames once; the on-policy queue keeps whole segments, set it to false")
    if transitions.store_steps and not spec.batch_kind.window_steps:
        raise ConfigError(f"replay.store_steps = true: only n-step transitions carry their steps; {spec.name} learns from "
                          f"{spec.batch}, set it to false")
    if exp.replay.prioritized.weight_norm not in WEIGHT_NORMS:
        raise ConfigError(f"replay.weight_norm = {exp.replay.prioritized.weight_norm!r}: allowed: {', '.join(WEIGHT_NORMS)}")
    if exp.replay.rate_limiter.samples_per_insert < 0 or transitions.n_step < 1 or not 0 <= transitions.gamma <= 1:
        raise ConfigError("replay: need samples_per_insert >= 0, n_step >= 1 and 0 <= gamma <= 1")
    if exp.model.lstm_size and not spec.recurrent:
        raise ConfigError(f"model.lstm_size = {exp.model.lstm_size}: {spec.name} has no recurrent agent; "
                          f"recurrent algorithms: {', '.join(registry.recurrent_names())}")
    if exp.model.layer_norm and spec.agent.family == "qpg":
        raise ConfigError(f"model.layer_norm = true: {spec.name}'s critics have no MLP trunk to normalise; it is for "
                          "Q and policy-gradient agents (pqn)")
    if isinstance(exp.algo, PQNConfig) and getattr(exp.agent, "distributional", False):
        raise ConfigError(f"agent.distributional = true: {spec.name} regresses scalar Q(lambda) targets, not C51's "
                          "return distribution; set it to false (C51 is algo.name = 'dqn')")
    if spec.batch_kind.recurrent and not exp.model.lstm_size:
        raise ConfigError(f"model.lstm_size = 0: {spec.name} trains a recurrent agent on sequences; set model.lstm_size "
                          "> 0 (e.g. 64)")
    if exp.model.lstm_size and on_policy and getattr(exp.algo, "minibatches", 1) > columns // exp.learner.count:
        raise ConfigError(f"algo.minibatches = {exp.algo.minibatches}: a recurrent agent's minibatches are whole env "
                          f"sequences; at most sampler.envs * learner.batch_segments / learner.count = "
                          f"{columns // exp.learner.count}")
    _check_eval(exp)
    _check_logging(exp)
    if is_reference(exp.model.encoder):
        try:
            load_attribute(exp.model.encoder, "model.encoder")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    dev = exp.run.device
    if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
        raise ConfigError(f"run.device = {dev!r}: allowed: auto, cpu, cuda, cuda:N")
    net = exp.network
    if net.transport not in ("ipc", "tcp"):
        raise ConfigError(f"network.transport = {net.transport!r}: allowed: ipc, tcp")
    for name, host in (("network.host", net.host), ("network.metrics_host", net.metrics_host)):
        if not net.bind_any and not is_loopback(host):
            raise ConfigError(f"{name} = {host!r}: not a loopback address; set network.bind_any = true to expose it")
    for name, port in (("network.base_port", net.base_port), ("network.metrics_port", net.metrics_port)):
        if not 0 <= port <= 65535 or (name == "network.base_port" and port == 0):
            raise ConfigError(f"{name} = {port}: must be in 1..65535" + (" (0 = off)" if "metrics" in name else ""))
    _check_placement(exp)
    _check_watchdog(exp)
    if check_env:
        try:
            validate_env_config(exp.env)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _check_agent_columns(exp)
    _check_global_state(exp)
    _check_groups(exp)
    _check_selfplay(exp, check_env)
    if check_ports:
        ports = {"network.metrics_port": net.metrics_port} if net.metrics_port else {}
        if net.transport == "tcp":
            ports.update({f"network.base_port (+{i})": net.base_port + i for i in range(len(tcp_offsets(exp)))})
        for name, port in ports.items():
            host = net.metrics_host if name == "network.metrics_port" else net.host
            if not port_free(host, port):
                raise ConfigError(f"{name} = {port}: port already in use on {host}; pick another")


def _check_agent_columns(exp: Experiment) -> None:
    """A multi-agent env's N agents take N columns of one env group: ``sampler.envs`` is a multiple
    of N (of 2N where the alternating sampler splits it in two groups)."""
    n = columns_per_env(exp.env)
    groups = 2 if exp.sampler.alternating and exp.sampler.inference == "server" else 1
    if n > 1 and exp.sampler.envs % (n * groups):
        what = f"2 groups of {n} agents" if groups == 2 else f"{n} agents"
        raise ConfigError(f"sampler.envs = {exp.sampler.envs}: {exp.env.id!r} has {n} agents, one column each; "
                          f"it must be a multiple of {n * groups} ({what}" + (", alternating)" if groups == 2 else ")"))


def _check_global_state(exp: Experiment) -> None:
    """``env.global_state`` is for a value network to read and the policy not to (``shared.agents.pg``):
    a policy-gradient agent with an encoder of its own for the value, built in (the env's own
    checks, in ``validate_env_config``, refuse an env without a state)."""
    if not exp.env.global_state:
        return
    spec = exp.algo_spec
    if spec.agent.family != "pg":
        raise ConfigError(f"env.global_state = true: {spec.name}'s agent has no value network to read the global "
                          "state; it is for policy-gradient algorithms (ppo, a2c, impala)")
    if getattr(exp.agent, "shared_encoder", False):
        raise ConfigError("agent.shared_encoder = true: with env.global_state the value reads the global state and "
                          "the policy must not, so each needs its own encoder; set it false")
    if is_reference(exp.model.encoder):
        raise ConfigError(f"model.encoder = {exp.model.encoder!r}: with env.global_state the policy's encoder must "
                          "leave the global state out, which only the built-in encoders do")


def _check_groups(exp: Experiment) -> None:
    """``env.groups`` gives each group its own networks inside one agent (``shared.agents.groups``):
    PPO, A2C, IMPALA and DQN-family agents, recurrent ones (R2D1's) included, with built-in encoders
    (the self-play pool's copies are such agents too). The env's own checks (``validate_env_config``)
    refuse a pattern that matches no agent, an agent in no group or in two, and a single-agent env."""
    if not exp.env.groups:
        return
    spec = exp.algo_spec
    if spec.agent.family not in ("pg", "q"):
        raise ConfigError(f"env.groups: {spec.name}'s agent has no networks per agent group; groups are for "
                          "policy-gradient (ppo, a2c, impala) and DQN-family algorithms")
    if is_reference(exp.model.encoder):
        raise ConfigError(f"model.encoder = {exp.model.encoder!r}: with env.groups no network may read the "
                          "agent_group leaf, which only the built-in encoders leave out")


def _check_watchdog(exp: Experiment) -> None:
    """``run.watchdog_s`` must cover the longest turn of a service's loop without a heartbeat that
    the config decides: one env step (cut at ``env.step_timeout_s``) and one wait for actions
    (``sampler.timeout_ms``, where an action-server acts). A sampler beats every step and every
    wait, so neither ``sampler.horizon`` nor the segments' back-pressure adds to it."""
    watchdog = exp.run.watchdog_s
    if not watchdog:
        return
    limit = exp.env.step_timeout_s
    if limit and limit >= watchdog:
        raise ConfigError(f"env.step_timeout_s = {limit:g}: must be under run.watchdog_s = {watchdog:g} "
                          "(the watchdog would kill the sampler before its env is interrupted)")
    wait_s = exp.sampler.timeout_ms / 1000.0
    server = resolve_inference(exp)[0].sampler.inference == "server"  # a local sampler waits on no action-server
    if server and wait_s + (limit or 0.0) >= watchdog:
        raise ConfigError(f"run.watchdog_s = {watchdog:g}: must exceed sampler.timeout_ms = {exp.sampler.timeout_ms} "
                          f"({wait_s:g} s, a sampler's longest wait for actions without a heartbeat)"
                          + (f" plus env.step_timeout_s = {limit:g}" if limit else "")
                          + "; raise run.watchdog_s or lower sampler.timeout_ms")


def _check_sequences(exp: Experiment) -> None:
    seq, capacity, burn_in = exp.replay.sequences, exp.replay.storage.capacity, getattr(exp.algo, "burn_in", 0)
    if seq.length < 2 or not 1 <= seq.period <= seq.length:
        raise ConfigError(f"replay.sequence_period = {seq.period}: need 1 <= sequence_period <= "
                          f"sequence_length ({seq.length}) and sequence_length >= 2")
    if burn_in > seq.length - 2:
        raise ConfigError(f"algo.burn_in = {burn_in}: at most replay.sequence_length - 2 = {seq.length - 2} "
                          "(a sequence must keep steps to train on)")
    envs = topology(exp).total_envs
    need = envs * (exp.sampler.horizon + seq.length)
    if capacity < need:
        raise ConfigError(f"replay.capacity = {capacity}: the sequence table needs at least (horizon + "
                          f"sequence_length) steps of all {envs} envs = {need}")


def _check_placement(exp: Experiment) -> None:
    place = exp.placement
    for service, label in place.labels().items():
        if not (label and len(label) <= 64 and all(c.isalnum() or c in "_.-" for c in label)):
            raise ConfigError(f"placement.{service} = {label!r}: a node label is 1-64 letters, digits, '_', '.' or '-'")
    if len({place.node(s) for s in ("replay", "learner", "sampler")}) > 1 and exp.network.transport != "tcp":
        raise ConfigError("[placement] puts services on several nodes: they talk over TCP; set network.transport = 'tcp'")
    if exp.sampler.inference == "server" and place.crosses("sampler", "action_server"):
        raise ConfigError(f"placement.action_server = {place.action_server!r}: server inference shares step slots "
                          f"with the samplers, so it runs on their node ({place.sampler!r})")
    if exp.eval.every_s and place.crosses("evaluator", "learner"):
        raise ConfigError(f"placement.evaluator = {place.evaluator!r}: the evaluator reads the learner's checkpoints "
                          f"and parameters from its node ({place.learner!r})")


def _check_selfplay(exp: Experiment, check_env: bool) -> None:
    """A pool of past versions needs a two-player zero-sum game (``not_zero_sum_game``: the rule)
    and a feed-forward agent (the opponent's copies keep no recurrent state); scripted players
    need a pool, known names, shares that add up to at most 1, the learner's seat trained alone
    and, for the heuristic, a game whose state it can copy."""
    sp = exp.selfplay
    if sp.scripted and not sp.on:
        raise ConfigError(f"selfplay.scripted = {sp.scripted!r}: scripted players stand in for pool versions; "
                          "set selfplay.pool too")
    if not sp.on:
        return
    for name, share in sp.scripted.items():
        if name not in SCRIPTED:
            raise ConfigError(f"selfplay.scripted: {name!r} is unknown; give some of {', '.join(SCRIPTED)}")
        if not (math.isfinite(share) and share > 0):
            raise ConfigError(f"selfplay.scripted.{name} = {share}: a share of the games, > 0")
    if sum(sp.scripted.values()) > 1:
        raise ConfigError(f"selfplay.scripted = {sp.scripted!r}: the shares add up to more than 1")
    if sp.scripted and sp.train_both_seats:
        raise ConfigError("selfplay.train_both_seats = true with selfplay.scripted: a scripted move has no "
                          "behaviour probability to train the opponent's seat on; train the learner's seat only")
    if sp.pool not in POOLS:
        raise ConfigError(f"selfplay.pool = {sp.pool!r}: allowed: {', '.join(POOLS)}, or empty (off)")
    if not 0 <= sp.second_seat_share <= 1:
        raise ConfigError(f"selfplay.second_seat_share = {sp.second_seat_share}: a share of the boards, from 0 to 1")
    for name, value in (("selfplay.size", sp.size), ("selfplay.snapshot_every", sp.snapshot_every)):
        if value < 1:
            raise ConfigError(f"{name} = {value}: must be >= 1")
    if exp.model.lstm_size:
        raise ConfigError(f"model.lstm_size = {exp.model.lstm_size}: the self-play pool's opponent keeps no "
                          "recurrent state; use a feed-forward agent with selfplay.pool")
    why = not_zero_sum_game(exp.env) if check_env else None
    if why is not None:
        raise ConfigError(f"selfplay.pool = {sp.pool!r}: needs a two-player zero-sum turn-based game; "
                          f"env.id = {exp.env.id!r} {why}")
    why = not_copyable_game(exp.env) if check_env and "heuristic" in sp.scripted else None
    if why is not None:
        raise ConfigError(f"selfplay.scripted: {why}")


def _check_eval(exp: Experiment) -> None:
    e = exp.eval
    if not (math.isfinite(e.every_s) and e.every_s >= 0):
        raise ConfigError(f"eval.every_s = {e.every_s}: must be a finite number of seconds >= 0 (0 = no evaluator)")
    if 0 < e.every_s < 1:
        raise ConfigError(f"eval.every_s = {e.every_s}: at least 1 s between evaluations (or 0 = no evaluator)")
    for name, value in (("eval.episodes", e.episodes), ("eval.envs", e.envs)):
        if value < 1:
            raise ConfigError(f"{name} = {value}: must be >= 1")
    for opponent in e.opponents:
        if opponent not in OPPONENTS:
            raise ConfigError(f"eval.opponents: {opponent!r} is unknown; give some of {', '.join(OPPONENTS)}")
    training = topology(exp).sampler_seed_span
    if e.seed_offset < training:
        raise ConfigError(f"eval.seed_offset = {e.seed_offset}: must be >= {training} ({SAMPLER_SEED_STRIDE} * "
                          "sampler.max_count) so that evaluation seeds are held out from the samplers' seeds")


def _check_logging(exp: Experiment) -> None:
    lg = exp.logging
    if lg.mode and lg.mode not in WANDB_MODES:
        raise ConfigError(f"logging.mode = {lg.mode!r}: allowed: {', '.join(WANDB_MODES)}, or empty (WANDB_MODE "
                          "decides)")
    if not lg.timeout_s > 0:
        raise ConfigError(f"logging.timeout_s = {lg.timeout_s}: must be > 0 (seconds W&B's start and finish may take)")
    # find_spec, not an import: wandb takes seconds to import, and only the learner needs it.
    if lg.to_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb = true: the wandb package is not installed; pip install 'rlpipe[wandb]' "
                          "(or set logging.wandb = false)")


def resolve_inference(exp: Experiment) -> tuple[Experiment, str]:
    """``exp`` with ``sampler.inference = "auto"`` made local or server, and why (for the launch line).

    auto is server when the run's device is CUDA: an explicit ``run.device = "cuda..."``, or
    ``auto`` on a machine with an NVIDIA driver (checked without importing torch).
    """
    chosen = exp.sampler.inference
    if chosen != "auto":
        return exp, f"inference {chosen}"
    cuda = exp.run.device.startswith("cuda") or (exp.run.device == "auto" and Path("/proc/driver/nvidia/version").exists())
    chosen = "server" if cuda else "local"
    why = "a CUDA device is present" if cuda else "no CUDA device"
    return dataclasses.replace(exp, sampler=dataclasses.replace(exp.sampler, inference=chosen)), \
        f"inference {chosen} (auto: {why})"


HEADROOM = 4
"""An on-policy run launched without ``sampler.max_count`` may grow to HEADROOM x its samplers
(or to this host's cores, where there are more)."""


def resolve_max_count(exp: Experiment) -> Experiment:
    """``exp`` with room for ``rlpipe scale`` where the room costs nothing: an on-policy run
    launched without ``sampler.max_count`` may grow to max(HEADROOM * count, cores) samplers,
    at most as many as ``eval.seed_offset`` keeps the held-out seeds apart from.

    The on-policy queue holds whole segments whoever wrote them, so the room costs a few
    floats a global env index on the acting side. An off-policy table splits
    ``replay.capacity`` between the columns of max_count samplers from the start (a run at
    count samplers would hold count / max_count of it) and a Q agent's Ape-X epsilons spread
    over their envs, so off-policy runs get room only by asking for it (docs/architecture.md,
    "Scaling a live run")."""
    sampler = exp.sampler
    if sampler.max_count or not exp.algo_spec.on_policy:
        return exp
    room = min(max(HEADROOM * sampler.count, len(os.sched_getaffinity(0))), exp.eval.seed_offset // SAMPLER_SEED_STRIDE)
    return dataclasses.replace(exp, sampler=dataclasses.replace(sampler, max_count=max(room, sampler.count)))


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``, by parsing it:
    a name such as ``127.evil.example`` is not one."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
