"""Hyperparameters of the algorithms: one frozen dataclass each, torch-free.

They live apart from the losses so that every process can read and validate a config
(the launcher, replay, metrics) without importing torch; the algorithm modules re-export
their own class (``from shared.algos.ppo import PPOConfig`` keeps working).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from shared.agents.config import ActorConfig, CriticConfig, check_renorm


ADVANTAGES = ("gae", "vtrace")
"""How A2C and PPO turn a segment batch into advantages and value targets (``PgTargetsConfig.advantages``)."""


@dataclass(frozen=True)
class PgTargetsConfig:
    """What A2C, PPO and IMPALA share: the advantages and value targets of a segment batch
    (``shared.algos.gae.pg_targets``)."""

    gamma: float = 0.99
    """Discount factor."""
    gae_lambda: float = 1.0
    """lambda of the targets (1 = n-step / Monte-Carlo returns bootstrapped at the segment end,
    0 = TD(0)): GAE's lambda, or with V-trace the lambda of the traces c_t = lambda min(c_bar, pi/mu)."""
    reward_scale: float = 1.0
    """Rewards are multiplied by this before the targets (the value net learns scaled returns)."""
    value_norm: bool = False
    """The value net learns the returns normalised by their running mean and standard deviation
    over the run (MAPPO's ValueNorm, ``shared/algos/value_norm.py``): returns of any size without
    choosing ``reward_scale`` for them (both may be set: the rewards are scaled first)."""
    recompute_values: bool = True
    """Targets from the current value net's V(s_t) instead of the stale behaviour values."""
    advantages: str = "gae"
    """gae: GAE(lambda) (no correction for policy lag); vtrace: V-trace (Espeholt et al. 2018),
    which corrects lagged segments with the truncated ratios of the current policy to the
    behaviour one (``shared/algos/vtrace.py``). PPO with vtrace is APPO as in Sample Factory:
    the clipped objective on V-trace advantages and value targets."""
    vtrace_rho_bar: float = 1.0
    """V-trace: the importance weights of the temporal differences are min(rho_bar, pi/mu); they
    fix what the targets estimate (inf: V of the current policy; smaller: nearer mu's)."""
    vtrace_c_bar: float = 1.0
    """V-trace: the traces are lambda min(c_bar, pi/mu); they bound the variance, not the fixed point."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.advantages not in ADVANTAGES:
            raise ValueError(f"{name}.advantages = {self.advantages!r}: allowed: {', '.join(ADVANTAGES)}")
        if not 0.0 <= self.gae_lambda <= 1.0 or not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"{name}: need 0 <= gamma <= 1 and 0 <= gae_lambda <= 1, got {self.gamma} and "
                             f"{self.gae_lambda}")
        if not (self.vtrace_rho_bar > 0 and self.vtrace_c_bar > 0):  # also refuses NaN
            raise ValueError(f"{name}: vtrace_rho_bar and vtrace_c_bar must be > 0 (inf: no truncation), got "
                             f"{self.vtrace_rho_bar} and {self.vtrace_c_bar}")


@dataclass(frozen=True)
class PPOConfig(PgTargetsConfig):
    """PPO hyperparameters (defaults: CleanRL's ppo.py)."""

    lr: float = 2.5e-4
    """Adam learning rate at the start of the run."""
    anneal_lr: bool = True
    """Decay the learning rate linearly to 0 over the run (progress 0 -> 1)."""
    adam_eps: float = 1e-5
    """Adam epsilon."""
    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    """Clip range of the probability ratio."""
    anneal_clip: bool = False
    """Decay the clip range linearly to 0 over the run, as the learning rate (rl-zoo's lin_0.2)."""
    value_clip: float = 0.2
    """Clip range of the value change around the V(s_t) the targets were computed with; 0 = no value clipping."""
    value_coef: float = 0.5
    """Weight of the value loss 0.5 * (V - R)^2."""
    entropy_coef: float = 0.01
    """Weight of the entropy bonus."""
    epochs: int = 4
    """Passes over each batch."""
    minibatches: int = 4
    """Minibatches per pass (the batch of T*B samples is split in this many)."""
    normalize_advantage: bool = True
    """Normalise advantages to zero mean, unit std per minibatch."""
    max_grad_norm: float = 0.5
    """Clip the global gradient norm to this; 0 = no clipping."""
    target_kl: float = 0.0
    """Stop the epochs early once a minibatch's approx KL exceeds this; 0 = never."""


OPTIMIZERS = ("adam", "radam", "rmsprop")
"""What a config's ``optimizer`` field may name (``shared.algos.optim.optimizer``): torch's Adam
(fused), RAdam (Liu et al. 2020, rectified Adam) or RMSprop."""


def check_optimizer(config: object, allowed: tuple[str, ...] = OPTIMIZERS) -> None:
    """ValueError naming ``<Config>.optimizer`` unless it is one of ``allowed``."""
    if config.optimizer not in allowed:
        raise ValueError(f"{type(config).__name__}.optimizer: {config.optimizer!r} unknown; use one of "
                         f"{', '.join(allowed)}")


LOSS_REDUCTIONS = ("mean", "sum")
"""How A2C and IMPALA reduce their loss over a batch's steps (``A2CConfig.loss_reduction``)."""


@dataclass(frozen=True)
class A2CConfig(PgTargetsConfig):
    """A2C hyperparameters (defaults: Stable-Baselines3's A2C)."""

    lr: float = 7e-4
    """Learning rate at the start of the run."""
    anneal_lr: bool = False
    """Decay the learning rate linearly to 0 over the run (progress 0 -> 1)."""
    optimizer: str = "rmsprop"
    """rmsprop | adam | radam."""
    rmsprop_alpha: float = 0.99
    """RMSprop smoothing constant."""
    optimizer_eps: float = 1e-5
    """Epsilon of the optimizer."""
    value_coef: float = 1.0
    """Weight of the value loss 0.5 * (V - R)^2 (1.0 here = SB3's vf_coef 0.5 on a plain MSE)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    normalize_advantage: bool = False
    """Normalise advantages to zero mean, unit std over the batch."""
    max_grad_norm: float = 0.5
    """Clip the global gradient norm to this; 0 = no clipping."""
    loss_reduction: str = "mean"
    """How the loss reduces over the batch's T x B steps: mean (SB3, CleanRL) or sum (IMPALA and
    torchbeast: the learning rate, RMSprop's epsilon and the gradient clip are sized for the sum's
    gradients, T x B times the mean's)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_optimizer(self)
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"{type(self).__name__}.loss_reduction = {self.loss_reduction!r}: allowed: "
                             f"{', '.join(LOSS_REDUCTIONS)}")


