"""n-step return targets for every step of a window of consecutive trajectory steps."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class NStepTargets(NamedTuple):
    """Per window position [W, B]; only entries with ``complete`` True are meaningful."""

    return_: np.ndarray
    """float32: sum_{k<m} gamma^k reward[j+k]."""
    discount: np.ndarray
    """float32: gamma^m, or 0 when a termination ended the window."""
    bootstrap_offset: np.ndarray
    """int64: bootstrap observation is at j + offset (offset n, or m - 1 on a done)."""
    from_final: np.ndarray
    """bool: bootstrap from final_observation (a done closed the window) rather than observation."""
    complete: np.ndarray
    """bool: everything the target needs lies inside the window."""
    valid: np.ndarray
    """bool: the step at j is a transition (not a failed env step, which starts no item)."""


def nstep_targets(
    reward: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    n_step: int,
    gamma: float,
    failed: np.ndarray | None = None,
) -> NStepTargets:
    """n-step targets for the transitions starting at each of W consecutive steps.

    reward, terminated, truncated: [W, B], W consecutive steps of B independent
    trajectories; the window must not contain a writer restart (a seam), since nothing
    here can tell one apart from a continuing trajectory.

    For the transition at position j, let d be the first step in [j, j + n) with
    terminated | truncated (after d, reward[d+1] belongs to the next episode):

    - m = d - j + 1 if there is such a d, else n (the number of rewards summed);
    - return_ = sum_{k<m} gamma^k reward[j+k];
    - bootstrap observation: final_observation[d] if d exists (the env's last observation
      before autoreset; irrelevant after a termination, but valid), else observation[j+n];
    - discount = 0 if terminated[d], else gamma^m (a truncation bootstraps).

    complete[j] is True when d exists inside the window or j + n <= W - 1, i.e. when
    observation[j + n] has been seen; the last n steps of a window without a done stay
    incomplete until more steps arrive. Sums are done in float64 and stored as float32.

    ``failed`` [W, B] (``Samples.failed``; such steps are truncated too): a failed step f is no
    transition. It starts no item (valid False), and a window that reaches it ends before it,
    as if step f - 1 had been truncated with final observation observation[f] (the observation
    the failed step was taken in, which is real): m = f - j, bootstrap from observation[j + m],
    discount gamma^m.
    """
    if n_step < 1:
        raise ValueError(f"n_step must be >= 1, got {n_step}")
    W, B = reward.shape
    pad = ((0, n_step), (0, 0))
    r = np.pad(np.asarray(reward, dtype=np.float64), pad)
    term = np.pad(np.asarray(terminated, dtype=bool), pad)
    done = term | np.pad(np.asarray(truncated, dtype=bool), pad)
    fail = np.zeros_like(done) if failed is None else np.pad(np.asarray(failed, dtype=bool), pad)
    done |= fail
    in_window = np.arange(W + n_step)[:, None] < W  # [W + n, 1]

    ret = np.zeros((W, B), dtype=np.float64)
    m = np.zeros((W, B), dtype=np.int64)
    alive = np.ones((W, B), dtype=bool)
    closed = np.zeros((W, B), dtype=bool)
    cut = np.zeros((W, B), dtype=bool)  # a failed step ended the window before itself
    terminal = np.zeros((W, B), dtype=bool)
    for k in range(n_step):
        here = alive & in_window[k : k + W]
        cut |= here & fail[k : k + W]
        take = here & ~fail[k : k + W]
        ret += np.where(take, gamma**k * r[k : k + W], 0.0)
        m += take
        closed |= take & done[k : k + W]
        terminal |= take & term[k : k + W]
        alive &= ~done[k : k + W]
    complete = closed | cut | (np.arange(W)[:, None] + n_step <= W - 1)
    discount = np.where(terminal, 0.0, float(gamma) ** m)
    offset = np.where(closed, m - 1, np.where(cut, m, n_step))
    return NStepTargets(
        return_=ret.astype(np.float32),
        discount=discount.astype(np.float32),
        bootstrap_offset=offset.astype(np.int64),
        from_final=closed,
        complete=np.broadcast_to(complete, (W, B)).copy(),
        valid=~fail[:W],
    )
