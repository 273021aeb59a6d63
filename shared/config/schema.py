"""Experiment configuration: one frozen dataclass a section, the ``Experiment`` that holds them.

An experiment is a set of sections, each owned by one component. A service receives its own
section plus ``run``, ``env`` and ``agent``; nobody reads a global bag. Loading and writing
TOML: ``shared.config.loading``; cross-section rules: ``shared.config.checks``; socket
addresses: ``shared.config.endpoints``.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar
from shared.agents.config import ModelConfig, PgAgentConfig
from shared.algos import registry
from shared.algos.hparams import PPOConfig
from shared.algos.registry import AlgoSpec
from shared.envs.group import EnvConfig
from shared.replay.rate_limiter import RateLimiterConfig
from shared.replay.selectors import PrioritizedConfig
from shared.replay.sequences import SequenceStorageConfig
from shared.replay.storage import StorageConfig
from shared.replay.transitions import TransitionStorageConfig


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
    schedule_by: str = "env_steps"
    """What the algorithm's schedules (the annealed learning rates) count as the run's fraction
    done: ``env_steps``, env steps of ``max_env_steps`` (the same steps give the same schedule on
    any machine), or ``budget``, whichever of ``max_env_steps`` and ``max_wall_s`` is nearer its
    end, so that a run bounded by wall-clock ("within 30 minutes") anneals fully by its end on a
    machine of any speed; the schedule then depends on the machine. One learner rank only (each
    rank's clock would give its optimizer another rate)."""
    log_interval_s: float = 2.0
    """Seconds between progress rows (terminal and progress.csv)."""
    max_skipped_updates: int = 100
    """The run ends as failed after this many updates in a row whose every gradient step was
    skipped for a non-finite loss or gradient norm (``shared.algos.optim.gradient_step``): it
    learns nothing any more, and would otherwise spend its whole budget so."""
    watchdog_s: float = 60.0
    """A service whose loops have not turned (its heartbeat, ``shared.runtime.heartbeat``) for this
    many seconds is hung (an env stuck in ``step()``, a stopped process): the run's watchdog kills it
    with SIGKILL and supervisord restarts it; 3 kills in a row of one service stop the run
    (``shared.launch.watchdog``, supervisord runs only). It must exceed the longest turn of a
    service's loop without a beat: a learner's update, one env step, a wait for actions (the last
    two checked at load; a sampler beats every step, a snapshot or restore every 16 MB). 0: off."""
    watchdog_startup_s: float = 300.0
    """Start-up grace: how long the watchdog lets a service run before its loops first turn
    (imports, building the agent, restoring a checkpoint or a replay table)."""


@dataclass(frozen=True)
class SamplerConfig:
    count: int = 2
    """Number of sampler processes (``rlpipe scale RUN sampler=N`` changes it in a live run)."""
    max_count: int = 0
    """Most samplers ``rlpipe scale`` may run. Replay's tables and the acting side's per-env
    state are laid out for this many: an off-policy table's capacity is shared by max_count
    samplers' columns, so an off-policy run that never scales up should leave it at 0 (count:
    no room to scale up). 0 in an on-policy run, where the room costs nothing, is set at launch
    to max(4 * count, cores) (``checks.resolve_max_count``)."""
    envs: int = 16
    """Environments per sampler."""
    horizon: int = 32
    """T: steps per segment (per env) before it goes to replay."""
    ring: int = 1
    """Segments in each sampler's ring; with all unreleased the sampler waits (back-pressure)."""
    alternating: bool = True
    """Server inference: split the envs in two groups so one steps while the other waits for actions.
    It pays where the action-server has a core (or a GPU) of its own; where the samplers and the
    action-server share the cores and take turns, one group of all the envs halves the requests and
    samples faster (docs/benchmarks.md, "Server inference on a CPU")."""
    inference: str = "auto"
    """local: each sampler acts with its own copy of the agent on the CPU and follows the learner's
    parameter segment (rlpyt's parallel-CPU sampler; no action-server runs); server: the
    action-server batches every sampler's observations on run.device; auto: server where a CUDA
    device is present, local otherwise (on a CPU host local samples faster: docs/benchmarks.md,
    "Sampling throughput"; a GPU batches every sampler's forward pass)."""
    timeout_ms: int = 5000
    """How long to wait for an action-server or replay reply before reconnecting."""


@dataclass(frozen=True)
class ActionServerConfig:
    count: int = 1
    """Number of action-server processes (samplers are spread over them round-robin, sampler i to
    action-server i mod count when it starts; ``rlpipe scale RUN action_server=M`` changes it).
    On a CPU one per sampler is fastest: a sampler and its own action-server can share a core,
    and a wake-up on another core is dear; with one each, server mode samples faster than one
    process (docs/benchmarks.md, "Server inference on a CPU")."""
    max_count: int = 0
    """Most action-servers ``rlpipe scale`` may run (0: count): their TCP ports are reserved."""
    max_batch: int = 64
    """Most observation requests gathered into one forward pass."""
    max_wait_ms: float = 0.0
    """Longest a request waits for others to join its batch (0: serve what has arrived at once;
    requests that come in during a forward pass still share the next one). Where the samplers and
    the action-server share the CPU's cores a wait only delays the batch: the other samplers' requests come once the action-server gives
    the core back (docs/benchmarks.md, "Server inference on a CPU"); a GPU, whose forward pass
    costs the same for 8 rows or 64, may gain from a wait."""
    peer_timeout_s: float = 10.0
    """A sampler silent this long is reported lost and its slots detached."""


@dataclass(frozen=True)
class ReplayConfig:
    """The replay service's section: its table's parts, each with the config its part declares
    (``shared.replay``), and the service's own settings. The ``[replay]`` TOML section is flat:
    ``KEYS`` names the field each key sets (``flat``, ``from_flat``)."""
    table: str = "queue"
    """queue (on-policy FIFO, each segment sampled once), uniform or prioritized (n-step transitions),
    sequence (R2D1: prioritized sequences of sequence_length steps)."""
    storage: StorageConfig = field(default_factory=lambda: StorageConfig(capacity=2))
    """Every table's storage: capacity, frame_store."""
    transitions: TransitionStorageConfig = field(default_factory=TransitionStorageConfig)
    """The uniform and prioritized tables' n-step transitions: n_step, gamma, store_steps."""
    sequences: SequenceStorageConfig = field(default_factory=SequenceStorageConfig)
    """The sequence table's sequences: sequence_length, sequence_period."""
    prioritized: PrioritizedConfig = field(default_factory=PrioritizedConfig)
    """The prioritized and sequence tables' selector: alpha, beta0, beta_final, beta_steps, weight_norm."""
    rate_limiter: RateLimiterConfig = field(default_factory=lambda: RateLimiterConfig(min_size_to_sample=1000))
    """The off-policy tables' rate limiter: samples_per_insert, min_size_to_sample, error_buffer."""
    max_policy_lag: int = 4
    """On-policy: segments older than this many policy versions are dropped, not trained on."""
    release_on_sample: bool = True
    """Queue: hold a sampler's ring slot until its segment is trained on (tightest policy lag)."""
    peer_timeout_s: float = 10.0
    """A sampler silent this long is reported lost."""
    persist: bool = True
    """Keep the table in named shared memory that outlives the replay process: a replay
    restarted after ``kill -9`` re-attaches and serves on (docs/architecture.md, "Restarts and what is lost")."""
    snapshot_interval_s: float = 300.0
    """Seconds between copies of the table to the run directory (replay/), for a machine restart
    or a stopped grid: ``rlpipe launch --resume RUN`` (``grid --resume``) restores the latest with
    the learner's checkpoint, so a stop loses at most this much of the table (0 = none; needs
    ``persist``). A copy costs the table's size on disk twice and a pause of replay while it is
    written: raise it for tables of gigabytes (an Atari frame store)."""

    KEYS: ClassVar[dict[str, tuple[str, ...]]] = {
        "table": ("table",),
        "capacity": ("storage", "capacity"),
        "n_step": ("transitions", "n_step"),
        "gamma": ("transitions", "gamma"),
        "store_steps": ("transitions", "store_steps"),
        "frame_store": ("storage", "frame_store"),
        "sequence_length": ("sequences", "length"),
        "sequence_period": ("sequences", "period"),
        "alpha": ("prioritized", "alpha"),
        "beta0": ("prioritized", "beta0"),
        "beta_final": ("prioritized", "beta_final"),
        "beta_steps": ("prioritized", "beta_steps"),
        "weight_norm": ("prioritized", "weight_norm"),
        "samples_per_insert": ("rate_limiter", "samples_per_insert"),
        "min_size_to_sample": ("rate_limiter", "min_size_to_sample"),
        "error_buffer": ("rate_limiter", "error_buffer"),
        "max_policy_lag": ("max_policy_lag",),
        "release_on_sample": ("release_on_sample",),
        "peer_timeout_s": ("peer_timeout_s",),
        "persist": ("persist",),
        "snapshot_interval_s": ("snapshot_interval_s",),
    }
    """TOML key -> the field it sets: a field of its own, or (part, the part config's field).
    The order is the section's in ``dumps`` and in the unknown-key error."""

    def flat(self) -> dict[str, Any]:
        """The section as its TOML keys (what ``dumps`` writes; what the persisted table's
        fingerprint is taken over, so a snapshot re-attaches whatever the parts' layout)."""
        return {key: functools.reduce(getattr, path, self) for key, path in self.KEYS.items()}

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> ReplayConfig:
        """The section from TOML keys (each one of ``KEYS``; the others keep their defaults)."""
        parts: dict[str, dict[str, Any]] = {}
        own = {}
        for key, value in values.items():
            path = cls.KEYS[key]
            if len(path) == 1:
                own[path[0]] = value
            else:
                parts.setdefault(path[0], {})[path[1]] = value
        defaults = cls()
        return cls(**own, **{part: dataclasses.replace(getattr(defaults, part), **fields)
                             for part, fields in parts.items()})

    @classmethod
    def key_type(cls, key: str) -> Any:
        """The type hint of the field TOML key ``key`` sets."""
        *parts, name = cls.KEYS[key]
        owner = cls
        for part in parts:
            owner = typing.get_type_hints(owner)[part]
        return typing.get_type_hints(owner)[name]


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
    """Seconds of wall-clock between checkpoints (and one at the end and at ``rlpipe stop``): what a
    killed run loses of its learning, whatever its length."""
    timeout_ms: int = 5000
    """How long to wait for a batch before asking replay again."""
    autocast: str = "off"
    """off | bf16: run the algorithm's update under ``torch.autocast`` with bfloat16 (CPU and
    CUDA): matrix products and convolutions in bf16, parameters, gradients and optimizer state
    in fp32. Pays on CPUs with bf16 instructions (avx512_bf16, AMX) and on GPUs
    (docs/benchmarks.md, "Learner step")."""
    threads: int = 1
    """torch (and BLAS) intra-op threads of the learner process: more pay only where the other
    processes leave cores idle (docs/benchmarks.md, "Learner step")."""


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
    opponents: tuple[str, ...] = ("random", "heuristic")
    """In a two-player turn-based PettingZoo game, each evaluation also plays ``episodes`` greedy
    games against each of these opponents (OPPONENTS; half the games in each seat, rounded up) and
    reports the win / draw / loss rate per seat (eval.csv, TensorBoard, Prometheus); empty: none.
    Other envs play no games."""
    video: bool = False
    """The evaluator also plays one more greedy episode of each version it evaluates and records
    it to <run>/videos/eval_v<version>.mp4 (a gymnasium env that renders RGB frames), which
    W&B gets as eval/video; it costs that episode's rendering and encoding every evaluation."""


@dataclass(frozen=True)
class LoggingConfig:
    """Where the learner's progress rows go besides progress.csv and TensorBoard (``tb/``, always
    written): Weights & Biases, when ``wandb`` is on (the ``wandb`` extra: pip install rlpipe[wandb])."""
    wandb: bool = False
    """Also log the progress scalars (against env steps) and the resolved config to a W&B run
    whose files go in the run directory; ``launch --resume`` continues the same W&B run."""
    project: str = ""
    """W&B project the run goes to (empty: ``WANDB_PROJECT``, else rlpipe)."""
    entity: str = ""
    """W&B entity (user or team; empty: the logged-in user's default)."""
    group: str = ""
    """W&B group, e.g. one per grid or set of seeds (empty: none)."""
    tags: tuple[str, ...] = ()
    """W&B tags of the run."""
    mode: str = ""
    """online (synced as it runs), offline (written to the run directory only; ``wandb sync
    <run>/wandb/offline-run-*`` uploads it later), disabled (W&B is not started at all), or
    empty: W&B's own settings decide (``WANDB_MODE``, else online)."""
    timeout_s: float = 30.0
    """Seconds W&B's start (``wandb.init``) and its finish at the run's end may take, each; past
    them the run goes on, or ends, without W&B (said in the learner's log). W&B gets the rows from
    a thread of its own, so it never holds up an update."""

    @property
    def to_wandb(self) -> bool:
        """Whether the learner starts a W&B run (``wandb`` on, ``mode`` not disabled)."""
        return self.wandb and self.mode != "disabled"


@dataclass(frozen=True)
class SelfPlayConfig:
    """Self-play against a pool of past versions in a two-player zero-sum game
    (``shared.transport.pool``, docs/architecture.md, "Self-play against a pool of past versions"):
    on each board one seat acts with the learner's current policy and the other with a past
    version drawn from the pool; only the learner's seat is trained unless ``train_both_seats``."""
    pool: str = ""
    """How the opponent's version is drawn (POOLS): latest (the newest snapshot), uniform (over
    the last ``size`` snapshots), prioritised (over them, weighted by how often each beats the
    learner); empty: off (both seats act with the current policy and both are trained)."""
    size: int = 8
    """K: the snapshots the pool keeps (in the run directory's pool/) and draws from."""
    snapshot_every: int = 20
    """N: the learner adds its policy to the pool every N updates (and version 0 at the start)."""
    train_both_seats: bool = False
    """Also train on the opponent seat's moves (acted by the drawn past version: off-policy data,
    its behaviour log-probabilities and values are the snapshot's); for symmetric games whose two
    seats one shared policy plays. False: the opponent's columns are masked out of every loss."""
    second_seat_share: float = 0.5
    """The share of the boards on which the learner's seat is the second player (spread evenly
    over the run's boards; 0.5: every other board). Above 0.5 where moving second is the harder
    side to learn (Connect Four's first player wins with perfect play)."""
    scripted: dict[str, float] = field(default_factory=dict)
    """Scripted players among the opponents: the share of the learner seat's games each player of
    SCRIPTED plays in place of a pool version, drawn as a game starts (e.g. ``{ heuristic = 0.125 }``;
    the other games draw from the pool). A policy that only meets its own past versions is never
    punished for what they all let pass: the heuristic takes every win left on the board and
    blocks every threat (docs/benchmarks.md, "Connect Four: what the self-play policy misses")."""

    @property
    def on(self) -> bool:
        """Whether the opponent seat acts with past versions."""
        return bool(self.pool)


POOLS = ("latest", "uniform", "prioritised")
"""How ``selfplay.pool`` draws the opponent's version."""
SCRIPTED = ("random", "heuristic")
"""The scripted players (``shared.envs.players.PLAYERS``)."""
OPPONENTS = (*SCRIPTED, "latest")
"""The opponents a policy plays two-player games against (services/evaluator/matches.py):
``eval.opponents``, ``rlpipe evaluate --opponent``."""
WANDB_MODES = ("online", "offline", "disabled")
"""``logging.mode``'s values besides empty (W&B's settings decide)."""
INFERENCE = ("auto", "local", "server")
AUTOCAST = ("off", "bf16")
"""What ``learner.autocast`` may be."""
SCHEDULE_BY = ("env_steps", "budget")
"""What ``run.schedule_by`` may be."""


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
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    selfplay: SelfPlayConfig = field(default_factory=SelfPlayConfig)

    @property
    def algo_spec(self) -> AlgoSpec:
        """What ``algo_name`` names (``shared.algos.registry``): its agent, batches, tables."""
        return registry.resolve(self.algo_name)


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
    "logging": LoggingConfig,
    "selfplay": SelfPlayConfig,
}


def most_count(section) -> int:
    """The most instances of a scalable service (``sampler``, ``action_server``) the run may have:
    its ``max_count``, at least its ``count``."""
    return max(section.count, section.max_count)


