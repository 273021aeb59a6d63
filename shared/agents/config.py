"""What the agents are made of and what they emit, torch-free.

The config dataclasses of the encoder (``ModelConfig``) and of each agent family, and the
per-step agent-info layouts (namedarraytuples of numpy scalars) that size the samplers'
shared-memory buffers. Samplers in server mode, replay and the launcher read these without
importing torch; ``shared.agents.models`` and the agents (``shared.agents``) build on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.data.namedarraytuple import namedarraytuple
from shared.runtime.plugins import is_reference

ACTIVATIONS = ("tanh", "relu")
ENCODERS = ("auto", "mlp", "nature_cnn", "minatar_cnn", "board_cnn")

AgentInfo = namedarraytuple("AgentInfo", ["log_prob", "value"])
"""Per env and step: log-prob of the sampled action and V(obs) under the behaviour policy."""
QAgentInfo = namedarraytuple("QAgentInfo", ["value"])
"""Per env and step: max_a Q(obs, a) under the behaviour parameters (expected Q for C51)."""
QpgAgentInfo = namedarraytuple("QpgAgentInfo", [])
"""Q-policy-gradient agents keep nothing per step: their losses need only (s, a, r, s')."""
RnnState = namedarraytuple("RnnState", ["h", "c"])
"""The LSTM cores' state per env: hidden and cell vectors, float32 [cores, lstm_size] each
(one core, or a policy and a value core: ``lstm_cores``)."""
Memory = namedarraytuple("Memory", ["prev_action", "prev_reward", "state"])
"""What a recurrent agent's step took besides the observation, per env: the previous action
and reward (zeros at an episode's first step) and the ``RnnState`` it started from (zeros
at an episode's first step). Stored with every step, so a segment or sequence carries the
state at its first step and the learner replays the same inputs."""
RecurrentAgentInfo = namedarraytuple("RecurrentAgentInfo", ["log_prob", "value", "memory"])
"""``AgentInfo`` of a recurrent policy-gradient agent, with its ``Memory``."""
RecurrentQAgentInfo = namedarraytuple("RecurrentQAgentInfo", ["value", "memory"])
"""``QAgentInfo`` of a recurrent Q agent (R2D1), with its ``Memory``."""
FAMILIES = ("pg", "q", "qpg")
"""Agent families: policy gradient (A2C, PPO), Q-learning (DQN family), Q-policy-gradient (DDPG, TD3, SAC)."""
NOISES = ("gaussian", "ou")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the network that encodes observations."""

    hidden_sizes: tuple[int, ...] = (64, 64)
    """Widths of the MLP trunk after the (CNN-)flattened observation; () = no trunk."""
    activation: str = "tanh"
    """Nonlinearity of the MLP trunk: tanh | relu (the CNNs always use relu)."""
    encoder: str = "auto"
    """auto (Nature CNN for 3-D uint8 image leaves of at least 36x36, flatten otherwise) | mlp | nature_cnn
    | minatar_cnn (the MinAtar paper's 16-filter 3x3 conv on [H, W, C] maps; with hidden_sizes = [128]
    and activation = "relu" it is Young & Tian's network) | board_cnn (three 3x3 conv layers of 32
    filters, same padding, on [H, W, C] boards: a unit sees 7x7 cells, a line of four at Connect
    Four), or ``"module:attribute"`` naming your own
    encoder (``shared.agents.models.CustomEncoder``)."""
    layer_norm: bool = False
    """A LayerNorm after each linear layer of the MLP trunk, before its activation (PQN's
    Q-network, Gallici et al. 2024). Q and policy-gradient agents; the Q-policy-gradient
    critics have batch renormalization instead (CrossQ). Such agents act in torch."""
    uint8_scale: float = 1.0 / 255.0
    """Factor for uint8 observation leaves: 1/255 for pixels, 1.0 for 0/1 maps (MinAtar)."""
    normalize_observations: bool = False
    """Normalise a float observation array by the running mean and variance of every env step
    inserted into replay (the learner keeps them in the agent's state: the actors, checkpoints
    and ``rlpipe evaluate`` use the same); for MuJoCo-like observations of mixed scales."""
    obs_clip: float = 10.0
    """Normalised observations are clipped to +-this."""
    lstm_size: int = 0
    """Width of an LSTM core after the encoder (0 = a feed-forward agent). Each env's state lives
    where its actions are computed (action-server or local sampler), resets at episode starts
    and is stored with every step (``Memory``); learners replay whole sequences from it."""
    lstm_prev_action: bool = False
    """Feed the previous action (one-hot for discrete spaces) to the LSTM with the features."""
    lstm_prev_reward: bool = False
    """Feed the previous reward to the LSTM with the features."""
    action_mask: str = "auto"
    """The observation key of the legal actions (``shared.agents.masking``): "auto" = ``action_mask``
    where a Dict observation has it, a key path (``"legal"``, ``"inner.mask"``) = that leaf, which
    must exist, "" = no masking. The leaf is MultiBinary(n) or a bool Box of n, n = the Discrete
    space's size (sum(nvec) for MultiDiscrete); PPO, A2C and the DQN family (R2D1 too) never pick
    an illegal action, in acting, evaluation, export and the DQN targets' bootstrap action."""

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"ModelConfig.activation: {self.activation!r} unknown; use one of {ACTIVATIONS}"
            )
        if self.encoder not in ENCODERS and not is_reference(self.encoder):
            raise ValueError(f"ModelConfig.encoder: {self.encoder!r} unknown; use one of {ENCODERS} or "
                             "'module:attribute' naming your own (shared.agents.models.CustomEncoder)")
        if self.obs_clip <= 0:
            raise ValueError(f"ModelConfig.obs_clip: must be > 0, got {self.obs_clip}")
        if any(int(h) <= 0 for h in self.hidden_sizes):
            raise ValueError(f"ModelConfig.hidden_sizes: widths must be positive, got {self.hidden_sizes}")
        if self.lstm_size < 0:
            raise ValueError(f"ModelConfig.lstm_size: must be >= 0 (0 = no LSTM), got {self.lstm_size}")


