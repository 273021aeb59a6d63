"""What DQN and R2D1 share: a Q agent learned against a frozen copy of itself."""

from __future__ import annotations

import copy

import torch

from shared.algos.optim import adam, gradient_step


class TargetNetworkAlgo:
    """Owns the target network (a frozen deep copy of the agent, so it has the same head,
    C51 support and recurrent core), the agent's Adam optimizer and the update count;
    ``state_dict`` checkpoints all three (the agent is saved separately)."""

    def __init__(self, agent, lr: float, adam_eps: float) -> None:
        self.agent = agent
        self.target = copy.deepcopy(agent).requires_grad_(False)
        self.optimizer = adam(agent.parameters(), lr=lr, eps=adam_eps)
        self.updates = 0

    def _step(self, loss: torch.Tensor, max_grad_norm: float, target_period: int, tau: float = 1.0) -> torch.Tensor:
        """One gradient step of the agent (``gradient_step``), then the target update every
        ``target_period`` updates; returns the gradient norm before clipping."""
        grad_norm = gradient_step(self.optimizer, loss, self.agent.parameters(), max_grad_norm)
        self.updates += 1
        if self.updates % target_period == 0:
            self._update_target(tau)
        return grad_norm

    @torch.no_grad()
    def _update_target(self, tau: float = 1.0) -> None:
        """target <- tau * online + (1 - tau) * target for parameters; buffers are copied."""
        for t, o in zip(self.target.parameters(), self.agent.parameters()):
            if tau < 1.0:
                t.lerp_(o, tau)
            else:
                t.copy_(o)
        for t, o in zip(self.target.buffers(), self.agent.buffers()):
            t.copy_(o)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "target": self.target.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.target.load_state_dict(state["target"])
        self.updates = int(state["updates"])
