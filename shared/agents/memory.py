"""Recurrent cores: an LSTM after the encoder, and each env's state between two steps.

An agent with ``model.lstm_size > 0`` puts an ``LstmCore`` between its encoder and its
heads (rlpyt's recurrent agents, R2D2's core). The same core runs in two ways:

- acting, one step for a batch of envs (``ActingMemory.recall`` -> ``run`` over T = 1 ->
  ``ActingMemory.remember``): the agent keeps every env's previous action and its cores'
  states in one table indexed by the env's global index (``StepContext.env_index``); the
  previous reward comes with the step. So it works wherever the agent acts (the
  action-server for all samplers, a local sampler for its own envs, serial mode). A row whose
  observation starts an episode (``StepContext.first``) starts from zeros. What each step
  started from is returned as a ``Memory`` in the agent info and stored with the step.
- learning, whole sequences [T, B] from a stored ``Memory``: the state at the first step
  comes from the store, the later ones from the core itself, zeroed after every episode end
  inside the sequence (``reset``), so a sequence replays what the actor computed (to float
  rounding: acting and learning run the same ``nn.LSTM``).

A process that starts acting (a restarted action-server or sampler) has no state for
episodes already running: their state starts from zeros, which ``ActingMemory`` logs once.
"""

from __future__ import annotations

import logging

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shared.agents.config import Memory, ModelConfig, RnnState
from shared.agents import StepContext

log = logging.getLogger(__name__)


def action_features(action: torch.Tensor, space: gym.Space) -> torch.Tensor:
    """Actions [*L] (Discrete), [*L, k] (MultiDiscrete) or [*L, *shape] (Box) as float
    features [*L, d]: one-hot for discrete parts, the raw values for a Box."""
    if isinstance(space, gym.spaces.Discrete):
        return F.one_hot(action.long(), int(space.n)).float()
    if isinstance(space, gym.spaces.MultiDiscrete):
        parts = [F.one_hot(action[..., j].long(), int(n)).float() for j, n in enumerate(space.nvec)]
        return torch.cat(parts, dim=-1)
    if isinstance(space, gym.spaces.Box):
        lead = action.dim() - len(space.shape)
        return action.float().flatten(lead) if space.shape else action.float()[..., None]
    raise ValueError(f"model.lstm_prev_action: action space {space} cannot be an LSTM input")


def _action_dim(space: gym.Space) -> int:
    if isinstance(space, gym.spaces.Discrete):
        return int(space.n)
    if isinstance(space, gym.spaces.MultiDiscrete):
        return int(np.sum(space.nvec))
    if isinstance(space, gym.spaces.Box):
        return max(1, int(np.prod(space.shape, dtype=np.int64)))
    raise ValueError(f"model.lstm_prev_action: action space {space} cannot be an LSTM input")