@dataclass(frozen=True)
class PgAgentConfig:
    """Policy-gradient agent options beyond the encoder shape (``ModelConfig``)."""

    init_log_std: float = 0.0
    """Initial log standard deviation of the Gaussian policy (Box actions only)."""
    shared_encoder: bool = False
    """One encoder for policy and value (CleanRL's Atari agent) instead of two (its MLP agent)."""


@dataclass(frozen=True)
class QAgentConfig:
    """Q-agent options beyond the encoder shape (``ModelConfig``), exploration included.

    Epsilon of env j (global index among N envs) after ``env_steps`` env steps of the run::

        eps_final_j = eps_end                                   if apex_alpha == 0
                    = apex_eps_base ** (1 + apex_alpha * j / (N - 1))   otherwise (j/(N-1) = 0 if N = 1)
        eps_j       = eps_start + (eps_final_j - eps_start) * min(1, env_steps / eps_decay_steps)

    i.e. every env anneals linearly from eps_start to its own final epsilon; with
    eps_decay_steps = 0 the final values hold from the start (Ape-X's fixed epsilons,
    Horgan et al. 2018, with apex_alpha = 7).
    """

    dueling: bool = False
    """Dueling head: Q = V + A - mean_a A (per atom with distributional)."""
    distributional: bool = False
    """C51: a categorical distribution over n_atoms returns per action instead of one Q."""
    n_atoms: int = 51
    """Atoms of the C51 support (distributional only)."""
    v_min: float = -10.0
    """Lowest atom of the C51 support, in return units (discounted reward sums)."""
    v_max: float = 10.0
    """Highest atom of the C51 support, in return units."""
    head_hidden_sizes: tuple[int, ...] = ()
    """Hidden widths of each head stream (value and advantage each get their own) on the encoder."""
    eps_start: float = 1.0
    """Epsilon at env step 0."""
    eps_end: float = 0.05
    """Epsilon after eps_decay_steps env steps (every env's, unless apex_alpha > 0)."""
    eps_decay_steps: int = 10_000
    """Env steps (of the whole run, all envs) of the linear decay; 0 = final values at once."""
    eps_eval: float = 0.001
    """Epsilon of evaluation episodes."""
    apex_alpha: float = 0.0
    """0 = one epsilon for all envs; > 0 = Ape-X spread of final epsilons over envs (see class doc)."""
    apex_eps_base: float = 0.4
    """Base of the Ape-X spread: env 0 ends at this epsilon, env N-1 at base ** (1 + apex_alpha)."""

    def __post_init__(self) -> None:
        if self.distributional and (self.n_atoms < 2 or not self.v_min < self.v_max):
            raise ValueError(
                f"QAgentConfig: distributional needs n_atoms >= 2 and v_min < v_max, got "
                f"n_atoms={self.n_atoms}, v_min={self.v_min}, v_max={self.v_max}"
            )
        for name in ("eps_start", "eps_end", "eps_eval", "apex_eps_base"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"QAgentConfig.{name}: must be in [0, 1], got {getattr(self, name)}")
        if self.eps_decay_steps < 0 or self.apex_alpha < 0:
            raise ValueError(
                f"QAgentConfig: eps_decay_steps and apex_alpha must be >= 0, got "
                f"{self.eps_decay_steps} and {self.apex_alpha}"
            )

    def epsilon(self, env_steps: int, env_index: np.ndarray | int, n_envs_total: int) -> np.ndarray:
        """Exploration epsilons float32, shaped like ``env_index``, after ``env_steps`` env steps.

        ``env_index``: global indices in [0, n_envs_total) of the envs asking (the Ape-X
        spread depends on them); see the class doc for the formula.
        """
        j = np.asarray(env_index, dtype=np.float64)
        if self.apex_alpha > 0:
            spread = j / (n_envs_total - 1) if n_envs_total > 1 else np.zeros_like(j)
            final = self.apex_eps_base ** (1.0 + self.apex_alpha * spread)
        else:
            final = np.full_like(j, self.eps_end)
        frac = min(1.0, env_steps / self.eps_decay_steps) if self.eps_decay_steps > 0 else 1.0
        return (self.eps_start + (final - self.eps_start) * frac).astype(np.float32)


