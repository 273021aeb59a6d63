"""The optimizers the algorithms here use: torch's Adam, fused; RAdam and RMSprop where a
config names them (``optimizer(name, ...)``: A2C's and PQN's ``optimizer`` field).

The fused implementation updates all of a network's parameters in one kernel instead of a
dozen small ops per tensor, which on a CPU made the small networks' updates (CartPole DQN,
Pendulum SAC) markedly cheaper (docs/benchmarks.md, "Continuous control"). torch has it on
CPU and CUDA for floating-point parameters, which ours all are; other parameters get
torch's foreach implementation.

Only public torch APIs are used: the optimizers are torch's own, unpatched, and the
clipping is ``torch.nn.utils.clip_grad_norm_``. What that costs: torch's optimizer methods
import ``torch._dynamo`` on their first call (they are wrapped for TorchDynamo even when
nothing compiles), once in every learner's start-up, when its optimizer is built; torch has
no public setting that avoids it (docs/benchmarks.md, "Start-up and stop"). And per step
the Python around the kernels: ``Adam.step``'s profiler range, hooks, dynamo wrappers and
per-parameter state walk, and the clipping's grouping of the gradients by device and dtype
(twice), a small share of a CartPole gradient step (docs/benchmarks.md, "Learner step").
``gradient_step`` sets the gradients to None itself (as ``zero_grad(set_to_none=True)``,
without its profiler range).

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


def _fusable(params: list) -> bool:
    """Whether torch's fused Adam takes all of ``params`` (tensors or param-group dicts):
    floating-point tensors on CPU or CUDA."""
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    return bool(tensors) and all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors)


def adam(params, lr: float, eps: float = 1e-8, beta1: float = 0.9) -> torch.optim.Adam:
    """torch's Adam, fused where torch has it (module doc), else foreach; plain: no
    amsgrad, maximize or weight decay; beta2 0.999."""
    params = list(params)
    fused = _fusable(params)
    return torch.optim.Adam(params, lr=lr, eps=eps, betas=(beta1, 0.999), fused=fused,
                            foreach=None if fused else True)


def radam(params, lr: float, eps: float = 1e-8, beta1: float = 0.9) -> torch.optim.RAdam:
    """torch's RAdam (Liu et al. 2020: Adam whose adaptive step is switched on only once the
    variance of its second-moment estimate is tractable, ~5 steps with beta2 0.999, and
    rectified after; SGD with momentum before), foreach: torch has no fused RAdam. Plain as
    ``adam``: no weight decay, beta2 0.999."""
    return torch.optim.RAdam(list(params), lr=lr, eps=eps, betas=(beta1, 0.999), foreach=True)


def rmsprop(params, lr: float, alpha: float, eps: float) -> torch.optim.RMSprop:
    return torch.optim.RMSprop(params, lr=lr, alpha=alpha, eps=eps)


def optimizer(name: str, params, lr: float, eps: float, rmsprop_alpha: float = 0.99) -> torch.optim.Optimizer:
    """The optimizer a config's ``optimizer`` field names (``shared.algos.hparams.OPTIMIZERS``:
    adam, radam, rmsprop), with learning rate ``lr`` and epsilon ``eps``; ``rmsprop_alpha`` is
    RMSprop's smoothing constant. ValueError for another name (the configs refuse it first)."""
    if name == "adam":
        return adam(params, lr=lr, eps=eps)
    if name == "radam":
        return radam(params, lr=lr, eps=eps)
    if name == "rmsprop":
        return rmsprop(params, lr=lr, alpha=rmsprop_alpha, eps=eps)
    raise ValueError(f"optimizer {name!r} unknown; use one of adam, radam, rmsprop")


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


_skipped_steps = 0
_taken_steps = 0


def skipped_steps() -> int:
    """Gradient steps ``gradient_step`` skipped in this process so far (a process-wide count:
    the learner reads its increase around each update and reports it)."""
    return _skipped_steps


def taken_steps() -> int:
    """Gradient steps ``gradient_step`` took in this process so far (as ``skipped_steps``: an
    update whose steps were all skipped learned nothing)."""
    return _taken_steps


def gradient_step(optimizer: torch.optim.Optimizer, loss: torch.Tensor, params, max_grad_norm: float) -> torch.Tensor:
    """One optimizer step on ``loss``, with the gradients averaged over the learner ranks and
    their global norm clipped to ``max_grad_norm`` (0 = no clipping); returns that norm
    before clipping.

    A step whose gradient norm (or, on a single learner, loss) is not finite is skipped: no
    optimizer step, the gradients dropped, ``skipped_steps()`` one more. Taken, it would write
    NaN into every parameter (the clip factor ``max_norm / inf`` is 0, ``inf * 0`` NaN) and the
    optimizer's moments. Ranks decide on the averaged norm alone, so they decide alike. The
    check reads one value back from the device each step."""
    global _skipped_steps, _taken_steps
    params = list(params)
    for group in optimizer.param_groups:  # zero_grad(set_to_none=True) (module doc)
        for p in group["params"]:
            p.grad = None
    loss.backward()
    average_over_ranks(p.grad for p in params if p.grad is not None)
    if max_grad_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    finite = torch.isfinite(grad_norm)
    if ranks() == 1:
        finite = finite & torch.isfinite(loss.detach())
    if not bool(finite):
        _skipped_steps += 1
        for p in params:
            p.grad = None
        return grad_norm
    optimizer.step()
    _taken_steps += 1
    return grad_norm
