"""Experiment configuration: one TOML file, validated on load, with ``--set a.b=v`` overrides.

An experiment is a set of sections, each a frozen dataclass owned by one component. A
service receives its own section plus ``run``, ``env`` and ``agent``; nobody reads a
global bag. Every error is one line naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import socket
import tempfile
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from shared.agent_config import ModelConfig, PgAgentConfig, QAgentConfig, QpgAgentConfig
from shared.algos.hparams import A2CConfig, DDPGConfig, DQNConfig, PPOConfig, R2D1Config, SACConfig, TD3Config
from shared.envs import EnvConfig, validate_env_config


class ConfigError(ValueError):
    """A bad configuration value; str() is one line naming the field."""


@dataclass(frozen=True)
class RunConfig:
    name: str = "experiment"
    """Experiment name; the run directory is <runs_dir>/<name>-<timestamp>."""
    runs_dir: str = "runs"
    """Where run directories are made (relative to the working directory)."""
    seed: int = 0
    """Base seed; each sampler and env derives its own from it."""
    device: str = "auto"
    """Torch device for learner and action-server: auto (cuda if present), cpu, cuda, cuda:N."""
    target_return: float = 475.0
    """The run ends when the mean return of the last `return_window` episodes reaches this."""
    return_window: int = 100
    """How many recent episodes the mean return is taken over."""
    max_env_steps: int = 200_000
    """Step budget: the run ends when this many env steps were sampled."""
    max_wall_s: float = 1800.0
    """Wall-clock budget in seconds (a safety net for tests and unattended runs)."""
    log_interval_s: float = 2.0
    """Seconds between progress rows (terminal and progress.csv)."""


@dataclass(frozen=True)
class SamplerConfig:
    count: int = 2
    """Number of sampler processes (``rlpipe scale RUN sampler=N`` changes it in a live run)."""
    max_count: int = 0
    """Most samplers ``rlpipe scale`` may run (0: count, no room to scale up). Replay's tables
    and the acting side's per-env state are laid out for this many: an off-policy table's
    capacity is shared by max_count samplers' columns, so a run that never scales up should
    leave it at 0."""
    envs: int = 16
    """Environments per sampler."""
    horizon: int = 32
    """T: steps per segment (per env) before it goes to replay."""
    ring: int = 1
    """Segments in each sampler's ring; with all unreleased the sampler waits (back-pressure)."""
    alternating: bool = True
    """Server inference: split the envs in two groups so one steps while the other waits for actions.
    It pays where the action-server has a core (or a GPU) of its own; on 2 CPU cores, where the
    samplers and the action-server take turns, one group of all the envs halves the requests
    (tests/bench's sampling run, make bench 2026-12-01: 0.85x a process without, 0.77x with)."""
    inference: str = "auto"
    """local: each sampler acts with its own copy of the agent on the CPU and follows the learner's
    parameter segment (rlpyt's parallel-CPU sampler; no action-server runs); server: the
    action-server batches every sampler's observations on run.device; auto: server where a CUDA
    device is present, local otherwise (what tests/bench measures faster on each)."""
    timeout_ms: int = 5000
    """How long to wait for an action-server or replay reply before reconnecting."""


@dataclass(frozen=True)
class ActionServerConfig:
    count: int = 1
    """Number of action-server processes (samplers are spread over them round-robin, sampler i to
    action-server i mod count when it starts; ``rlpipe scale RUN action_server=M`` changes it).
    On a CPU one per sampler is fastest: a sampler and its own action-server can share a core,
    and a wake-up on another core is dear (tests/bench's sampling run, 2 samplers x 16 envs in
    one group: 78-80k steps/s with one action-server, 104-106k with two, 91-96k in one process)."""
    max_count: int = 0
    """Most action-servers ``rlpipe scale`` may run (0: count): their TCP ports are reserved."""
    max_batch: int = 64
    """Most observation requests gathered into one forward pass."""
    max_wait_ms: float = 0.0
    """Longest a request waits for others to join its batch (0: serve what has arrived at once;
    requests that come in during a forward pass still share the next one). On this 2-core CPU
    machine waiting 0.5 ms cost a quarter of server-mode sampling (tests/bench's sampling run,
    2 rounds: 0.54x a process at 0.5 ms, 0.72x at 0); a GPU, whose forward pass costs the same
    for 8 rows or 64, may gain from a wait."""
    peer_timeout_s: float = 10.0
    """A sampler silent this long is reported lost and its slots detached."""