@dataclass(frozen=True)
class QuantileHead:
    """The return head of QR-DQN and IQN (Dabney et al. 2017, 2018): per action, values of the
    return's quantiles at fractions tau in (0, 1); Q is their mean. The algorithm's ``[algo]``
    section sets it (``qr_dqn``: fixed fractions, ``iqn``: sampled ones), not ``[agent]``.
    Exactly one of ``n_quantiles`` and ``n_cosines`` is > 0."""

    n_quantiles: int = 0
    """QR-DQN: the head outputs N quantiles per action at the fixed fractions (2i + 1) / 2N."""
    n_cosines: int = 0
    """IQN: a fraction tau enters as cos(pi i tau), i = 0..n-1, then a ReLU linear layer to the
    feature width, multiplied into the encoder's features; the head maps each product to one
    quantile value per action."""
    acting_samples: int = 32
    """IQN: fractions drawn U(0, 1) per observation to estimate Q for acting and for double-Q's
    bootstrap action (K)."""
    merge_hidden_sizes: tuple[int, ...] = ()
    """IQN: widths of the fully connected layers (``model.activation``) between the product of
    features and embedding and the head; () = the head right on the product."""

    def __post_init__(self) -> None:
        if (self.n_quantiles > 0) == (self.n_cosines > 0) or min(self.n_quantiles, self.n_cosines) < 0:
            raise ValueError(f"QuantileHead: exactly one of n_quantiles (QR-DQN) and n_cosines (IQN) must be > 0, got "
                             f"{self.n_quantiles} and {self.n_cosines}")
        if self.merge_hidden_sizes and (self.n_cosines == 0 or min(self.merge_hidden_sizes) < 1):
            raise ValueError(f"QuantileHead.merge_hidden_sizes: IQN only (n_cosines > 0), widths >= 1, got "
                             f"{self.merge_hidden_sizes} with n_cosines {self.n_cosines}")
        if self.acting_samples < 1:
            raise ValueError(f"QuantileHead.acting_samples: must be >= 1, got {self.acting_samples}")

    @property
    def implicit(self) -> bool:
        """IQN's head: quantile values at fractions given with each call."""
        return self.n_cosines > 0