def sequence_reset(terminated: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """reset [T, B] bool for a sequence of steps: the state is zeroed before step t when step
    t - 1 ended an episode; never before step 0 (the stored state is already reset)."""
    done = terminated | truncated
    return torch.cat([torch.zeros_like(done[:1]), done[:-1]], dim=0)


class LstmCore(nn.Module):
    """One LSTM layer (``nn.LSTM``) over the encoder's features, optionally with the previous
    action and reward appended to them.

    A sequence with episode ends inside is cut into pieces at the resets, and all pieces run
    side by side through the fused LSTM, each moved to start at step 0 and padded at its end,
    each from its own start state (the stored one for a column's first piece, zeros after a
    reset): one call instead of a Python loop over steps, and on a CPU faster than either that
    loop or a packed sequence (docs/benchmarks.md, "Recurrent agents").
    """

    def __init__(self, feat_dim: int, cfg: ModelConfig, action_space: gym.Space) -> None:
        super().__init__()
        self.size, self.action_space = cfg.lstm_size, action_space
        self.use_action, self.use_reward = cfg.lstm_prev_action, cfg.lstm_prev_reward
        in_dim = feat_dim + (_action_dim(action_space) if self.use_action else 0) + int(self.use_reward)
        self.lstm = nn.LSTM(in_dim, self.size)
        self.out_dim = self.size

    # ------------------------------------------------------------ learning (and acting with T = 1)

    def forward(self, features: torch.Tensor, memory: Memory, reset: torch.Tensor | None = None) -> torch.Tensor:
        """Outputs h [T, B, H] after each step, with grad (the learner's path).

        ``features`` [T, B, F]; ``memory`` with leaves [T, B, ...]: prev_action and
        prev_reward of every step, and the state to start from in ``memory.state`` [0];
        ``reset`` [T, B] bool (see ``sequence_reset``) or None.
        """
        x = self._inputs(features, memory.prev_action, memory.prev_reward)
        T, B = x.shape[:2]
        h0, c0 = memory.state.h[0].float(), memory.state.c[0].float()
        if reset is None or not bool(reset[1:].any()):
            return self.lstm(x, (h0[None], c0[None]))[0]
        # Pieces in column-major order, each moved to start at step 0 of its own column and
        # padded at the end; piece p is column col[p] from step start_t[p] on.
        starts = reset.clone()
        starts[0] = True
        flat = starts.T.reshape(-1)
        piece = (torch.cumsum(flat.long(), 0) - 1).reshape(B, T).T  # [T, B]
        start_idx = torch.nonzero(flat, as_tuple=True)[0]
        start_t, col = start_idx % T, start_idx // T
        pos = torch.arange(T, device=x.device)[:, None] - start_t[piece]
        pieces = x.new_zeros(T, len(start_idx), x.shape[-1]).index_put((pos, piece), x)
        keep = (start_t == 0).to(h0.dtype)[:, None]  # later pieces start after a reset: from zeros
        out = self.lstm(pieces, ((h0[col] * keep)[None], (c0[col] * keep)[None]))[0]
        return out[pos, piece]

    @torch.no_grad()
    def run(self, features: torch.Tensor, memory: Memory, reset: torch.Tensor | None = None,
            last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Like ``forward`` but one step at a time, without grad, returning the cell states too:
        h [T, B, H] and c [T, B, H] after each step (acting, where T = 1; bootstrap values).
        ``last_only``: h and c [1, B, H] after the last step, in one fused call when no episode
        ends inside (R2D1's burn-in)."""
        x = self._inputs(features, memory.prev_action, memory.prev_reward)
        h, c = memory.state.h[0].float()[None], memory.state.c[0].float()[None]
        if last_only and (reset is None or not bool(reset[1:].any())):
            return self.lstm(x, (h, c))[1]
        hs, cs = [], []
        for t in range(x.shape[0]):
            if reset is not None and t > 0:
                keep = (~reset[t]).to(h.dtype)[None, :, None]
                h, c = h * keep, c * keep
            _, (h, c) = self.lstm(x[t:t + 1], (h, c))
            hs.append(h[0])
            cs.append(c[0])
        return (hs[-1][None], cs[-1][None]) if last_only else (torch.stack(hs), torch.stack(cs))

    def step_from(self, features: torch.Tensor, h: torch.Tensor, c: torch.Tensor, prev_action: torch.Tensor,
                  prev_reward: torch.Tensor) -> torch.Tensor:
        """One more step from states (h, c) [N, H]: features [N, F] and the inputs [N] -> h [N, H].
        For the observation after a sequence (a bootstrap) or an episode's final observation."""
        x = self._inputs(features, prev_action, prev_reward)
        return self.lstm(x[None], (h[None], c[None]))[0][0]

    def _inputs(self, features: torch.Tensor, prev_action: torch.Tensor, prev_reward: torch.Tensor) -> torch.Tensor:
        parts = [features]
        if self.use_action:
            parts.append(action_features(prev_action, self.action_space))
        if self.use_reward:
            parts.append(prev_reward.float()[..., None])
        return torch.cat(parts, dim=-1) if len(parts) > 1 else features


class ActingMemory:
    """Each env's memory between two acting steps, indexed by the env's global index: the action
    it chose last and the state (h, c) of each of the agent's cores [cores, H]. The agent owns
    one (its cores share the previous action); it is not a parameter and is never published.
    ``action_example``: one row's action (dtype and shape)."""

    def __init__(self, cores: int, size: int, action_example: torch.Tensor) -> None:
        self.cores, self.size, self.action_example = cores, size, action_example
        self._table: dict[str, torch.Tensor] | None = None

    def recall(self, ctx: StepContext, n: int, device: torch.device) -> Memory:
        """The memory [n] (state [n, cores, H]) the rows of ``ctx`` start from: zeros where
        ``ctx.first``, else what ``remember`` kept for the env; the previous reward from ``ctx``."""
        index, total = ctx.rows(n)
        table = self._grow(total, device)
        idx = torch.as_tensor(index, device=device)
        keep = torch.ones(n, device=device) if ctx.first is None else \
            1.0 - torch.as_tensor(ctx.first, device=device).float()
        reward = torch.zeros(n, device=device) if ctx.reward is None else \
            torch.as_tensor(ctx.reward, device=device).float()
        expand = keep.reshape(n, *[1] * (table["prev_action"].dim() - 1))
        return Memory(prev_action=table["prev_action"][idx] * expand.to(table["prev_action"].dtype),
                      prev_reward=reward * keep,
                      state=RnnState(h=table["h"][idx] * keep[:, None, None], c=table["c"][idx] * keep[:, None, None]))

    def remember(self, ctx: StepContext, action: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> None:
        """Keep the rows' new states [n, cores, H] and the actions [n, ...] they chose for their next step."""
        index, _ = ctx.rows(len(action))
        idx = torch.as_tensor(index, device=h.device)
        table = self._table
        table["h"][idx], table["c"][idx] = h, c
        table["prev_action"][idx] = action.to(table["prev_action"].dtype)

    def _grow(self, total: int, device: torch.device) -> dict[str, torch.Tensor]:
        table = self._table
        if table is not None and len(table["h"]) >= total and table["h"].device == device:
            return table
        old = 0 if table is None else len(table["h"])
        if table is None:
            log.info("recurrent state of %d envs starts from zeros (episodes running before this process "
                     "started continue without their earlier memory)", total)
        example = self.action_example
        new = {"h": torch.zeros(total, self.cores, self.size, device=device),
               "c": torch.zeros(total, self.cores, self.size, device=device),
               "prev_action": torch.zeros(total, *example.shape, dtype=example.dtype, device=device)}
        if table is not None:
            for k in new:
                new[k][:old] = table[k].to(device)
        self._table = new
        return new


def core_memory(memory: Memory, k: int) -> Memory:
    """What core k of an agent starts from: ``memory`` with its state [..., cores, H] cut to core k's [..., H]."""
    return memory._replace(state=RnnState(h=memory.state.h[..., k, :], c=memory.state.c[..., k, :]))


def make_core(feat_dim: int, cfg: ModelConfig, action_space: gym.Space) -> LstmCore | None:
    """The agent's recurrent core, or None for a feed-forward agent (``lstm_size = 0``)."""
    return LstmCore(feat_dim, cfg, action_space) if cfg.lstm_size else None
