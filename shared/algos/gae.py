"""Generalised advantage estimation (Schulman et al. 2016), and the policy-gradient targets of an
on-policy batch from it or from V-trace (``shared/algos/vtrace.py``)."""

from __future__ import annotations

import torch

from shared.agents.memory import sequence_reset
from shared.algos.hparams import PgTargetsConfig
from shared.algos.value_norm import ValueNorm
from shared.algos.vtrace import vtrace
from shared.data.batches import OnPolicyBatch
from shared.data.namedarraytuple import map_leaves, namedarraytuple

PgTargets = namedarraytuple(
    "PgTargets",
    ["observation", "action", "old_log_prob", "old_value", "advantage", "returns", "memory", "reset", "valid"],
)
"""One on-policy batch with its targets (what A2C/PPO train on): flattened to [T*B] for a
feed-forward agent, without the rows of failed env steps (``Samples.failed``; memory, reset
and valid None); kept as sequences [T, B] for a recurrent one, with the stored ``Memory``, the
``reset`` flags [T, B] its ``evaluate`` replays and ``valid`` [T, B] (False at failed steps:
the losses drop those steps' outputs, ``real_steps``)."""


def gae(
    reward: torch.Tensor,
    value: torch.Tensor,
    next_value: torch.Tensor,
    terminated: torch.Tensor,
    done: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lambda) advantages and lambda-returns, all [T, B] float.

    Arguments, all [T, B]:
        reward[t]: r_t, the reward of step t (already scaled, if scaling is wanted).
        value[t]: V(s_t), s_t the observation step t acted in.
        next_value[t]: V(s_{t+1}) of the SAME episode: value[t + 1] inside a segment,
            the bootstrap value at t = T-1, V(final observation) where step t was
            truncated; ignored where step t terminated.
        terminated[t]: the episode ended in a terminal state at step t (bool or 0/1).
        done[t]: terminated or truncated at step t.

    Edge cases (as in SB3's ``compute_returns_and_advantage``, with truncation handled):
        - termination: delta_t = r_t - V(s_t), no bootstrap (the true value after is 0);
        - truncation (time limit): delta_t = r_t + gamma * V(final obs) - V(s_t);
        - the sum of discounted deltas is cut at every done, so no advantage leaks
          across an episode boundary inside the segment;
        - at the segment end the recursion starts from next_value[T-1] (the bootstrap).
    With lam = 1 the return is the discounted Monte-Carlo return (n-step, bootstrapped
    from the last next_value); with lam = 0 it is the TD(0) target r_t + gamma V(s_{t+1}).

    Returns (advantage, return) with return = advantage + value.
    """
    not_terminated = 1.0 - terminated.to(value.dtype)
    not_done = 1.0 - done.to(value.dtype)
    delta = reward + gamma * next_value * not_terminated - value
    decay = (gamma * lam) * not_done  # one op a step in the loop below, which runs T times in Python
    advantage = torch.empty_like(delta)
    running = torch.zeros_like(delta[0])
    for t in reversed(range(delta.shape[0])):
        running = torch.addcmul(delta[t], decay[t], running)
        advantage[t] = running
    return advantage, advantage + value


def recursion_ends(samples) -> torch.Tensor:
    """Where the backward recursions over a segment [T, B] (GAE, V-trace, Q(lambda)) stop: a done
    step, and the step before a failed one (``Samples.failed``), whose target bootstraps from
    V(s_{t+1}) instead, s_{t+1} being the observation the failed step was taken in; so nothing
    of a failed step's made-up outcome reaches a real step's target."""
    ends = samples.terminated | samples.truncated
    ends[:-1] |= samples.failed[1:]
    return ends


@torch.no_grad()
def batch_advantages(agent, batch: OnPolicyBatch, cfg: PgTargetsConfig, value_norm: ValueNorm | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Advantages, value targets and the V(s_t) used, all [T, B], on ``agent``'s device:
    GAE(lambda) or V-trace as ``cfg.advantages`` says. With ``value_norm`` the value net's
    outputs are normalised values, taken back to returns with its statistics first.

    V(s_t) and the bootstrap V(s_T) come from the current value net (``recompute_values``:
    ``agent.segment_values``, one pass over the segments; a recurrent agent runs them as
    sequences from their stored memory), or are the behaviour values stored at sampling
    time; never a mix, so the advantages do not compare values of two networks. Where a
    step was truncated (and not terminated) V(final observation) comes from the current
    value net. Rewards are multiplied by ``reward_scale`` (the value net learns scaled returns).
    V-trace's ratios pi/mu are the current policy's log-probs (one more pass, ``agent.evaluate``)
    against the behaviour log-probs stored at sampling time.

    Why recompute: batches from asynchronous samplers are 1-2 versions stale, and early in
    training the value net moves fast; stale V(s_t) then bias every advantage. On CartPole
    PPO with policy lag 2, recomputed values reached 475 in far fewer env steps than stored
    ones (docs/benchmarks.md, "GAE from recomputed values").
    """
    s = batch.samples
    cut = s.truncated & ~s.terminated
    value, bootstrap, final = agent.segment_values(s, batch.bootstrap_observation, cut, cfg.recompute_values)
    if not cfg.recompute_values:
        value, bootstrap = s.agent_info.value, batch.bootstrap_value
    if value_norm is not None:
        value, bootstrap, final = (value_norm.denormalize(v.float()) for v in (value, bootstrap, final))
    value = value.float()
    next_value = torch.cat([value[1:], bootstrap[None].float()], dim=0)
    next_value[cut] = final.float()
    done = recursion_ends(s)
    reward = s.reward.float() * cfg.reward_scale
    if cfg.advantages == "vtrace":
        log_rho = current_log_prob(agent, s) - s.agent_info.log_prob.float()
        advantage, returns = vtrace(log_rho, reward, value, next_value, s.terminated, done, cfg.gamma, cfg.gae_lambda,
                                    cfg.vtrace_rho_bar, cfg.vtrace_c_bar)
    else:
        advantage, returns = gae(reward, value, next_value, s.terminated, done, cfg.gamma, cfg.gae_lambda)
    return advantage, returns, value


def current_log_prob(agent, samples) -> torch.Tensor:
    """log pi(a_t|s_t) [T, B] of ``agent``'s current policy for the actions of ``samples`` [T, B]
    (a recurrent agent replays each column from its stored memory)."""
    if "memory" in samples.agent_info:
        reset = sequence_reset(samples.terminated, samples.truncated)
        return agent.evaluate(samples.observation, samples.action, samples.agent_info.memory, reset)[0].float()
    T, B = samples.reward.shape
    flat = map_leaves(lambda x: x.reshape(T * B, *x.shape[2:]), samples.observation)
    action = samples.action.reshape(T * B, *samples.action.shape[2:])
    return agent.evaluate(flat, action)[0].float().reshape(T, B)


def pg_targets(agent, batch: OnPolicyBatch, cfg: PgTargetsConfig, value_norm: ValueNorm | None = None) -> PgTargets:
    """Move ``batch`` to the agent's device, compute its targets (``batch_advantages``) and
    flatten [T, B] to [T*B] (a recurrent agent's batch stays [T, B]: see ``PgTargets``).

    ``old_value`` is the V(s_t) the advantages were computed with (see ``batch_advantages``).
    With ``value_norm``, ``old_value`` and ``returns`` are in the value net's units: the V(s_t)
    normalised as the net gave them, the returns by the statistics once they have taken in this
    batch's real steps' returns (``shared/algos/value_norm.py``); the advantages stay returns'.
    """
    device = agent.device
    batch = map_leaves(lambda x: x.to(device, non_blocking=True), batch)
    advantage, returns, value = batch_advantages(agent, batch, cfg, value_norm)
    s = batch.samples
    if value_norm is not None:
        value = value_norm.normalize(value)
        value_norm.update(returns[~s.failed])
        returns = value_norm.normalize(returns)
    T, B = s.reward.shape
    recurrent = "memory" in s.agent_info
    targets = PgTargets(
        observation=s.observation,
        action=s.action,
        old_log_prob=s.agent_info.log_prob.float(),
        old_value=value,
        advantage=advantage,
        returns=returns,
        memory=s.agent_info.memory if recurrent else None,
        reset=sequence_reset(s.terminated, s.truncated) if recurrent else None,
        valid=~s.failed if recurrent else None,
    )
    if recurrent:
        return targets
    flat = map_leaves(lambda x: x.reshape(T * B, *x.shape[2:]), targets)
    return flat[~s.failed.reshape(-1)] if bool(s.failed.any()) else flat


def real_steps(data: PgTargets, *outputs: torch.Tensor):
    """A recurrent batch's targets and the agent's outputs [T, B] on it, as rows [k] of the steps
    that were real transitions (``PgTargets.valid``); a feed-forward batch's (rows already) as they are."""
    if data.valid is None:
        return (data, *outputs)
    keep = data.valid
    return (data[keep], *(x[keep] for x in outputs))


def explained_variance(prediction: torch.Tensor, target: torch.Tensor) -> float:
    """1 - Var(target - prediction) / Var(target): 1 perfect, 0 no better than a constant."""
    var = target.var()
    return float("nan") if var == 0 else float(1.0 - (target - prediction).var() / var)