@dataclass(frozen=True)
class ReplayConfig:
    table: str = "queue"
    """queue (on-policy FIFO, each segment sampled once), uniform or prioritized (n-step transitions),
    sequence (R2D1: prioritized sequences of sequence_length steps)."""
    capacity: int = 2
    """Items held: segments for the queue (one per sampler keeps policy lag at 1), else transitions
    (the sequence table: env steps; it holds about capacity / sequence_period sequences)."""
    n_step: int = 1
    """Off-policy: rewards summed per transition before bootstrapping."""
    gamma: float = 0.99
    """Off-policy: discount per step used for n-step returns."""
    frame_store: bool = False
    """Off-policy: store each frame of [K, H, W] uint8 frame-stack observations once and rebuild
    the stacks at sample time (Atari: ~8 KB a transition instead of ~56 KB)."""
    sequence_length: int = 80
    """Sequence table: L, steps per sequence including the learner's burn-in."""
    sequence_period: int = 40
    """Sequence table: a new sequence starts every this many steps of an env (< sequence_length: overlap)."""
    alpha: float = 0.6
    """Prioritized: priority exponent (0 = uniform)."""
    beta0: float = 0.4
    """Prioritized: initial importance-sampling exponent, annealed to beta_final."""
    beta_final: float = 1.0
    """Prioritized: final importance-sampling exponent."""
    beta_steps: int = 100_000
    """Prioritized: samples over which beta anneals linearly."""
    samples_per_insert: float = 0.0
    """Off-policy replay ratio: items sampled per item inserted, kept in a band (0 = unthrottled)."""
    min_size_to_sample: int = 1000
    """Off-policy: items the table must hold before the learner may sample."""
    error_buffer: float = 0.0
    """Half-width of the samples-per-insert band in items (0 = the narrowest band that cannot deadlock)."""
    max_policy_lag: int = 4
    """On-policy: segments older than this many policy versions are dropped, not trained on."""
    release_on_sample: bool = True
    """Queue: hold a sampler's ring slot until its segment is trained on (tightest policy lag)."""
    peer_timeout_s: float = 10.0
    """A sampler silent this long is reported lost."""
    persist: bool = True
    """Keep the table in named shared memory that outlives the replay process: a replay
    restarted after ``kill -9`` re-attaches and serves on (docs/architecture.md, "Restarts and what is lost")."""
    snapshot_interval_s: float = 0.0
    """Seconds between copies of the table to the run directory (replay/), for a machine restart:
    ``rlpipe launch --resume RUN`` restores the latest with the learner's checkpoint (0 = none)."""


@dataclass(frozen=True)
class LearnerConfig:
    count: int = 1
    """Learner ranks: N > 1 trains data-parallel, one torch.distributed group (gloo on CPU,
    nccl on CUDA) whose ranks average their gradients each step; replay hands each rank its
    share of every batch, and rank 0 publishes parameters and writes checkpoints and progress."""
    batch_segments: int = 2
    """Segments in one batch (one per sampler gives a batch of T x sampler.count*envs); with
    ``count`` ranks each trains on its share of the batch's env columns."""
    prefetch: int = 1
    """Batch slots in flight; 2 double-buffers (the next batch fills while this one trains) at one more version of lag."""
    checkpoint_interval_s: float = 10.0
    """Seconds between checkpoints (and at the end)."""
    timeout_ms: int = 5000
    """How long to wait for a batch before asking replay again."""


