"""The optimizers the algorithms here use: Adam, fused (and RMSprop, an A2C option).

The fused implementation updates all of a network's parameters in one kernel instead of a
dozen small ops per tensor; on this machine's CPU that took a CartPole DQN update
(256x256 MLP, batch 128) from 3.1-3.2 ms to 2.6-2.7 ms and a 64x64 SAC update from 9.2 ms
to 5.8 ms. It exists on CPU and CUDA for floating-point parameters, which ours all are.

``torch.optim.Optimizer``'s methods and ``Adam.step`` are wrapped for TorchDynamo (switched
off, or a graph break around the step), and the wrappers import ``torch._dynamo`` on their
first call: 1.5-1.9 s of CPU here, more than ``import torch`` itself, in every learner's
start-up. rlpipe never compiles, so it calls past them: for each wrapped method the
wrapper's cached "dynamo-disabled" function is set to the method itself, and ``Adam`` steps
with the unwrapped step under ``no_grad`` (what the wrapper does when not compiling, with
``differentiable`` off). The same calls, without the import. A torch whose methods are not
wrapped this way is used as it is.

Data-parallel learner ranks (``learner.count`` > 1, one ``torch.distributed`` group): every
gradient step averages the gradients over the ranks before clipping, so each rank takes the
same step and their parameters stay bit-identical. It is the all-reduce that
``DistributedDataParallel`` does, done here, at the one place every algorithm steps an
optimizer: DDP hooks into ``forward`` only, and the algorithms call their agents' other
methods (``evaluate``, ``q``, ``sample``, the target networks...). Decisions taken from data
(PPO's early stop at ``target_kl``) use values averaged over the ranks too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

for _method in ("add_param_group", "zero_grad", "state_dict", "load_state_dict"):
    _fn = getattr(getattr(torch.optim.Optimizer, _method), "__wrapped__", None)
    if _fn is not None:
        setattr(_fn, "__dynamo_disable", _fn)


def _stepping_without_dynamo(cls: type) -> type:
    """``cls`` whose ``step`` calls past torch's TorchDynamo wrapper (module doc)."""
    step = getattr(cls.step, "__wrapped__", None)
    if step is None:
        return cls

    def unwrapped_step(self, closure=None):
        with torch.no_grad():
            return step(self, closure)

    return type(cls.__name__, (cls,), {"step": unwrapped_step})


class _Adam(_stepping_without_dynamo(torch.optim.Adam)):
    """Fused Adam whose steps after the first call the fused kernel straight away.

    ``Adam.step`` spends 30 of its 47 us here (a 2-member 64x64 ensemble's 6 tensors) in
    Python around the kernel: the profiler range and step hooks of the ``Optimizer`` wrapper,
    the per-parameter state walk, the grouping by device and dtype. Once every parameter with
    a gradient has its state (torch's own step made it), a step is the kernel torch's would
    call, on the same state tensors, so checkpoints and ``load_state_dict`` are torch's.
    """

    def step(self, closure=None):
        if closure is not None or not all(self.state[p] for g in self.param_groups for p in g["params"]
                                          if p.grad is not None):
            return super().step(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self.state[p] for p in params]
            steps = [state["step"] for state in states]
            torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            torch._fused_adam_(params, [p.grad for p in params], [state["exp_avg"] for state in states],
                               [state["exp_avg_sq"] for state in states], [], steps, amsgrad=False,
                               lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                               eps=group["eps"], maximize=False)
        return None

    step.hooked = True  # Optimizer.__init__ wraps a step without it in its profiler range and hooks

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's, without its profiler range (12 -> 2 us here) when setting to None."""
        if not set_to_none:
            return super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


_RMSprop = _stepping_without_dynamo(torch.optim.RMSprop)


def adam(params, lr: float, eps: float = 1e-8) -> torch.optim.Adam:
    """torch's Adam, fused (module doc), plain: no amsgrad, maximize, decoupled weight decay
    or gradient scaler, which the fast step above does not handle."""
    return _Adam(params, lr=lr, eps=eps, fused=True)


def rmsprop(params, lr: float, alpha: float, eps: float) -> torch.optim.RMSprop:
    return _RMSprop(params, lr=lr, alpha=alpha, eps=eps)


def set_lr(optimizer: torch.optim.Optimizer, lr: float, progress: float, anneal: bool) -> float:
    """Set the learning rate of every group to ``lr``, decayed linearly to 0 over the run
    (``progress`` 0 -> 1) when ``anneal``; returns the rate set."""
    lr = lr * (1.0 - progress) if anneal else lr
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def ranks() -> int:
    """Learner ranks training together: the process group's size, 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def average_over_ranks(tensors: Iterable[torch.Tensor]) -> None:
    """Average ``tensors`` in place over the learner ranks: one all-reduce of their
    concatenation (DDP's buckets, as one); nothing on a single learner, which does not
    even walk ``tensors`` (a generator costs nothing there)."""
    n = ranks()
    if n == 1:
        return
    tensors = list(tensors)
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= n
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def gradient_step(optimizer: torch.optim.Optimizer, loss: torch.Tensor, params, max_grad_norm: float) -> torch.Tensor:
    """One optimizer step on ``loss``, with the gradients averaged over the learner ranks and
    their global norm clipped to ``max_grad_norm`` (0 = no clipping); returns that norm
    before clipping."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grads = [p.grad for p in params if p.grad is not None]
    average_over_ranks(grads)
    # torch.nn.utils.clip_grad_norm_'s arithmetic, without its grouping of the tensors by
    # device and dtype on every call (half its cost on a small network: 43 -> 21 us here).
    grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else torch.zeros(())
    if max_grad_norm > 0 and grads:
        torch._foreach_mul_(grads, (max_grad_norm / (grad_norm + 1e-6)).clamp_(max=1.0))
    optimizer.step()
    return grad_norm
