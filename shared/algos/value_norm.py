"""Value targets normalised by their running mean and standard deviation (``algo.value_norm``).

The value net of A2C, PPO and IMPALA then learns (return - mean) / std, where ``reward_scale``
asks the user to know the returns' size beforehand. It is MAPPO's ValueNorm (Yu et al. 2022,
marlbenchmark/on-policy ``onpolicy/utils/valuenorm.py``), one of the implementation choices that
paper finds to matter: exponential moving averages of the returns and of their squares with a
weight of 0.99999 an update, debiased as Adam's moments are (divided by 1 - 0.99999^n after n
updates), so for the first ~10^5 updates they are close to the plain mean over every update so
far; the variance is at least 0.01, so a constant return is not blown up.

The network's outputs are normalised values throughout: the targets' recursions (GAE, V-trace)
take them back to returns with the statistics before this update's (``denormalize``), the
statistics then take in the update's returns, and the value loss compares the outputs with the
returns normalised by the new statistics. Over data-parallel learner ranks the batch's moments
are averaged first, so every rank keeps the same statistics.
"""

from __future__ import annotations

import torch

from shared.algos.optim import average_over_ranks

BETA = 0.99999
"""The moving averages' weight an update (on-policy's default)."""
MIN_VAR = 1e-2
"""The variance's floor (on-policy's): a standard deviation of at least 0.1."""


class ValueNorm:
    """Running moments of the value targets, on ``device``; a checkpoint keeps them (``state_dict``)."""

    def __init__(self, device: torch.device) -> None:
        # float64: 1 - BETA is 1e-5, below float32's resolution near 1 for the debiasing term.
        self.moments = torch.zeros(3, dtype=torch.float64, device=device)  # mean, mean of squares, debiasing term
        self._derive()

    def _derive(self) -> None:
        """The debiased mean and standard deviation from the moments, once a change of them (a batch
        normalises and denormalises five tensors with them)."""
        mean, mean_sq, debias = self.moments
        debias = debias.clamp(min=1e-5)
        mean, mean_sq = mean / debias, mean_sq / debias
        self.mean, self.std = mean.float(), (mean_sq - mean * mean).clamp(min=MIN_VAR).sqrt().float()

    def mean_std(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The debiased mean and standard deviation (0 and 0.1 before the first update)."""
        return self.mean, self.std

    def update(self, returns: torch.Tensor) -> None:
        """Take in one update's value targets (its real steps)."""
        batch = torch.stack([returns.double().mean(), returns.double().square().mean(),
                             torch.ones((), dtype=torch.float64, device=returns.device)])
        average_over_ranks([batch])
        self.moments.mul_(BETA).add_(batch, alpha=1.0 - BETA)
        self._derive()

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std + self.mean

    def state_dict(self) -> dict:
        return {"moments": self.moments.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.moments.copy_(state["moments"])
        self._derive()


class CheckpointedState:
    """What A2C and PPO checkpoint: the optimizer's state and the value targets' statistics (the
    agent's parameters are saved separately). A run resumed with ``value_norm`` newly switched on
    starts the statistics afresh."""

    optimizer: torch.optim.Optimizer
    value_norm: ValueNorm | None

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.value_norm is not None:
            state["value_norm"] = self.value_norm.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.value_norm is not None and "value_norm" in state:
            self.value_norm.load_state_dict(state["value_norm"])