@dataclass(frozen=True)
class PlacementConfig:
    """The node each service runs on, by label. Services with one label share memory: segments,
    batches and parameters go by shared-memory descriptor. Between labels they travel as
    ZeroMQ frames over TCP (``network.transport = "tcp"``, CURVE-encrypted). Under supervisord
    every label runs on this workstation (another label exercises the cross-host path here).
    A service without a field here (metrics) runs on ``main``."""
    replay: str = "main"
    learner: str = "main"
    sampler: str = "main"
    action_server: str = "main"
    evaluator: str = "main"

    def node(self, service: str) -> str:
        return getattr(self, service, "main")

    def labels(self) -> dict[str, str]:
        """Service -> label, for every placed service."""
        return dataclasses.asdict(self)

    def crosses(self, a: str, b: str) -> bool:
        """Whether the link between services ``a`` and ``b`` crosses nodes."""
        return self.node(a) != self.node(b)


@dataclass(frozen=True)
class NetworkConfig:
    transport: str = "ipc"
    """ipc (unix sockets in socket_dir(run), one workstation) or tcp."""
    host: str = "127.0.0.1"
    """Address tcp endpoints bind to and connect to."""
    bind_any: bool = False
    """Allow a tcp host other than loopback (exposes the services to the network)."""
    base_port: int = 5550
    """tcp: first port; services take base_port + offsets."""
    metrics_port: int = 9108
    """Port of the Prometheus endpoint (0 = off)."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds to."""


@dataclass(frozen=True)
class EvalConfig:
    every_s: float = 0.0
    """Seconds between the starts of two evaluations of the newest parameter version by the
    evaluator service (0 = no evaluator). A version already evaluated is not evaluated again."""
    episodes: int = 10
    """Greedy episodes per evaluation (also `rlpipe evaluate`'s default)."""
    envs: int = 8
    """Envs stepped side by side during an evaluation (at most `episodes` are made)."""
    seed_offset: int = 1_000_003
    """The evaluation envs are seeded from run.seed + seed_offset (env i: + i), apart from every
    sampler's seeds (run.seed + 10007 * instance + env); each evaluation replays the same seeds."""


INFERENCE = ("auto", "local", "server")
RECURRENT_ALGOS = ("ppo", "a2c", "r2d1")
"""Algorithms that train recurrent agents (``model.lstm_size > 0``) on whole sequences."""

# algo.name -> (algorithm config, agent config, agent family: see agent_config.FAMILIES)
ALGOS: dict[str, tuple[type, type, str]] = {
    "ppo": (PPOConfig, PgAgentConfig, "pg"),
    "a2c": (A2CConfig, PgAgentConfig, "pg"),
    "dqn": (DQNConfig, QAgentConfig, "q"),
    "r2d1": (R2D1Config, QAgentConfig, "q"),
    "ddpg": (DDPGConfig, QpgAgentConfig, "qpg"),
    "td3": (TD3Config, QpgAgentConfig, "qpg"),
    "sac": (SACConfig, QpgAgentConfig, "qpg"),
}


