"""V-trace (Espeholt et al. 2018, IMPALA): value targets and policy-gradient advantages for
segments that a policy older than the one being trained (the behaviour policy mu) sampled."""

from __future__ import annotations

import torch


def vtrace(
    log_rho: torch.Tensor,
    reward: torch.Tensor,
    value: torch.Tensor,
    next_value: torch.Tensor,
    terminated: torch.Tensor,
    done: torch.Tensor,
    gamma: float,
    lam: float,
    rho_bar: float,
    c_bar: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace policy-gradient advantages and value targets v_s, all [T, B] float.

    Arguments, all [T, B], as ``shared.algos.gae.gae`` takes them plus ``log_rho``:
        log_rho[t]: log pi(a_t|s_t) - log mu(a_t|s_t), target minus behaviour log-prob.
        reward[t], value[t] = V(s_t), next_value[t], terminated[t], done[t]: as for ``gae``
            (next_value[t] is V(s_{t+1}) of the SAME episode: value[t + 1] inside a segment,
            the bootstrap value at t = T-1, V(final observation) where step t was truncated).

    With the truncated importance weights rho_t = min(rho_bar, pi/mu) and the traces
    c_t = lam * min(c_bar, pi/mu) (the lambda the paper adds to the traces as Retrace does),
    the temporal differences delta_t = rho_t (r_t + gamma V(s_{t+1}) - V(s_t)) give

        v_s = V(s_s) + sum_{t >= s} gamma^{t-s} (c_s ... c_{t-1}) delta_t
            = V(s_s) + delta_s + gamma c_s (v_{s+1} - V(s_{s+1}))       (computed backwards)

        advantage_s = rho_s (r_s + gamma v_{s+1} - V(s_s))

    Episode ends and the segment end, exactly as ``gae`` treats them:
        - termination at t: no bootstrap, delta_t = rho_t (r_t - V(s_t)), advantage_t the same;
        - truncation at t: delta_t bootstraps gamma next_value[t] (V(final observation)), and
          the advantage too, since no v-trace target exists past the episode's last step;
        - the sum is cut at every done, so nothing leaks across an episode boundary;
        - at t = T-1, v_T is the bootstrap value next_value[T-1] (the recursion starts at 0).
    rho_bar chooses the fixed point (rho_bar = inf: the value function of pi; smaller: that of
    a policy between mu and pi); c_bar only sets how fast the traces contract and how much
    variance they carry, not the fixed point. A ratio that overflows (inf) stays in its episode:
    its trace is cut at the episode's end like any other; with rho_bar = inf its own delta is
    infinite, and so are its episode's targets up to it (the learner skips such a step).

    Identities (tests/test_vtrace.py): on-policy (log_rho = 0) with rho_bar, c_bar >= 1,
    v_s is the GAE(lambda) return exactly, for every lambda; the advantage is
    r_s + gamma v_{s+1} - V(s_s), which is GAE(1)'s advantage when lam = 1 (the n-step /
    Monte-Carlo return bootstrapped from the segment end minus V(s_s)).

    Returns (advantage, vs), in ``gae``'s order (advantage, return).
    """
    ratio = log_rho.exp()
    rho = ratio.clamp(max=rho_bar)
    not_terminated = 1.0 - terminated.to(value.dtype)
    goes_on = ~done.bool()
    discount = gamma * not_terminated
    delta = rho * (reward + discount * next_value - value)
    # The cuts at episode ends select instead of multiplying by 0: with c_bar = inf a ratio that
    # overflows at an episode's last step would make its trace inf, and inf x 0 is NaN, which the
    # recursion would carry back over the whole episode (with rho_bar = inf too, an infinite
    # correction from the next episode would do the same across the cut).
    decay = torch.where(goes_on, (gamma * lam) * ratio.clamp(max=c_bar), 0.0)
    correction = torch.empty_like(delta)  # v_s - V(s_s)
    running = torch.zeros_like(delta[0])
    for t in reversed(range(delta.shape[0])):
        running = torch.where(goes_on[t], torch.addcmul(delta[t], decay[t], running), delta[t])
        correction[t] = running
    # v_{t+1} where step t's episode goes on inside the segment (next_value[t] = V(s_{t+1})),
    # next_value[t] itself where it ends or the segment does.
    later = torch.cat([correction[1:], torch.zeros_like(correction[:1])], dim=0)
    next_vs = next_value + torch.where(goes_on, later, 0.0)
    advantage = rho * (reward + discount * next_vs - value)
    return advantage, value + correction