@dataclass(frozen=True)
class ImpalaConfig(A2CConfig):
    """IMPALA's learner (Espeholt et al. 2018) in one process: A2C's single gradient step on V-trace
    targets and rho-weighted advantages (defaults: the paper's Atari settings, rho_bar = c_bar = 1,
    lambda 1, RMSprop lr 6e-4 with epsilon 0.01 annealed linearly to 0 over the run, baseline cost
    0.5, entropy 0.01, gradient clip 40, on the loss summed over T x B as the paper's and
    torchbeast's code sum it: on a mean, T x B times smaller, epsilon would dwarf the gradients
    and the clip never act)."""

    advantages: str = "vtrace"
    lr: float = 6e-4
    anneal_lr: bool = True
    loss_reduction: str = "sum"
    optimizer_eps: float = 0.01
    value_coef: float = 0.5
    entropy_coef: float = 0.01
    max_grad_norm: float = 40.0


C51_PRIORITIES = ("kl", "cross_entropy")
"""What a C51 update returns as priorities (``DQNConfig.c51_priority``)."""


@dataclass(frozen=True)
class DQNConfig:
    """DQN hyperparameters (defaults: double DQN as tuned on CartPole-v1 with 5-step returns)."""

    lr: float = 1e-3
    """Adam learning rate at the start of the run."""
    anneal_lr: bool = False
    """Decay the learning rate linearly to 0 over the run (progress 0 -> 1)."""
    adam_eps: float = 1e-8
    """Adam epsilon (Rainbow: 1.5e-4 with lr 6.25e-5)."""
    batch_size: int = 128
    """Transitions in one batch (the learner asks replay for this many per update)."""
    double: bool = True
    """Double DQN: the online net chooses the bootstrap action, the target net evaluates it."""
    target_update_period: int = 100
    """Updates between target-network updates."""
    target_tau: float = 1.0
    """Every period: target <- tau * online + (1 - tau) * target (1 = hard copy; period 1, tau < 1 = Polyak)."""
    huber_delta: float = 1.0
    """Huber loss threshold on the TD error; 0 = squared error 0.5 * td^2. QR-DQN and IQN: kappa of
    the quantile Huber loss (Dabney et al.: 1); 0 = the plain quantile loss |tau - 1{u < 0}| |u|.
    C51 has none."""
    max_grad_norm: float = 10.0
    """Clip the global gradient norm to this; 0 = no clipping."""
    c51_priority: str = "kl"
    """C51 only: the replay priority of an item, kl (KL(target || online), the Rainbow paper and
    rlpyt; 0 when the distributions agree) or cross_entropy (Dopamine; the KL plus the target's
    entropy, so a wide target distribution keeps a high priority however well it is fitted)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.target_update_period < 1:
            raise ValueError(
                f"DQNConfig: batch_size and target_update_period must be >= 1, got "
                f"{self.batch_size} and {self.target_update_period}"
            )
        if self.c51_priority not in C51_PRIORITIES:
            raise ValueError(f"DQNConfig.c51_priority = {self.c51_priority!r}: allowed: {', '.join(C51_PRIORITIES)}")
        if not 0.0 < self.target_tau <= 1.0:
            raise ValueError(f"DQNConfig.target_tau: must be in (0, 1], got {self.target_tau}")


@dataclass(frozen=True)
class QRDQNConfig(DQNConfig):
    """QR-DQN (Dabney et al. 2017): DQN on N return quantiles per action at the fixed fractions
    (2i + 1) / 2N, learned with the quantile Huber loss (kappa = ``huber_delta``); Q is their
    mean. Double, dueling (``agent.dueling``), n-step and prioritized replay combine as for C51;
    an item's priority is its quantile Huber loss."""

    n_quantiles: int = 200
    """Quantiles per action (N; the paper: 200)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_quantiles < 1:
            raise ValueError(f"QRDQNConfig.n_quantiles: must be >= 1, got {self.n_quantiles}")


@dataclass(frozen=True)
class IQNConfig(DQNConfig):
    """IQN (Dabney et al. 2018): the quantile Huber loss (kappa = ``huber_delta``) of N online
    quantiles against N' target quantiles, each at fractions drawn U(0, 1) afresh per item and
    update; a fraction enters the network as a cosine embedding multiplied into the features.
    Acting (and double-Q's bootstrap action) takes Q as the mean of K sampled quantiles.
    Combines with double, dueling, n-step and prioritized replay as QR-DQN does."""

    n_taus: int = 64
    """Online quantile fractions per item in the loss (N; the paper: 64)."""
    n_target_taus: int = 64
    """Target quantile fractions per item in the loss (N'; the paper: 64)."""
    n_acting_taus: int = 32
    """Fractions per observation that estimate Q for acting and the double-Q action (K; the paper: 32)."""
    n_cosines: int = 64
    """Cosine features of a fraction, cos(pi i tau) for i = 0..n-1 (the paper: 64)."""
    merge_hidden_sizes: tuple[int, ...] = (512,)
    """Widths of the fully connected layers between the product of the encoder's features and the
    fraction's embedding and the head, with ``model.activation`` (the paper and Dopamine: one of
    512, ReLU); [] = none."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(w < 1 for w in self.merge_hidden_sizes):
            raise ValueError(f"IQNConfig.merge_hidden_sizes: widths must be >= 1, got {list(self.merge_hidden_sizes)}")
        if min(self.n_taus, self.n_target_taus, self.n_acting_taus, self.n_cosines) < 1:
            raise ValueError(f"IQNConfig: n_taus, n_target_taus, n_acting_taus and n_cosines must be >= 1, got "
                             f"{self.n_taus}, {self.n_target_taus}, {self.n_acting_taus}, {self.n_cosines}")


@dataclass(frozen=True)
class PQNConfig:
    """PQN (Gallici et al. 2024): Q-learning on the on-policy queue's segments, no replay buffer
    and no target network; Q(lambda) targets, several epochs of minibatches a batch. The
    Q-network is the agent's (``model.layer_norm = true`` gives the paper's LayerNorm), its
    epsilon-greedy schedule ``[agent]``'s eps_* fields (defaults: CleanRL's pqn.py on CartPole)."""

    lr: float = 2.5e-4
    """Learning rate at the start of the run."""
    anneal_lr: bool = True
    """Decay the learning rate linearly to 0 over the run (progress 0 -> 1)."""
    optimizer: str = "adam"
    """adam (torch's, fused) | radam (RAdam, as CleanRL's pqn.py)."""
    adam_eps: float = 1e-8
    """Epsilon of Adam or RAdam."""
    gamma: float = 0.99
    """Discount factor."""
    q_lambda: float = 0.65
    """lambda of the Q(lambda) targets: 0 = one-step targets r + gamma max_a Q(s', a), 1 = the
    discounted return of the segment, bootstrapped where it is cut (``shared/algos/pqn.py``)."""
    recompute_values: bool = True
    """Targets from the current network's max_a Q at the start of the update instead of the
    behaviour values stored at sampling time (stale by the policy lag)."""
    epochs: int = 4
    """Passes over each batch."""
    minibatches: int = 4
    """Minibatches per pass (the batch of T*B samples is split in this many)."""
    max_grad_norm: float = 10.0
    """Clip the global gradient norm to this; 0 = no clipping."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.q_lambda <= 1.0 or not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"PQNConfig: need 0 <= gamma <= 1 and 0 <= q_lambda <= 1, got {self.gamma} and "
                             f"{self.q_lambda}")
        if self.epochs < 1 or self.minibatches < 1:
            raise ValueError(f"PQNConfig: epochs and minibatches must be >= 1, got {self.epochs} and {self.minibatches}")
        check_optimizer(self, ("adam", "radam"))


