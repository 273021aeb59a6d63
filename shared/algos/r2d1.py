"""R2D1: recurrent Q-learning on replayed sequences (R2D2, Kapturowski et al. 2019, in one learner).

A batch is n sequences of L steps (``SequenceBatch`` [L, n], shared/replay/sequences.py)
with the LSTM state the actor started each from. Per update:

1. burn-in: the online and the target net run the first B = ``burn_in`` steps from the
   stored state without gradient (the stored state is stale: the parameters moved since);
2. the online net continues over steps B..L-1 with gradient; the target net evaluates every
   step (its own burn-in included);
3. n-step double-Q targets inside the sequence on value-rescaled Q:
   ``y_t = h(sum_{k<m} gamma^k r_{t+k} + gamma^m h^-1(Q_target(s_{t+m}, argmax_a Q_online(s_{t+m}, a))))``;
   with an action mask (``shared.agents.masking``) the argmax is over the actions legal at s_{t+m};
4. loss 0.5 (y_t - Q(s_t, a_t))^2 averaged over the trained steps of each sequence,
   weighted by the sequence's importance weight; priority of a sequence
   ``eta max_t |td_t| + (1 - eta) mean_t |td_t|`` over its trained steps (a sequence with none
   gets the batch's smallest, never 0: ``sequence_priorities``).

n-step windows inside a sequence (``sequence_targets``): the window of step t ends at the
first done d in it (m = d - t + 1), else after m = min(n, L - 1 - t) rewards, so the
bootstrap observation s_{t+m} is still in the sequence (Acme's R2D2 shortens the last
windows the same way). A window closed by a termination has discount 0; one closed by a
truncation would bootstrap from the episode's final observation, which the sequence does
not carry, so that step is masked out of the loss (at most n steps per truncated episode).
A failed env step (``SequenceBatch.failed``) is no transition: it never trains, and a window
that reaches it ends before it, bootstrapping from the observation it was taken in.
Step L-1 trains only if it terminates. Steps before B never train.

Like dqn.py, ``update`` returns the priorities and never writes to replay.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shared.agents.config import Memory, RnnState
from shared.agents.masking import masked_argmax
from shared.agents.memory import sequence_reset
from shared.agents.q import QAgent
from shared.algos.hparams import R2D1Config
from shared.algos.optim import adam, gradient_step, set_lr
from shared.algos.target import TargetNetworkAlgo
from shared.algos.update import Update
from shared.data.namedarraytuple import map_leaves
from shared.data.batches import SequenceBatch

__all__ = ["R2D1", "R2D1Config", "h", "h_inv", "sequence_targets", "sequence_priorities"]


def h(x: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """Value rescaling h(x) = sign(x)(sqrt(|x| + 1) - 1) + eps x (Pohlen et al. 2018)."""
    return torch.sign(x) * (torch.sqrt(x.abs() + 1.0) - 1.0) + eps * x


def h_inv(x: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """Inverse of ``h``: sign(x)(((sqrt(1 + 4 eps (|x| + 1 + eps)) - 1) / (2 eps))^2 - 1)
    (eps = 0: sign(x)((|x| + 1)^2 - 1))."""
    if eps == 0:
        return torch.sign(x) * ((x.abs() + 1.0) ** 2 - 1.0)
    root = (torch.sqrt(1.0 + 4.0 * eps * (x.abs() + 1.0 + eps)) - 1.0) / (2.0 * eps)
    return torch.sign(x) * (root**2 - 1.0)


class SequenceTargets(NamedTuple):
    """Per step [L, n]."""

    return_: torch.Tensor
    """float: sum_{k<m} gamma^k reward[t+k]."""
    discount: torch.Tensor
    """float: gamma^m, 0 when a termination closed the window."""
    bootstrap_index: torch.Tensor
    """int64: t + m, the step whose observation the target bootstraps from (clamped to L - 1)."""
    valid: torch.Tensor
    """bool: the target is defined inside the sequence (see the module doc)."""


def sequence_targets(reward: torch.Tensor, terminated: torch.Tensor, truncated: torch.Tensor, n_step: int,
                     gamma: float, failed: torch.Tensor | None = None) -> SequenceTargets:
    """n-step targets of every step of sequences [L, n] (module doc: windows end at the first
    done or the sequence's last step; truncation-closed windows are invalid; ``failed`` steps
    have none, and windows that reach one end before it)."""
    L = reward.shape[0]
    fail = torch.zeros_like(terminated) if failed is None else failed
    done = terminated | truncated | fail
    t = torch.arange(L, device=reward.device)[:, None]
    ret = torch.zeros_like(reward, dtype=torch.float32)
    m = torch.zeros_like(reward, dtype=torch.int64)
    alive = torch.ones_like(done)
    closed_term = torch.zeros_like(done)
    closed_trunc = torch.zeros_like(done)
    for k in range(n_step):
        idx = (t + k).clamp(max=L - 1).expand_as(done)
        inside = (t + k <= L - 1)
        d_k = done.gather(0, idx)
        # reward t+k counts if its step is in the sequence, is a transition (not failed) and either
        # ends the episode or has a successor in it.
        take = alive & inside & ~fail.gather(0, idx) & (d_k | (t + k + 1 <= L - 1))
        ret = ret + torch.where(take, gamma**k * reward.gather(0, idx).float(), torch.zeros_like(ret))
        m = m + take.long()
        closed_term |= take & terminated.gather(0, idx)
        closed_trunc |= take & truncated.gather(0, idx) & ~terminated.gather(0, idx)
        alive = alive & ~(take & d_k) & take
    discount = torch.where(closed_term, torch.zeros_like(ret), gamma ** m.float())
    valid = (m > 0) & ~closed_trunc
    return SequenceTargets(ret, discount, (t + m).clamp(max=L - 1), valid)


def sequence_priorities(td_abs: torch.Tensor, mask: torch.Tensor, eta: float) -> torch.Tensor:
    """Per sequence [n]: eta * max + (1 - eta) * mean of ``td_abs`` [L, n] over the steps where
    ``mask`` [L, n] is True.

    A sequence without such steps (a truncation right after burn-in, say) gets the smallest
    priority of the batch's sequences that have some (1.0, new items' priority, if none has):
    it is sampled rarely, and it never becomes a priority of ~0 that, as the table's minimum,
    would shrink every table-min-normalised importance weight.
    """
    td = torch.where(mask, td_abs, torch.zeros_like(td_abs))
    count = mask.sum(0)
    mean = td.sum(0) / count.clamp(min=1)
    priority = eta * td.max(0).values + (1.0 - eta) * mean
    trained = count > 0
    fallback = priority[trained].min() if bool(trained.any()) else priority.new_tensor(1.0)
    return torch.where(trained, priority, fallback)


def _memory(batch: SequenceBatch, start: slice, state: RnnState) -> Memory:
    """Memory [T, n] of steps ``start`` with ``state`` [n, cores = 1, H] as the state of its first step."""
    return Memory(prev_action=batch.prev_action[start], prev_reward=batch.prev_reward[start],
                  state=RnnState(h=state.h[None], c=state.c[None]))


def burned_in_state(agent: QAgent, batch: SequenceBatch, burn_in: int, reset: torch.Tensor) -> RnnState:
    """The LSTM state [n, cores = 1, H] before step ``burn_in``: the stored start state run
    through the first ``burn_in`` steps without gradient, zeroed if step burn_in - 1 ended an episode."""
    state = RnnState(h=batch.start_state.h.float(), c=batch.start_state.c.float())
    if burn_in == 0:
        return state
    obs = map_leaves(lambda x: x[:burn_in], batch.observation)
    h, c = agent.last_state(obs, _memory(batch, slice(0, burn_in), state), reset[:burn_in])
    keep = (~(batch.terminated[burn_in - 1] | batch.truncated[burn_in - 1])).float()[:, None]
    return RnnState(h=(h * keep)[:, None], c=(c * keep)[:, None])


class R2D1(TargetNetworkAlgo):
    """R2D1 on a recurrent ``QAgent``: ``update(batch, progress)`` is one Adam step on n sequences,
    with the target network copied every ``target_update_period`` updates.
    """

    def __init__(self, agent: QAgent, cfg: R2D1Config = R2D1Config()) -> None:
        if not agent.recurrent:
            raise ValueError("R2D1 needs a recurrent QAgent: set model.lstm_size > 0")
        super().__init__(agent)
        self.cfg = cfg
        self.optimizer = adam(agent.parameters(), lr=cfg.lr, eps=cfg.adam_eps)

    def loss(self, batch: SequenceBatch) -> tuple[torch.Tensor, dict]:
        """(IS-weighted loss, extra) for a batch [L, n] of torch tensors; extra holds q_taken,
        td_abs [L, n] and the loss mask [L, n] (trained steps), and priorities [n]."""
        cfg, agent = self.cfg, self.agent
        B, eps = cfg.burn_in, cfg.value_rescale_eps
        reset = sequence_reset(batch.terminated, batch.truncated)
        action = batch.action.long()
        tg = sequence_targets(batch.reward, batch.terminated, batch.truncated, cfg.n_step, cfg.gamma, batch.failed)
        mask = tg.valid.clone()
        mask[:B] = False

        state = burned_in_state(agent, batch, B, reset)
        rest = map_leaves(lambda x: x[B:], batch.observation)
        q = agent.q_sequence(rest, _memory(batch, slice(B, None), state), reset[B:])  # [L - B, n, A], with grad
        start = RnnState(h=batch.start_state.h.float(), c=batch.start_state.c.float())
        with torch.no_grad():
            q_target = self.target.q_sequence(batch.observation, _memory(batch, slice(None), start), reset)  # [L, n, A]
            # Bootstrap steps are > B (a trained step t >= B bootstraps from t + m > t), where the online Q exists.
            online = torch.cat([q_target[:B], q.detach()], 0)  # the first B rows are never read
            boot = tg.bootstrap_index
            picker = online if cfg.double else q_target
            at_boot = boot[..., None].expand(-1, -1, picker.shape[-1])
            ok = agent.legal_actions(batch.observation)  # [L, n, A], or None without an action mask
            a_star = masked_argmax(picker.gather(0, at_boot), None if ok is None else ok.gather(0, at_boot))  # [L, n]
            q_boot = q_target.gather(0, boot[..., None].expand(-1, -1, q_target.shape[-1]))
            q_boot = q_boot.gather(-1, a_star[..., None]).squeeze(-1)
            if eps > 0:
                y = h(tg.return_ + tg.discount * h_inv(q_boot, eps), eps)
            else:
                y = tg.return_ + tg.discount * q_boot
        q_taken = q.gather(-1, action[B:, :, None]).squeeze(-1)  # [L - B, n]
        td = y[B:] - q_taken
        m = mask[B:].float()
        per_seq = (0.5 * td**2 * m).sum(0) / m.sum(0).clamp(min=1.0)
        loss = (batch.is_weight.float() * per_seq).mean()
        td_abs = torch.zeros_like(tg.return_)
        td_abs[B:] = td.detach().abs()
        q_full = torch.zeros_like(tg.return_)
        q_full[B:] = q_taken.detach()
        priorities = sequence_priorities(td_abs, mask, cfg.priority_eta)
        return loss, {"q_taken": q_full, "td_abs": td_abs, "mask": mask, "priorities": priorities, "target": y}

    def update(self, batch: SequenceBatch, progress: float) -> Update:
        """One gradient step on n sequences [L, n] (torch tensors on the agent's device);
        ``progress`` in [0, 1] is the run's fraction done (learning-rate annealing).

        Returns floats loss, q_mean and td_abs_mean (over trained steps), trained_frac (trained
        steps / all steps), grad_norm (before clipping), lr; and the new priorities, numpy float32 [n].
        """
        cfg = self.cfg
        lr = set_lr(self.optimizer, cfg.lr, progress, cfg.anneal_lr)
        loss, extra = self.loss(batch)
        grad_norm = gradient_step(self.optimizer, loss, self.agent.parameters(), cfg.max_grad_norm)
        self.count_update(cfg.target_update_period)
        mask = extra["mask"]
        count = mask.sum().clamp(min=1)
        values = torch.stack([loss.detach(), (extra["q_taken"] * mask).sum() / count,
                              (extra["td_abs"] * mask).sum() / count, mask.float().mean(), grad_norm]).tolist()
        stats = dict(zip(("loss", "q_mean", "td_abs_mean", "trained_frac", "grad_norm"), values))
        stats["lr"] = lr
        return Update(stats, extra["priorities"].float().cpu().numpy())

    def state_dict(self) -> dict:
        return {**super().state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.optimizer.load_state_dict(state["optimizer"])