@dataclass(frozen=True)
class QpgAgentConfig:
    """Q-policy-gradient agent options (DDPG, TD3, SAC) beyond the encoder shape, exploration included.

    Actions are computed in units of the Box: [-1, 1] per dimension, mapped linearly onto
    [low, high] for the env (the bounds must be finite). Exploration, in the action-server
    or the local sampler: for the first ``random_steps`` env steps of the run, uniformly
    random actions; after that the deterministic actor's action plus ``noise`` (``noise_scale``
    is the standard deviation in units of half the action range, as TD3's 0.1 * max_action)
    clipped to the bounds, or the SAC actor's tanh-squashed sample. Evaluation acts with the
    actor's mean. Ornstein-Uhlenbeck noise keeps one state per env, reset at episode start:
    x <- x + ou_theta * (0 - x) * ou_dt + noise_scale * sqrt(ou_dt) * N(0, 1).
    """

    random_steps: int = 0
    """Env steps (of the whole run) with uniformly random actions before the actor takes over."""
    noise: str = "gaussian"
    """DDPG/TD3 exploration noise: gaussian (independent per step) | ou (Ornstein-Uhlenbeck per env)."""
    noise_scale: float = 0.1
    """Noise standard deviation in units of half the action range (DDPG/TD3)."""
    ou_theta: float = 0.15
    """OU mean-reversion rate."""
    ou_dt: float = 1e-2
    """OU time step."""
    log_std_min: float = -5.0
    """SAC: the actor's log standard deviation is squashed into [log_std_min, log_std_max]."""
    log_std_max: float = 2.0
    """SAC: upper bound of the actor's log standard deviation."""

    def __post_init__(self) -> None:
        if self.noise not in NOISES:
            raise ValueError(f"QpgAgentConfig.noise: {self.noise!r} unknown; use one of {NOISES}")
        if self.random_steps < 0 or self.noise_scale < 0 or self.ou_theta < 0 or self.ou_dt <= 0:
            raise ValueError("QpgAgentConfig: need random_steps >= 0, noise_scale >= 0, ou_theta >= 0 and ou_dt > 0")
        if not self.log_std_min < self.log_std_max:
            raise ValueError(f"QpgAgentConfig: log_std_min ({self.log_std_min}) must be below log_std_max "
                             f"({self.log_std_max})")


@dataclass(frozen=True)
class CriticConfig:
    """The Q-critics of a Q-policy-gradient agent, as its algorithm asks for them
    (``QpgConfig.critic()``: they are part of the algorithm's design, so its ``[algo]``
    section sets them)."""

    n: int = 1
    """Q-networks side by side (one ``EnsembleMLP``)."""
    hidden_sizes: tuple[int, ...] = ()
    """Widths of each critic's MLP on the encoded observation and the action; () = ``model.hidden_sizes``."""
    outputs: int = 1
    """Outputs of each critic: 1 = a Q-value, more = that many quantiles of the return (TQC)."""
    batch_renorm: bool = False
    """Batch renormalization (Ioffe 2017) before every linear layer of the critics, the input's
    included (CrossQ, Bhatt et al. 2024; ``shared.agents.models.BatchRenorm``)."""
    renorm_momentum: float = 0.01
    """Running statistics <- (1 - momentum) * running + momentum * batch statistics."""
    renorm_eps: float = 1e-3
    """Added to the variance before its square root."""
    renorm_warmup_steps: int = 100_000
    """Training forward passes that normalise with the batch's statistics alone (plain batch
    norm) before the running statistics correct them (r clipped to [1/3, 3], d to [-5, 5])."""

    def __post_init__(self) -> None:
        if self.n < 1 or self.outputs < 1 or any(int(h) <= 0 for h in self.hidden_sizes):
            raise ValueError(f"CriticConfig: need n >= 1, outputs >= 1 and positive widths, got n={self.n}, "
                             f"outputs={self.outputs}, hidden_sizes={self.hidden_sizes}")
        check_renorm(self)


