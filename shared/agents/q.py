"""Q-learning agent: observations -> epsilon-greedy actions, Q-values, return distributions.

One ``QAgent`` serves the action-server (``step``: epsilon-greedy with each env's epsilon
from ``cfg.epsilon``), the learner (``q_values``, ``dist``, ``quantiles``) and evaluation
(``step`` with a greedy context: epsilon ``eps_eval``). Variants are parameters: a plain or
dueling head (Wang et al. 2016); scalar Q, a C51 categorical return distribution (Bellemare
et al. 2017), or return quantiles (``QuantileHead``) at fixed fractions (QR-DQN, Dabney et
al. 2017) or at sampled ones through a cosine embedding (IQN, Dabney et al. 2018). The
target network is not part of the agent (the algorithm owns it), so ``state_dict()`` is
exactly what the learner publishes.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from shared.agents.config import Memory, ModelConfig, QAgentConfig, QAgentInfo, QuantileHead, RecurrentQAgentInfo
from shared.agents import EXPLORE, StepContext
from shared.agents.groups import by_group, group_count, members
from shared.agents.masking import legal, mask_path, masked, random_legal
from shared.agents.memory import ActingMemory, core_memory, make_core
from shared.agents.models import MLP, CosineEmbedding, make_encoder, make_obs_norm, obs_to
from shared.data.namedarraytuple import leading_len, map_leaves
from shared.envs.pettingzoo_backend import GROUP_KEY


class QAgent(nn.Module):
    """Q-network on ``make_encoder``'s features for a Discrete action space of A actions.

    Actions are indices 0..A-1 (the env adapter adds the space's ``start``). The head gives
    Q [N, A], C51 logits [N, A, atoms] over the fixed ``support`` buffer [atoms], or with a
    ``quantiles`` head the return's quantile values [N, A, T] at fractions [N, T] (QR-DQN: the
    fixed ``taus`` buffer [T]; IQN: fractions given with each call, the features multiplied by
    their ``CosineEmbedding``, then through the ``merged`` layers). All inputs are moved to the
    device the module is on; outputs live there too.

    With an action mask (``ModelConfig.action_mask``) greedy actions are the argmax over the
    legal ones and epsilon's random actions uniform over them (``legal_actions`` gives the
    algorithms the same mask for their bootstrap actions).

    Recurrent (``ModelConfig.lstm_size``, R2D1): an ``LstmCore`` sits between encoder and
    head; ``step`` keeps each env's state and returns it in ``RecurrentQAgentInfo``, and
    the learner evaluates whole sequences with ``q_sequence``.

    Agent groups (``env.groups``: an observation with an ``agent_group`` leaf): ``members``, one
    ``QAgent`` a group built as this one would be without groups, and each row's
    head output is its group's member's (``shared.agents.groups``); this agent then has no
    networks of its own (it keeps C51's ``support`` and QR-DQN's ``taus``; IQN's fractions are
    drawn once for all members). A recurrent agent's members each have their core, and each row's
    state is its group's member's.
    """

    def __init__(
        self,
        obs_example,
        action_space: gym.spaces.Discrete,
        model_cfg: ModelConfig = ModelConfig(),
        cfg: QAgentConfig = QAgentConfig(),
        obs_space: gym.Space | None = None,
        quantiles: QuantileHead | None = None,
        groups: int | None = None,
    ) -> None:
        """``groups``: the agent groups to build members for, None for the observation space's
        (``groups.group_count``), 0 for none."""
        super().__init__()
        if not isinstance(action_space, gym.spaces.Discrete):
            raise ValueError(f"QAgent: action space {action_space} not supported; Q-learning needs Discrete")
        if quantiles is not None and cfg.distributional:
            raise ValueError("agent.distributional = true: C51's categorical head; QR-DQN and IQN have a quantile "
                             "head of their own, set it to false")
        self.cfg, self.quantile_head = cfg, quantiles
        self.n_actions = int(action_space.n)
        self.mask_path = mask_path(model_cfg.action_mask, obs_example, self.n_actions, obs_space)
        """Where the observation holds the legal actions (``shared.agents.masking``), or None."""
        # Atoms a head row outputs per action: C51's, QR-DQN's quantiles; 1 for scalar Q and IQN
        # (whose quantiles are rows of their own, one per fraction).
        self.n_atoms = cfg.n_atoms if cfg.distributional else (quantiles.n_quantiles if quantiles else 0) or 1
        self.per_atom = cfg.distributional or (quantiles is not None and not quantiles.implicit)
        self.obs_norm = make_obs_norm(obs_example, model_cfg)
        implicit = quantiles is not None and quantiles.implicit
        self.members = None
        """One member agent a group (``env.groups``), or None."""
        groups = group_count(obs_space) if groups is None else groups
        if groups:
            self.members = members(groups, lambda: QAgent(obs_example, action_space, model_cfg, cfg, obs_space,
                                                          quantiles, groups=0))
            self.encoder = self.core = self.advantage = self.value = self.tau_embedding = self.merged = None
        else:
            self.encoder, feat_dim = make_encoder(obs_example, model_cfg, obs_space)
            self.core = make_core(feat_dim, model_cfg, action_space)
            if self.core is not None:
                if cfg.distributional or quantiles is not None:
                    raise ValueError("QAgent: a recurrent agent (model.lstm_size) has a scalar Q head; "
                                     "set agent.distributional = false and train it with r2d1")
                feat_dim = self.core.out_dim
            hidden, act = tuple(cfg.head_hidden_sizes), model_cfg.activation
            merge_sizes = tuple(quantiles.merge_hidden_sizes) if implicit else ()
            head_in = merge_sizes[-1] if merge_sizes else feat_dim
            self.advantage = MLP(head_in, hidden, act, output_size=self.n_actions * self.n_atoms)
            self.value = MLP(head_in, hidden, act, output_size=self.n_atoms) if cfg.dueling else None
            self.tau_embedding = CosineEmbedding(quantiles.n_cosines, feat_dim) if implicit else None
            # IQN's layers after the merge, shared by the dueling streams (Dopamine's 512 after psi x phi).
            self.merged = MLP(feat_dim, merge_sizes, act) if merge_sizes else None
        if cfg.distributional:
            self.register_buffer("support", torch.linspace(cfg.v_min, cfg.v_max, cfg.n_atoms))
        else:
            self.support = None
        if quantiles is not None and not implicit:
            n = quantiles.n_quantiles
            self.register_buffer("taus", (2 * torch.arange(n, dtype=torch.float32) + 1) / (2 * n))
        else:
            self.taus = None
        self.recurrent = bool(model_cfg.lstm_size)
        if self.recurrent:
            self.acting = ActingMemory(1, model_cfg.lstm_size, torch.zeros((), dtype=torch.int64))

    @property
    def device(self) -> torch.device:
        return (self.advantage if self.members is None else self.members[0]).device

    def _head(self, obs) -> torch.Tensor:
        """Q [N, A] or C51 logits [N, A, atoms] for obs tree [N, ...], with grad."""
        if self.members is not None:
            obs = obs_to(obs, self.device, self.obs_norm)
            return by_group(self.members, QAgent._head, getattr(obs, GROUP_KEY), obs)
        return self._from_features(self.encoder(obs_to(obs, self.device, self.obs_norm)))

    def _from_features(self, features: torch.Tensor) -> torch.Tensor:
        """The head on features [*L, F]: Q [*L, A], or C51 logits / QR-DQN quantiles [*L, A, atoms]."""
        lead = features.shape[:-1]
        out = self.advantage(features).reshape(*lead, self.n_actions, self.n_atoms)
        if self.value is not None:
            out = self.value(features).unsqueeze(-2) + out - out.mean(dim=-2, keepdim=True)
        return out if self.per_atom else out.squeeze(-1)

    def legal_actions(self, obs) -> torch.Tensor | None:
        """bool [*L, A] on the agent's device: the legal actions of obs tree [*L, ...], or None
        for an agent without an action mask."""
        if self.mask_path is None:
            return None
        return torch.as_tensor(legal(obs, self.mask_path)).to(self.device)

    def greedy_values(self, obs) -> torch.Tensor:
        """max_a Q(obs, a) float32 [N] over the legal actions (all, without an action mask) for
        obs tree [N, ...], with grad."""
        return masked(self.q_values(obs), self.legal_actions(obs), -math.inf).max(-1).values

    def q_sequence(self, obs, memory: Memory, reset: torch.Tensor | None = None) -> torch.Tensor:
        """Recurrent agents: Q [T, B, A] over whole sequences, with grad: obs tree [T, B, ...],
        their stored ``memory`` [T, B] (the state at step 0 is the one used, [cores = 1, H]) and ``reset``
        [T, B] (``memory.sequence_reset``)."""
        obs = obs_to(obs, self.device, self.obs_norm)
        if self.members is not None:  # a column is one agent, of one group at every step
            return by_group(self.members, QAgent.q_sequence, getattr(obs, GROUP_KEY)[0], obs, memory, reset, dim=1)
        return self._from_features(self.core(self.encoder(obs), core_memory(memory, 0), reset))

    @torch.no_grad()
    def last_state(self, obs, memory: Memory, reset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Recurrent agents: the core's state h, c [B, H] after the last step of sequences obs tree
        [T, B, ...] from their stored ``memory`` [T, B] and ``reset`` [T, B], without grad (R2D1's burn-in)."""
        obs = obs_to(obs, self.device, self.obs_norm)
        if self.members is not None:
            return by_group(self.members, QAgent.last_state, getattr(obs, GROUP_KEY)[0], obs, memory, reset, dim=1,
                            out_dim=0)
        h, c = self.core.run(self.encoder(obs), core_memory(memory, 0), reset, last_only=True)
        return h[-1], c[-1]

    def core_step(self, obs, memory: Memory) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Recurrent agents: one acting step for obs tree [B, ...] (on the device, normalised) from
        ``memory`` [B] (state [B, cores = 1, H]): Q [B, A] and the core's new state h, c [B, 1, H],
        without grad."""
        if self.members is not None:
            return by_group(self.members, QAgent.core_step, getattr(obs, GROUP_KEY), obs, memory)
        with torch.no_grad():
            h, c = self.core.run(self.encoder(obs)[None], map_leaves(lambda x: x[None], core_memory(memory, 0)))
            return self._from_features(h[0]), h[0][:, None], c[0][:, None]

    def q_values(self, obs) -> torch.Tensor:
        """Q(obs, .) float32 [N, A] for obs tree [N, ...]: the expectation over the support for C51,
        the mean of the quantiles for QR-DQN and IQN (IQN: at ``acting_samples`` fresh fractions)."""
        if self.quantile_head is not None:
            return self.quantiles(obs)[0].mean(-1)
        out = self._head(obs)
        if not self.cfg.distributional:
            return out
        return (out.softmax(-1) * self.support).sum(-1)

    def quantiles(self, obs, taus: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantile heads only: the return's quantile values [N, A, T] at fractions taus [N, T] in
        (0, 1), and those fractions. QR-DQN: its fixed ``taus`` (``taus`` must be None); IQN: the
        ``taus`` given, or ``acting_samples`` fresh U(0, 1) draws per row if None."""
        head = self.quantile_head
        if head is None:
            raise ValueError("QAgent.quantiles: the agent has no quantile head (algo.name = 'qr_dqn' or 'iqn')")
        if not head.implicit:
            if taus is not None:
                raise ValueError("QAgent.quantiles: a QR-DQN head has fixed fractions; pass taus = None")
            values = self._head(obs)
            return values, self.taus.expand(values.shape[0], -1)
        if self.members is not None:  # one draw of fractions for all rows; each member reads its own rows'
            obs = obs_to(obs, self.device, self.obs_norm)
            if taus is None:
                taus = torch.rand(leading_len(obs), head.acting_samples, device=self.device)
            return by_group(self.members, lambda member, obs, taus: member.quantiles(obs, taus)[0],
                            getattr(obs, GROUP_KEY), obs, taus, row_cost=taus.shape[1]), taus
        features = self.encoder(obs_to(obs, self.device, self.obs_norm))  # [N, F]
        if taus is None:
            taus = torch.rand(features.shape[0], head.acting_samples, device=features.device)
        mixed = features.unsqueeze(-2) * self.tau_embedding(taus)  # [N, T, F]
        if self.merged is not None:
            mixed = self.merged(mixed)
        return self._from_features(mixed).transpose(-1, -2), taus

    def dist(self, obs) -> torch.Tensor:
        """C51 only: log-probabilities [N, A, atoms] of the return distribution on ``support``."""
        if not self.cfg.distributional:
            raise ValueError("QAgent.dist: the agent is not distributional (QAgentConfig.distributional)")
        return self._head(obs).log_softmax(-1)

    def step(self, obs, ctx: StepContext = EXPLORE) -> tuple[torch.Tensor, QAgentInfo]:
        """Epsilon-greedy actions for obs tree [B, ...]: each env's epsilon for ``ctx.env_steps``
        (``cfg.epsilon``), or ``eps_eval`` for a greedy context."""
        if not self.recurrent:
            return self.choose(self.acting_outputs(obs), obs, ctx)
        n = leading_len(obs)
        with torch.no_grad():
            memory = self.acting.recall(ctx, n, self.device)
            q, h, c = self.core_step(obs_to(obs, self.device, self.obs_norm), memory)
            action, value = self._pick(q, self._epsilon(ctx, n), self.legal_actions(obs))
        self.acting.remember(ctx, action, h, c)
        return action, RecurrentQAgentInfo(value=value, memory=memory)

    @torch.no_grad()
    def acting_outputs(self, obs) -> tuple[torch.Tensor]:
        """Feed-forward: all that ``step`` reads of the parameters, for obs tree [N, ...]: (Q [N, A],);
        ``choose`` takes it from there. Copies of the agent with other parameters run this one
        stacked (``shared.agents.stacked``)."""
        return self.q_values(obs),

    @torch.no_grad()
    def choose(self, outputs: tuple[torch.Tensor], obs, ctx: StepContext) -> tuple[torch.Tensor, QAgentInfo]:
        """``step``'s epsilon-greedy actions and QAgentInfo from ``acting_outputs``' ``outputs`` for
        obs tree [B, ...] (its action mask, if any, is read)."""
        q, = outputs
        action, value = self._pick(q, self._epsilon(ctx, len(q)), self.legal_actions(obs))
        return action, QAgentInfo(value=value)

    def _epsilon(self, ctx: StepContext, n: int) -> np.ndarray | float:
        """The epsilon of ``n`` rows for ``ctx``: each env's ``cfg.epsilon`` at ``ctx.env_steps``, or
        ``eps_eval`` for a greedy context."""
        return self.cfg.eps_eval if ctx.greedy else self.cfg.epsilon(ctx.env_steps, *ctx.rows(n))

    @torch.no_grad()
    def epsilon_greedy(self, obs, epsilon: torch.Tensor | np.ndarray | float) -> tuple[torch.Tensor, QAgentInfo]:
        """Epsilon-greedy actions for obs tree [B, ...].

        ``epsilon``: a float for all rows or one per row [B].
        Returns action int64 [B] in 0..A-1 and QAgentInfo(value float32 [B] = max_a Q, over the
        legal actions with an action mask)."""
        action, value = self._pick(self.q_values(obs), epsilon, self.legal_actions(obs))
        return action, QAgentInfo(value=value)

    def _pick(self, q: torch.Tensor, epsilon, ok: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Epsilon-greedy actions [B] and max_a Q [B] for Q [B, A], among the legal actions ``ok``
        [B, A] (None: all)."""
        B, device = q.shape[0], q.device
        eps = torch.as_tensor(epsilon, dtype=torch.float32, device=device)
        explore = torch.rand(B, device=device) < eps
        if ok is None:
            random = torch.randint(self.n_actions, (B,), device=device)
        else:
            random = random_legal(torch.rand(B, self.n_actions, device=device), ok)
        best = masked(q, ok, -math.inf)
        return torch.where(explore, random, best.argmax(-1)), best.max(-1).values.float()