@dataclass(frozen=True)
class Experiment:
    run: RunConfig = field(default_factory=RunConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    agent: Any = field(default_factory=PgAgentConfig)
    algo_name: str = "ppo"
    algo: Any = field(default_factory=PPOConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    action_server: ActionServerConfig = field(default_factory=ActionServerConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)


SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "env": EnvConfig,
    "model": ModelConfig,
    "sampler": SamplerConfig,
    "action_server": ActionServerConfig,
    "replay": ReplayConfig,
    "learner": LearnerConfig,
    "network": NetworkConfig,
    "eval": EvalConfig,
    "placement": PlacementConfig,
}


def load(path: str | Path, overrides: list[str] = (), check_ports: bool = False) -> Experiment:
    """Read, override and validate an experiment file."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    return from_dict(apply_overrides(raw, overrides), check_ports=check_ports)


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


def from_dict(raw: dict, check_ports: bool = False) -> Experiment:
    known = set(SECTIONS) | {"algo", "agent"}
    for name in raw:
        if name not in known:
            raise ConfigError(f"unknown section [{name}]{_suggest(name, known)} (allowed: {', '.join(sorted(known))})")
    sections = {name: _build(name, cls, raw.get(name, {})) for name, cls in SECTIONS.items()}
    algo_raw = dict(raw.get("algo", {}))
    algo_name = algo_raw.pop("name", "ppo")
    if algo_name not in ALGOS:
        raise ConfigError(f"algo.name = {algo_name!r}: allowed: {', '.join(sorted(ALGOS))}")
    algo_cls, agent_cls, _ = ALGOS[algo_name]
    algo = _build("algo", algo_cls, algo_raw)
    agent = _build("agent", agent_cls, raw.get("agent", {}))
    exp = Experiment(algo_name=algo_name, algo=algo, agent=agent, **sections)
    _check(exp, check_ports)
    return exp


def _build(section: str, cls: type, values) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"[{section}] must be a table, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"unknown key {section}.{key}{_suggest(key, names)} (allowed: {', '.join(names)})")
        kwargs[key] = _coerce(f"{section}.{key}", hints[key], value)
    try:
        return cls(**kwargs)
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
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (not isinstance(value, hint) or (hint is int and isinstance(value, bool))):
        raise ConfigError(f"{where} = {value!r}: expected {hint.__name__}, got {type(value).__name__}")
    return value


def most_count(section) -> int:
    """The most instances of a scalable service (``sampler``, ``action_server``) the run may have:
    its ``max_count``, at least its ``count``."""
    return max(section.count, section.max_count)


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check(exp: Experiment, check_ports: bool) -> None:
    """Cross-field and value checks; one line naming the field each."""
    positive = {
        "sampler.count": exp.sampler.count, "sampler.envs": exp.sampler.envs, "sampler.horizon": exp.sampler.horizon,
        "sampler.ring": exp.sampler.ring, "sampler.timeout_ms": exp.sampler.timeout_ms,
        "action_server.count": exp.action_server.count, "action_server.max_batch": exp.action_server.max_batch,
        "replay.capacity": exp.replay.capacity, "learner.batch_segments": exp.learner.batch_segments,
        "learner.prefetch": exp.learner.prefetch, "learner.timeout_ms": exp.learner.timeout_ms,
        "learner.count": exp.learner.count,
        "run.max_env_steps": exp.run.max_env_steps, "run.return_window": exp.run.return_window,
    }
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name} = {value}: must be >= 1")
    for name, section in (("sampler", exp.sampler), ("action_server", exp.action_server)):
        if section.max_count and section.max_count < section.count:
            raise ConfigError(f"{name}.count = {section.count}: above {name}.max_count = {section.max_count}")
    if exp.sampler.inference not in INFERENCE:
        raise ConfigError(f"sampler.inference = {exp.sampler.inference!r}: allowed: {', '.join(INFERENCE)}")
    if exp.sampler.alternating and exp.sampler.envs < 2 and exp.sampler.inference != "local":
        raise ConfigError(f"sampler.envs = {exp.sampler.envs}: alternating mode needs >= 2 (or set sampler.alternating = false)")
    on_policy = ALGOS[exp.algo_name][2] == "pg"
    tables = ("queue",) if on_policy else ("sequence",) if exp.algo_name == "r2d1" else ("uniform", "prioritized")
    if exp.replay.table not in tables:
        raise ConfigError(f"replay.table = {exp.replay.table!r}: {exp.algo_name} needs one of: {', '.join(tables)}")
    if on_policy and exp.replay.release_on_sample and exp.learner.batch_segments > exp.sampler.count * exp.sampler.ring:
        raise ConfigError(f"learner.batch_segments = {exp.learner.batch_segments}: at most sampler.count * sampler.ring "
                          f"= {exp.sampler.count * exp.sampler.ring} while replay.release_on_sample holds the samplers' "
                          "ring slots until a batch is sampled")
    if on_policy and exp.replay.capacity < exp.learner.batch_segments:
        raise ConfigError(f"replay.capacity = {exp.replay.capacity}: must be >= learner.batch_segments ({exp.learner.batch_segments})")
    columns = exp.sampler.envs * exp.learner.batch_segments
    if on_policy and columns % exp.learner.count:
        raise ConfigError(f"learner.count = {exp.learner.count}: each rank trains on an equal share of a batch's "
                          f"sampler.envs * learner.batch_segments = {columns} env columns; pick a divisor of {columns}")
    if exp.algo_name == "r2d1":
        _check_r2d1(exp)
    elif not on_policy and exp.replay.capacity < most_count(exp.sampler) * exp.sampler.envs * (exp.sampler.horizon + exp.replay.n_step):
        raise ConfigError(f"replay.capacity = {exp.replay.capacity}: must hold at least (horizon + n_step) steps "
                          f"of all {most_count(exp.sampler) * exp.sampler.envs} envs (sampler.max_count)")
    if exp.replay.snapshot_interval_s and not (exp.replay.persist and exp.replay.snapshot_interval_s >= 1):
        raise ConfigError(f"replay.snapshot_interval_s = {exp.replay.snapshot_interval_s}: snapshots need "
                          "replay.persist = true and at least 1 s between them (0 = none)")
    if exp.replay.frame_store and on_policy:
        raise ConfigError("replay.frame_store = true: only the off-policy tables (uniform, prioritized, sequence) store "
                          "frames once; the on-policy queue keeps whole segments, set it to false")
    if exp.replay.samples_per_insert < 0 or exp.replay.n_step < 1 or not 0 <= exp.replay.gamma <= 1:
        raise ConfigError("replay: need samples_per_insert >= 0, n_step >= 1 and 0 <= gamma <= 1")
    if exp.model.lstm_size and exp.algo_name not in RECURRENT_ALGOS:
        raise ConfigError(f"model.lstm_size = {exp.model.lstm_size}: {exp.algo_name} has no recurrent agent; "
                          f"recurrent algorithms: {', '.join(RECURRENT_ALGOS)}")
    if exp.model.lstm_size and exp.algo_name == "ppo" and exp.algo.minibatches > columns // exp.learner.count:
        raise ConfigError(f"algo.minibatches = {exp.algo.minibatches}: a recurrent agent's minibatches are whole env "
                          f"sequences; at most sampler.envs * learner.batch_segments / learner.count = "
                          f"{columns // exp.learner.count}")
    _check_eval(exp)
    dev = exp.run.device
    if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
        raise ConfigError(f"run.device = {dev!r}: allowed: auto, cpu, cuda, cuda:N")
    net = exp.network
    if net.transport not in ("ipc", "tcp"):
        raise ConfigError(f"network.transport = {net.transport!r}: allowed: ipc, tcp")
    for name, host in (("network.host", net.host), ("network.metrics_host", net.metrics_host)):
        if not net.bind_any and not host.startswith("127.") and host not in ("localhost", "::1"):
            raise ConfigError(f"{name} = {host!r}: not a loopback address; set network.bind_any = true to expose it")
    for name, port in (("network.base_port", net.base_port), ("network.metrics_port", net.metrics_port)):
        if not 0 <= port <= 65535 or (name == "network.base_port" and port == 0):
            raise ConfigError(f"{name} = {port}: must be in 1..65535" + (" (0 = off)" if "metrics" in name else ""))
    _check_placement(exp)
    try:
        validate_env_config(exp.env)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if check_ports:
        ports = {"network.metrics_port": net.metrics_port} if net.metrics_port else {}
        if net.transport == "tcp":
            ports.update({f"network.base_port (+{i})": net.base_port + i for i in range(len(tcp_offsets(exp)))})
        for name, port in ports.items():
            host = net.metrics_host if name == "network.metrics_port" else net.host
            if not port_free(host, port):
                raise ConfigError(f"{name} = {port}: port already in use on {host}; pick another")


def _check_r2d1(exp: Experiment) -> None:
    r, a = exp.replay, exp.algo
    if not exp.model.lstm_size:
        raise ConfigError("model.lstm_size = 0: r2d1 trains a recurrent Q agent; set model.lstm_size > 0 (e.g. 64)")
    if r.sequence_length < 2 or not 1 <= r.sequence_period <= r.sequence_length:
        raise ConfigError(f"replay.sequence_period = {r.sequence_period}: need 1 <= sequence_period <= "
                          f"sequence_length ({r.sequence_length}) and sequence_length >= 2")
    if a.burn_in > r.sequence_length - 2:
        raise ConfigError(f"algo.burn_in = {a.burn_in}: at most replay.sequence_length - 2 = {r.sequence_length - 2} "
                          "(a sequence must keep steps to train on)")
    need = most_count(exp.sampler) * exp.sampler.envs * (exp.sampler.horizon + r.sequence_length)
    if r.capacity < need:
        raise ConfigError(f"replay.capacity = {r.capacity}: the sequence table needs at least (horizon + "
                          f"sequence_length) steps of all {most_count(exp.sampler) * exp.sampler.envs} envs = {need}")


SAMPLER_SEED_STRIDE = 10_007
"""Sampler i seeds its envs from run.seed + SAMPLER_SEED_STRIDE * i (services/sampler/sampler.py)."""


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


def _check_eval(exp: Experiment) -> None:
    e = exp.eval
    if not (math.isfinite(e.every_s) and e.every_s >= 0):
        raise ConfigError(f"eval.every_s = {e.every_s}: must be a finite number of seconds >= 0 (0 = no evaluator)")
    if 0 < e.every_s < 1:
        raise ConfigError(f"eval.every_s = {e.every_s}: at least 1 s between evaluations (or 0 = no evaluator)")
    for name, value in (("eval.episodes", e.episodes), ("eval.envs", e.envs)):
        if value < 1:
            raise ConfigError(f"{name} = {value}: must be >= 1")
    training = SAMPLER_SEED_STRIDE * most_count(exp.sampler)
    if e.seed_offset < training:
        raise ConfigError(f"eval.seed_offset = {e.seed_offset}: must be >= {training} ({SAMPLER_SEED_STRIDE} * "
                          "sampler.max_count) so that evaluation seeds are held out from the samplers' seeds")


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


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def tcp_offsets(exp: Experiment) -> dict[str, int]:
    """Port offsets from base_port of every bound socket."""
    offsets = {"replay": 0, "params": 1}
    for i in range(most_count(exp.action_server)):
        offsets[f"action_server{i}"] = 2 + i
    return offsets


def endpoint(exp: Experiment, run_dir: Path, name: str) -> str:
    """The address of bound socket ``name`` (replay, params, action_server<i>)."""
    if exp.network.transport == "tcp":
        return f"tcp://{exp.network.host}:{exp.network.base_port + tcp_offsets(exp)[name]}"
    return f"ipc://{socket_dir(run_dir) / name}"


def socket_base() -> Path:
    """The per-user parent of the runs' socket directories: $XDG_RUNTIME_DIR/rlpipe (a
    directory only the user can enter, per the XDG spec) or else <tmp>/rlpipe-<uid>;
    ``launch.make_private_dir`` makes it 0700 and refuses one another user owns."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "rlpipe"
    return Path(tempfile.gettempdir()) / f"rlpipe-{os.getuid()}"


def socket_dir(run_dir: Path) -> Path:
    """Where a run's unix sockets live: <socket_base()>/<run id>.

    Not inside the run directory: unix socket paths are limited to 107 bytes, which a run
    directory deep in a project tree exceeds.
    """
    return socket_base() / Path(run_dir).resolve().name


# ---------------------------------------------------------------- writing


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
    items.update({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
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
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