@dataclass(frozen=True)
class QpgConfig:
    """What DDPG, TD3, SAC, TQC and CrossQ share: critics regressed on n-step TD targets from
    target networks that trail by Polyak averaging, an actor that climbs the critics."""

    actor_lr: float = 1e-3
    """Adam learning rate of the actor."""
    critic_lr: float = 1e-3
    """Adam learning rate of the critics (one optimizer for all of them)."""
    adam_beta1: float = 0.9
    """Adam beta1 of the actor's and the critics' optimizers (CrossQ: 0.5)."""
    anneal_lr: bool = False
    """Decay the learning rates linearly to 0 over the run (progress 0 -> 1)."""
    batch_size: int = 256
    """Transitions in one batch (the learner asks replay for this many per update)."""
    n_critics: int = 1
    """Q-networks; with more than one the TD target takes their minimum (2: clipped double Q,
    Fujimoto et al. 2018); TQC pools their quantiles instead."""
    critic_hidden_sizes: tuple[int, ...] = ()
    """Widths of each critic's MLP; () = ``model.hidden_sizes`` (the actor's)."""
    policy_delay: int = 1
    """Critic updates per actor update (DDPG/TD3: and per target move; SAC: and per temperature step)."""
    tau: float = 0.005
    """Polyak rate: target <- tau * online + (1 - tau) * target (DDPG/TD3: after every actor
    update; SAC: after every update)."""
    max_grad_norm: float = 0.0
    """Clip each network's global gradient norm to this; 0 = no clipping."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.n_critics < 1 or self.policy_delay < 1:
            raise ValueError(f"{type(self).__name__}: need batch_size, n_critics and policy_delay >= 1, got "
                             f"{self.batch_size}, {self.n_critics} and {self.policy_delay}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"{type(self).__name__}.tau: must be in (0, 1], got {self.tau}")
        if not 0.0 <= self.adam_beta1 < 1.0:
            raise ValueError(f"{type(self).__name__}.adam_beta1: must be in [0, 1), got {self.adam_beta1}")
        self.critic()  # its own checks (widths, batch renorm settings)
        self.actor()

    def critic(self) -> CriticConfig:
        """The critics the agent builds for this algorithm."""
        return CriticConfig(n=self.n_critics, hidden_sizes=tuple(self.critic_hidden_sizes))

    def actor(self) -> ActorConfig:
        """The actor the agent builds for this algorithm: plain (CrossQ's may have batch renorm)."""
        return ActorConfig()


@dataclass(frozen=True)
class DDPGConfig(QpgConfig):
    """DDPG (Lillicrap et al. 2016) with a deterministic actor; TD3 is this with its three changes on."""

    target_noise: float = 0.0
    """Target policy smoothing: std of the Gaussian noise on the target actor's action (units of half the range)."""
    target_noise_clip: float = 0.5
    """The smoothing noise is clipped to +-this before it is added."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.target_noise < 0 or self.target_noise_clip < 0:
            raise ValueError(f"{type(self).__name__}: need target_noise >= 0 and target_noise_clip >= 0")


@dataclass(frozen=True)
class TD3Config(DDPGConfig):
    """TD3 (Fujimoto et al. 2018): twin critics, delayed actor updates, target policy smoothing."""

    n_critics: int = 2
    policy_delay: int = 2
    target_noise: float = 0.2


@dataclass(frozen=True)
class SACConfig(QpgConfig):
    """SAC (Haarnoja et al. 2018, the version with automatic entropy tuning)."""

    actor_lr: float = 3e-4
    critic_lr: float = 3e-4
    n_critics: int = 2
    alpha_lr: float = 3e-4
    """Adam learning rate of log(alpha)."""
    init_alpha: float = 1.0
    """Entropy temperature at the start (and throughout with learn_alpha = false)."""
    learn_alpha: bool = True
    """Tune alpha so that the policy's entropy tracks target_entropy; false = fixed init_alpha."""
    target_entropy: Optional[float] = None
    """Entropy the temperature steers towards; None = -|A| (minus the action dimensions)."""
    target_networks: bool = True
    """Bootstrap from Polyak-averaged target critics; false = from the critics themselves, in
    one forward pass with the batch's own state-actions (CrossQ; tau is then unused)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.init_alpha <= 0:
            raise ValueError(f"{type(self).__name__}.init_alpha: must be > 0, got {self.init_alpha}")


@dataclass(frozen=True)
class TQCConfig(SACConfig):
    """TQC (Kuznetsov et al. 2020): SAC with ``n_critics`` quantile critics whose pooled target
    atoms lose the top ``drop_per_net * n_critics`` (defaults: the paper's M = 5, N = 25, d = 2)."""

    n_critics: int = 5
    n_quantiles: int = 25
    """Quantiles each critic outputs (N), at fractions (2i + 1) / 2N."""
    drop_per_net: int = 2
    """Target atoms dropped per critic (d): of the n_critics * n_quantiles pooled atoms, sorted,
    the top n_critics * drop_per_net go (the knob on the overestimation bias)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_quantiles < 1 or not 0 <= self.drop_per_net < self.n_quantiles:
            raise ValueError(f"TQCConfig: need n_quantiles >= 1 and 0 <= drop_per_net < n_quantiles, got "
                             f"{self.n_quantiles} and {self.drop_per_net}")

    def critic(self) -> CriticConfig:
        return dataclasses.replace(super().critic(), outputs=self.n_quantiles)


@dataclass(frozen=True)
class CrossQConfig(SACConfig):
    """CrossQ (Bhatt et al. 2024): SAC without target networks, with batch-renormalized wide
    critics that see the batch's and the next state-actions in one forward pass, delayed
    actor updates and Adam beta1 0.5 (defaults: the paper's, as sb3-contrib ships them but
    the paper's 2048-wide critics)."""

    actor_lr: float = 1e-3
    critic_lr: float = 1e-3
    alpha_lr: float = 1e-3
    adam_beta1: float = 0.5
    policy_delay: int = 3
    target_networks: bool = False
    critic_hidden_sizes: tuple[int, ...] = (2048, 2048)
    renorm_momentum: float = 0.01
    """Batch renorm: running statistics <- (1 - momentum) * running + momentum * batch's (flax's 0.99 = 1 - this)."""
    renorm_eps: float = 1e-3
    """Batch renorm: added to the variance before its square root."""
    renorm_warmup_steps: int = 100_000
    """Batch renorm: training passes of plain batch norm before the running statistics correct the
    batch's (the critics': critic updates; the actor's: actor steps, every ``policy_delay``-th update)."""
    actor_batch_renorm: bool = True
    """Batch renorm in the actor too, before each of its linear layers, with the critics' settings
    (the paper's and sb3-contrib's actor); false = SAC's plain actor. Acting reads its running
    statistics, the actor loss trains them (``shared.agents.config.ActorConfig``)."""

    def __post_init__(self) -> None:
        check_renorm(self)  # first: the errors name this section's fields, not the parts built from them
        super().__post_init__()

    def critic(self) -> CriticConfig:
        return dataclasses.replace(super().critic(), batch_renorm=True, renorm_momentum=self.renorm_momentum,
                                   renorm_eps=self.renorm_eps, renorm_warmup_steps=self.renorm_warmup_steps)

    def actor(self) -> ActorConfig:
        return ActorConfig(batch_renorm=self.actor_batch_renorm, renorm_momentum=self.renorm_momentum,
                           renorm_eps=self.renorm_eps, renorm_warmup_steps=self.renorm_warmup_steps)


@dataclass(frozen=True)
class R2D1Config:
    """R2D1 hyperparameters: R2D2 (Kapturowski et al. 2019) in one learner, on replayed sequences
    (``replay.table = "sequence"``, L = ``replay.sequence_length`` steps, burn-in included)."""

    lr: float = 1e-4
    """Adam learning rate at the start of the run."""
    anneal_lr: bool = False
    """Decay the learning rate linearly to 0 over the run (progress 0 -> 1)."""
    adam_eps: float = 1e-3
    """Adam epsilon (R2D2: 1e-3)."""
    batch_size: int = 64
    """Sequences in one batch (the learner asks replay for this many per update)."""
    burn_in: int = 40
    """First steps of each sequence that only warm up the LSTM from the stored state: no loss, no gradient."""
    n_step: int = 5
    """Rewards summed per target before bootstrapping (shorter at a sequence's end, see r2d1.py)."""
    gamma: float = 0.997
    """Discount per step."""
    double: bool = True
    """Double Q: the online net picks the bootstrap action, the target net evaluates it."""
    target_update_period: int = 2500
    """Updates between copies of the online net into the target net."""
    value_rescale_eps: float = 1e-3
    """epsilon of the value rescaling h(x) = sign(x)(sqrt(|x| + 1) - 1) + eps x; 0 = no rescaling."""
    priority_eta: float = 0.9
    """A sequence's priority: eta * max + (1 - eta) * mean of |TD| over its trained steps."""
    max_grad_norm: float = 40.0
    """Clip the global gradient norm to this; 0 = no clipping."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.target_update_period < 1 or self.n_step < 1 or self.burn_in < 0:
            raise ValueError(f"R2D1Config: need batch_size, target_update_period, n_step >= 1 and burn_in >= 0, got "
                             f"{self.batch_size}, {self.target_update_period}, {self.n_step}, {self.burn_in}")
        if not 0.0 <= self.priority_eta <= 1.0 or self.value_rescale_eps < 0 or not 0 <= self.gamma <= 1:
            raise ValueError("R2D1Config: need 0 <= priority_eta <= 1, value_rescale_eps >= 0 and 0 <= gamma <= 1")