@dataclass(frozen=True)
class ActorConfig:
    """The actor of a Q-policy-gradient agent as its algorithm asks for it (``QpgConfig.actor()``,
    like the critics: CrossQ's ``[algo]`` section sets it). Its widths are ``model.hidden_sizes``."""

    batch_renorm: bool = False
    """Batch renormalization (``shared.agents.models.BatchRenorm``) before every linear layer of
    the actor, the input's and the output head's included (CrossQ's actor, the paper's and
    sb3-contrib's). Acting (``QpgAgent.step``: action-server, samplers, evaluation) and export
    read the running statistics; the learner's actor loss trains them (``QpgAgent.actor_mode``).
    The numpy acting plan has no batch renorm (DDPG/TD3/SAC agents act in torch anyway)."""
    renorm_momentum: float = 0.01
    """Running statistics <- (1 - momentum) * running + momentum * batch statistics."""
    renorm_eps: float = 1e-3
    """Added to the variance before its square root."""
    renorm_warmup_steps: int = 100_000
    """Training forward passes (actor steps, one every ``policy_delay`` critic updates) of plain
    batch norm before the running statistics correct the batch's."""

    def __post_init__(self) -> None:
        check_renorm(self)


def check_renorm(cfg) -> None:
    """ValueError naming the config and field unless its batch renorm settings are in range."""
    name = type(cfg).__name__
    if not 0.0 < cfg.renorm_momentum <= 1.0:
        raise ValueError(f"{name}.renorm_momentum: must be in (0, 1], got {cfg.renorm_momentum}")
    if not cfg.renorm_eps > 0:
        raise ValueError(f"{name}.renorm_eps: must be > 0, got {cfg.renorm_eps}")
    if cfg.renorm_warmup_steps < 0:
        raise ValueError(f"{name}.renorm_warmup_steps: must be >= 0, got {cfg.renorm_warmup_steps}")


def lstm_cores(family: str, agent) -> int:
    """LSTM cores of a recurrent agent: a policy-gradient agent without ``shared_encoder`` has
    one for the policy and one for the value (as SB3-contrib's RecurrentPPO and rl_games'
    separate actor-critic); every other agent has one."""
    return 2 if family == "pg" and not agent.shared_encoder else 1


def info_example(family: str, model: ModelConfig = ModelConfig(), action_example=None, agent=None):
    """One env's agent info of zeros for an agent family (``FAMILIES``); with
    ``model.lstm_size`` the recurrent variant, whose ``Memory.prev_action`` is shaped like
    ``action_example`` (one env's action) and whose state has ``lstm_cores(family, agent)``
    rows (``agent``: the family's agent config, its defaults if None)."""
    zero = np.zeros((), np.float32)
    if model.lstm_size and family == "qpg":
        raise ValueError("model.lstm_size: recurrent agents exist for the pg (ppo, a2c) and q (r2d1) families only")
    if not model.lstm_size:
        return {"pg": AgentInfo(log_prob=zero, value=zero), "q": QAgentInfo(value=zero)}.get(family, QpgAgentInfo())
    if action_example is None:
        raise ValueError("info_example: a recurrent agent's info needs the action example")
    if agent is None:
        agent = PgAgentConfig() if family == "pg" else QAgentConfig()
    h = np.zeros((lstm_cores(family, agent), model.lstm_size), np.float32)
    memory = Memory(prev_action=np.zeros_like(action_example), prev_reward=zero, state=RnnState(h=h, c=h.copy()))
    if family == "pg":
        return RecurrentAgentInfo(log_prob=zero, value=zero, memory=memory)
    return RecurrentQAgentInfo(value=zero, memory=memory)
