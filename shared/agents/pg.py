"""Policy-gradient agent: observations -> actions, log-probs and values (A2C, PPO).

One ``PgAgent`` serves the action-server (``step``), the learner (``evaluate``, ``value``)
and evaluation (``step(obs, EVALUATE)``). Its ``state_dict()`` (parameters and buffers)
is everything the learner publishes; ``step`` never changes it.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Normal

from shared.agents.config import AgentInfo, Memory, ModelConfig, PgAgentConfig, RecurrentAgentInfo
from shared.agents import EXPLORE, HALF_LOG_2PI, StepContext
from shared.agents.masking import legal, mask_path, masked
from shared.agents.groups import by_group, group_count, members
from shared.agents.memory import ActingMemory, core_memory, make_core, sequence_reset
from shared.agents.models import MLP, EnsembleMLP, has_cnn, make_encoder, make_obs_norm, obs_to
from shared.data.namedarraytuple import is_nat, leading_len, map_leaves
from shared.envs.pettingzoo_backend import GROUP_KEY, STATE_KEY

POLICY_HEAD_GAIN = 0.01  # near-uniform initial policy (CleanRL, Andrychowicz et al. 2021)
VALUE_HEAD_GAIN = 1.0


class PgAgent(nn.Module):
    """Actor-critic with a categorical (Discrete, MultiDiscrete) or diagonal Gaussian (Box) policy.

    MultiDiscrete: independent categoricals, log-probs and entropies summed over the k parts.
    Box: state-independent learned log-std; sampled actions are returned raw (unclipped),
    so their stored log-prob is exact; the env adapter clips them to the bounds.
    All inputs are moved to the device the module is on; outputs live there too.

    Separate policy and value networks on an observation without learned encoders (vectors,
    flattened maps: no CNN, no LSTM) are one two-member ``EnsembleMLP``, ``twin``.

    A centralised value (MAPPO, Yu et al. 2022): a Dict observation's ``global_state`` leaf
    (``env.global_state``: the multi-agent env's ``state()``) is read by the value network
    only. The value reads the whole column observation, i.e. the global state with the agent's
    own observation and id (MAPPO's "agent-specific global state", which tells the agents'
    values apart where their rewards differ); the policy reads every other leaf, so it acts
    without the state (``step`` still computes the value, from the state the env gives).
    Such an agent needs its own value encoder: no ``shared_encoder``, no ``twin``.

    With an action mask (``ModelConfig.action_mask``) the illegal actions' logits are
    ``masking.MASKED_LOGIT`` in ``step``, ``evaluate`` and export: never sampled, no share of
    the log-probabilities or the entropy.

    Agent groups (``env.groups``: an observation with an ``agent_group`` leaf): ``members``, one
    ``PgAgent`` a group built as this one would be without groups, and each row's
    policy output and value are its group's member's (``shared.agents.groups``); this agent then
    has no networks of its own; a Box policy's log-std is each row's group's too (``_log_std``).
    A recurrent agent's members each have their cores, and each row's state is its group's member's
    (the agent keeps the one acting memory, ``core_step``).

    Recurrent (``ModelConfig.lstm_size``): an ``LstmCore`` after each encoder (one for the
    policy and one for the value, or one shared with ``shared_encoder``); ``step`` keeps each
    env's state and returns it in ``RecurrentAgentInfo``, and the learner's calls
    (``evaluate``, ``segment_values``) take whole sequences [T, B] with their stored ``Memory``.
    """

    def __init__(
        self,
        obs_example,
        action_space: gym.Space,
        cfg: ModelConfig = ModelConfig(),
        agent_cfg: PgAgentConfig = PgAgentConfig(),
        obs_space: gym.Space | None = None,
        groups: int | None = None,
    ) -> None:
        """``groups``: the agent groups to build members for, None for the observation space's
        (``groups.group_count``), 0 for none."""
        super().__init__()
        self.action_space = action_space
        if isinstance(action_space, gym.spaces.Discrete):
            self.kind = "discrete"
            self.nvec = [int(action_space.n)]
            n_out = int(action_space.n)
        elif isinstance(action_space, gym.spaces.MultiDiscrete):
            if action_space.nvec.ndim != 1:
                raise ValueError(f"PgAgent: MultiDiscrete nvec must be 1-D, got shape {action_space.nvec.shape}")
            self.kind = "multi_discrete"
            self.nvec = [int(n) for n in action_space.nvec]
            n_out = sum(self.nvec)
        elif isinstance(action_space, gym.spaces.Box):
            self.kind = "box"
            self.action_shape = tuple(action_space.shape)
            n_out = int(np.prod(self.action_shape, dtype=np.int64))
        else:
            raise ValueError(
                f"PgAgent: action space {action_space} not supported; use Discrete, MultiDiscrete or Box"
            )
        # Discrete actions are indices 0..n-1 (as shared.envs.group specifies); EnvGroup adds a
        # space's ``start`` when it hands them to the env.
        self.mask_path = mask_path(cfg.action_mask, obs_example, None if self.kind == "box" else sum(self.nvec),
                                   obs_space)
        """Where the observation holds the legal actions (``shared.agents.masking``), or None."""

        self.obs_norm = make_obs_norm(obs_example, cfg)
        self.value_only = (STATE_KEY,) if is_nat(obs_example) and STATE_KEY in obs_example._fields else ()
        """Top-level observation keys the policy does not read (a centralised value's state)."""
        if self.value_only and agent_cfg.shared_encoder:
            raise ValueError(f"agent.shared_encoder = true: the policy must not read the observation's "
                             f"{STATE_KEY!r} (env.global_state), so the value needs its own encoder; set it false")
        self.twin = None
        self.members = None
        """One member agent a group (``env.groups``), or None."""
        groups = group_count(obs_space) if groups is None else groups
        if groups:
            self.members = members(groups, lambda: PgAgent(obs_example, action_space, cfg, agent_cfg, obs_space,
                                                           groups=0))
            self.pi_encoder = self.v_encoder = self.core = self.v_core = self.pi_head = self.v_head = None
        elif not agent_cfg.shared_encoder and cfg.lstm_size == 0 and not has_cnn(obs_example, cfg) and \
                not cfg.layer_norm and not self.value_only:
            # Two MLPs on the flattened observation, policy and value, run as one EnsembleMLP:
            # half the kernel launches of a gradient step, which is what small networks on a
            # CPU pay for. The value member's output layer is as wide as the policy's (one
            # ensemble shape); V is its first output, the others are never read, get zero
            # gradients and stay as initialised.
            self.pi_encoder, flat_dim = make_encoder(obs_example, dataclasses.replace(cfg, hidden_sizes=()), obs_space)
            self.v_encoder, self.core, self.v_core = None, None, None
            self.twin = EnsembleMLP(2, flat_dim, tuple(cfg.hidden_sizes), cfg.activation, output_size=n_out,
                                    output_gain=(POLICY_HEAD_GAIN, VALUE_HEAD_GAIN))
            self.pi_head = self.v_head = None
        else:
            self.pi_encoder, feat_dim = make_encoder(obs_example, cfg, obs_space, skip=self.value_only)
            self.core = make_core(feat_dim, cfg, action_space)
            # The value's features are as wide as the policy's, but for a trunkless
            # (hidden_sizes = []) centralised value, whose input is wider.
            self.v_encoder, v_dim = (None, feat_dim) if agent_cfg.shared_encoder else \
                make_encoder(obs_example, cfg, obs_space)
            self.v_core = None if agent_cfg.shared_encoder else make_core(v_dim, cfg, action_space)
            if self.core is not None:
                feat_dim = v_dim = self.core.out_dim
            self.pi_head = MLP(feat_dim, (), output_size=n_out, output_gain=POLICY_HEAD_GAIN)
            self.v_head = MLP(v_dim, (), output_size=1, output_gain=VALUE_HEAD_GAIN)
        if self.kind == "box" and self.members is None:
            self.log_std = nn.Parameter(torch.full((n_out,), float(agent_cfg.init_log_std)))
        self.recurrent = bool(cfg.lstm_size)
        if self.recurrent:
            example = np.zeros_like(action_space.sample(), dtype=np.int64 if self.kind != "box" else np.float32)
            cores = len((self if self.members is None else self.members[0])._cores())
            self.acting = ActingMemory(cores, cfg.lstm_size, torch.as_tensor(example))

    @property
    def device(self) -> torch.device:
        if self.members is not None:
            return self.members[0].device
        return (self.v_head if self.twin is None else self.twin).device

    def _forward(self, obs) -> tuple[torch.Tensor, torch.Tensor]:
        """Policy output (logits [N, sum(nvec)] or mean [N, dim]) and value [N] for obs [N, ...]."""
        if self.members is not None:
            return by_group(self.members, PgAgent._forward, getattr(obs, GROUP_KEY), obs)
        if self.twin is not None:
            x = self.pi_encoder(obs)
            out = self.twin(x.expand(2, *x.shape))
            return out[0], out[1, :, 0]
        pi_features = self.pi_encoder(obs)
        v_features = pi_features if self.v_encoder is None else self.v_encoder(obs)
        return self.pi_head(pi_features), self.v_head(v_features).squeeze(-1)

    def policy_output(self, obs) -> torch.Tensor:
        """Feed-forward: the policy's output alone (``_forward``'s first) for obs tree [N, ...] on the
        device and normalised, without the value's work: what an export of an agent with a
        centralised value computes, which has no global state to give it."""
        if self.members is not None:
            return by_group(self.members, PgAgent.policy_output, getattr(obs, GROUP_KEY), obs)
        if self.twin is not None:
            return self.twin.member(0, self.pi_encoder(obs))
        return self.pi_head(self.pi_encoder(obs))

    def value(self, obs) -> torch.Tensor:
        """V(obs): obs tree [N, ...] -> float32 [N]."""
        obs = obs_to(obs, self.device, self.obs_norm)
        if self.members is not None:
            return by_group(self.members, PgAgent.value, getattr(obs, GROUP_KEY), obs)
        if self.twin is not None:  # the value member alone: a segment batch's values skip the policy's work
            return self.twin.member(1, self.pi_encoder(obs))[..., 0]
        return self.v_head((self.pi_encoder if self.v_encoder is None else self.v_encoder)(obs)).squeeze(-1)

    @torch.no_grad()
    def step(self, obs, ctx: StepContext = EXPLORE) -> tuple[torch.Tensor, AgentInfo]:
        """Sample actions (the mode with ``ctx.greedy``) for obs tree [B, ...].

        Returns action (int64 [B] Discrete, int64 [B, k] MultiDiscrete, float32 [B, *shape]
        Box, raw Gaussian sample) and AgentInfo(log_prob float32 [B], value float32 [B]).
        """
        if not self.recurrent:  # acting_outputs moves obs to the device; choose reads only its mask
            return self.choose(self.acting_outputs(obs), obs, ctx)
        obs = obs_to(obs, self.device)
        normed = obs if self.obs_norm is None else self.obs_norm(obs)
        memory = self.acting.recall(ctx, leading_len(obs), self.device)
        out, value, h, c = self.core_step(normed, memory)
        action, info = self.choose((out, value, *self._box_log_std(obs)), obs, ctx)
        self.acting.remember(ctx, action, h, c)
        return action, RecurrentAgentInfo(log_prob=info.log_prob, value=info.value, memory=memory)

    @torch.no_grad()
    def acting_outputs(self, obs) -> tuple[torch.Tensor, ...]:
        """Feed-forward: all that ``step`` reads of the parameters, for obs tree [N, ...]: the policy
        output [N, ...], the value [N] and, for a Box policy, each row's log-std [N, *action_shape];
        ``choose`` takes it from there. Copies of the agent with other parameters run this one
        stacked (``shared.agents.stacked``)."""
        obs = obs_to(obs, self.device)
        out, value = self._forward(obs if self.obs_norm is None else self.obs_norm(obs))
        return out, value, *self._box_log_std(obs)

    def _box_log_std(self, obs) -> tuple[torch.Tensor, ...]:
        """(log-std [N, *action_shape],) of a Box policy for obs tree [N, ...], () for others."""
        if self.kind != "box":
            return ()
        return self._log_std(obs).expand(leading_len(obs), *self.action_shape),

    @torch.no_grad()
    def choose(self, outputs: tuple[torch.Tensor, ...], obs, ctx: StepContext) -> tuple[torch.Tensor, AgentInfo]:
        """``step``'s actions and AgentInfo from ``acting_outputs``' ``outputs`` for obs tree [B, ...]
        (its action mask, if any, is read)."""
        # No torch.distributions here: this runs once per action-server batch, and building
        # distribution objects costs more than the small networks' forward pass.
        out, value, *log_std = outputs
        if self.kind == "box":
            mean = out.reshape(-1, *self.action_shape)
            noise = torch.zeros_like(mean) if ctx.greedy else torch.randn_like(mean)
            action = mean + noise * log_std[0].exp()
            log_prob = (-0.5 * noise.square() - log_std[0] - HALF_LOG_2PI).flatten(1).sum(-1)
        else:
            ok = legal(obs, self.mask_path)
            out = masked(out, None if ok is None else torch.as_tensor(ok).to(out.device))
            idx, log_prob = [], 0.0
            for chunk in torch.split(out, self.nvec, dim=-1):
                # Gumbel-max: argmax(logits + Gumbel noise) is a sample of softmax(logits).
                pick = chunk.argmax(-1) if ctx.greedy else \
                    (chunk - torch.empty_like(chunk).exponential_().log()).argmax(-1)
                log_prob = log_prob + torch.log_softmax(chunk, -1).gather(-1, pick[:, None]).squeeze(-1)
                idx.append(pick)
            stacked = torch.stack(idx, dim=-1)
            action = stacked[:, 0] if self.kind == "discrete" else stacked
        return action, AgentInfo(log_prob=log_prob.float(), value=value)

    def core_step(self, obs, memory: Memory) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Recurrent: one acting step for obs tree [B, ...] (on the device, normalised) from ``memory``
        [B] (state [B, cores, H]): policy output [B, ...], value [B] and the cores' new states h, c
        [B, cores, H], without grad."""
        if self.members is not None:
            return by_group(self.members, PgAgent.core_step, getattr(obs, GROUP_KEY), obs, memory)
        states = [core.run(encoder(obs)[None], map_leaves(lambda x: x[None], core_memory(memory, k)))
                  for k, (core, encoder) in enumerate(self._cores())]  # (h, c) [1, B, H] per core
        return (self.pi_head(states[0][0][0]), self.v_head(states[-1][0][0]).squeeze(-1),
                torch.stack([h[0] for h, _ in states], 1), torch.stack([c[0] for _, c in states], 1))

    def _cores(self) -> list[tuple]:
        """(core, encoder) of the policy, then of the value if it has its own."""
        return [(self.core, self.pi_encoder)] + ([(self.v_core, self.v_encoder)] if self.v_core is not None else [])

    def evaluate(self, obs, action: torch.Tensor, memory: Memory | None = None, reset: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """log pi(action|obs), policy entropy and V(obs), with grad, each shaped like the leading dims.

        Feed-forward: obs tree [N, ...]; action as ``step`` returns it, [N] or [N, ...].
        Recurrent: whole sequences, obs [T, B, ...], action [T, B, ...], their stored
        ``memory`` [T, B] and ``reset`` [T, B] (``memory.sequence_reset``) -> [T, B] each.
        """
        obs = obs_to(obs, self.device, self.obs_norm)
        action = torch.as_tensor(action).to(self.device)
        ok = legal(obs, self.mask_path)
        if not self.recurrent:
            out, value = self._forward(obs)
        else:
            lead = action.shape[:2]
            out, value = self._sequence(obs, memory, reset)
            out, value, action = out.flatten(0, 1), value.flatten(0, 1), action.flatten(0, 1)
            ok = None if ok is None else ok.flatten(0, 1)
        log_prob, entropy = self._log_prob_entropy(masked(out, ok), action,
                                                   self._log_std(obs) if self.kind == "box" else None)
        if self.recurrent:
            log_prob, entropy, value = log_prob.reshape(lead), entropy.reshape(lead), value.reshape(lead)
        return log_prob, entropy, value

    def _sequence(self, obs, memory: Memory, reset: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Recurrent: policy output [T, B, ...] and value [T, B], with grad, for whole sequences: obs
        tree [T, B, ...] (on the device, normalised) from their stored ``memory`` and ``reset`` [T, B]."""
        if self.members is not None:  # a column is one agent, of one group at every step
            return by_group(self.members, PgAgent._sequence, getattr(obs, GROUP_KEY)[0], obs, memory, reset, dim=1)
        h = [core(encoder(obs), core_memory(memory, k), reset) for k, (core, encoder) in enumerate(self._cores())]
        return self.pi_head(h[0]), self.v_head(h[-1]).squeeze(-1)

    def _log_std(self, obs) -> torch.Tensor:
        """A Box policy's log-std: [*action_shape], or with groups each row's group's, [N, *action_shape]
        for obs tree [N, ...] or [T, B, ...] (N = T * B)."""
        if self.members is None:
            return self.log_std.reshape(self.action_shape)
        group = getattr(obs, GROUP_KEY).reshape(-1)
        return by_group(self.members, lambda member, rows: member.log_std.expand(len(rows), -1), group, group
                        ).reshape(-1, *self.action_shape)

    def _log_prob_entropy(self, out: torch.Tensor, action: torch.Tensor, log_std: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """log pi(action) [N] and entropy [N] of the policy output ``out`` [N, ...]."""
        if self.kind == "box":
            mean = out.reshape(-1, *self.action_shape)
            dist = Normal(mean, log_std.exp())
            log_prob = dist.log_prob(action).flatten(1).sum(-1)
            entropy = dist.entropy().flatten(1).sum(-1)
        else:
            # Closed forms, not Categorical objects: their construction and argument checks
            # cost more than the small networks' backward pass.
            # reduce, not sum() from 0: one Discrete space (the usual case) adds nothing, nor splits.
            idx = action.long().reshape(action.shape[0], len(self.nvec))
            chunks = (out,) if len(self.nvec) == 1 else torch.split(out, self.nvec, dim=-1)
            logps = [torch.log_softmax(chunk, -1) for chunk in chunks]
            log_prob = functools.reduce(operator.add, [logp.gather(-1, idx[:, j:j + 1])
                                                       for j, logp in enumerate(logps)]).squeeze(-1)
            entropy = -functools.reduce(operator.add, [(logp.exp() * logp).sum(-1) for logp in logps])
        return log_prob, entropy

    @torch.no_grad()
    def segment_values(self, samples, bootstrap_observation, cut: torch.Tensor, recompute: bool = True
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """Current values for GAE over a segment batch [T, B]: V(s_t) [T, B] and V(bootstrap
        observation) [B] (None, None for a feed-forward agent without ``recompute``: the caller
        uses the stored ones), and V(final observation) [k] of the ``cut`` [T, B] steps (truncated,
        not terminated). A recurrent agent runs the segments as sequences from their stored
        memory; the bootstrap and final observations are one more step from the state after their step.
        """
        if not self.recurrent:
            final = self.value(samples.final_observation[cut]) if bool(cut.any()) else \
                samples.reward.new_zeros(0)
            if not recompute:
                return None, None, final
            return self.value(samples.observation), self.value(bootstrap_observation), final
        value, bootstrap, final = self._sequence_values(
            *(obs_to(x, self.device, self.obs_norm) for x in (samples.observation, bootstrap_observation,
                                                              samples.final_observation)),
            samples.agent_info.memory, sequence_reset(samples.terminated, samples.truncated), samples.action,
            samples.reward, cut)
        return value, bootstrap, final[cut]

    def _sequence_values(self, obs, bootstrap_obs, final_obs, memory: Memory, reset: torch.Tensor,
                         action: torch.Tensor, reward: torch.Tensor, cut: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Recurrent ``segment_values`` on observations on the device and normalised, obs and
        final_obs [T, B, ...], bootstrap_obs [B, ...], with the sequences' stored ``memory``, ``reset``,
        ``action`` and ``reward`` [T, B]: V(obs) [T, B], V(bootstrap_obs) [B], and V(final_obs) [T, B]
        at the ``cut`` [T, B] steps (0 at the others)."""
        if self.members is not None:  # a column is one agent: its bootstrap and final observations' group too
            return by_group(self.members, PgAgent._sequence_values, getattr(obs, GROUP_KEY)[0], obs, bootstrap_obs,
                            final_obs, memory, reset, action, reward, cut, dim=(1, 0, 1, 1, 1, 1, 1, 1),
                            out_dim=(1, 0, 1))
        k = len(self._cores()) - 1
        core, encoder = self._cores()[k]
        h, c = core.run(encoder(obs), core_memory(memory, k), reset)
        value = self.v_head(h).squeeze(-1)

        def after(t, rows, obs):
            return self.v_head(core.step_from(encoder(obs), h[t, rows], c[t, rows], action[t, rows], reward[t, rows])
                               ).squeeze(-1)

        bootstrap = after(-1, torch.arange(h.shape[1], device=h.device), bootstrap_obs)
        final = torch.zeros_like(value)
        t, b = torch.nonzero(cut, as_tuple=True)
        if len(t):
            final[t, b] = after(t, b, final_obs[t, b])
        return value, bootstrap, final
