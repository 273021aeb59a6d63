"""The optimizers (shared/algos/optim.py) are torch's own and step exactly as torch's do; the
gradient step clips as ``torch.nn.utils.clip_grad_norm_`` and averages over learner ranks
before clipping."""

import copy
import os
import subprocess
import sys

import torch

import pytest

from shared.algos.optim import adam, gradient_step, optimizer, radam, rmsprop


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train(make, steps=6, max_grad_norm=0.5):
    net = _net()
    opt = make(net.parameters())
    data = torch.Generator().manual_seed(1)
    for i in range(steps):
        gradient_step(opt, net(torch.randn(16, 4, generator=data)).square().mean(), net.parameters(), max_grad_norm)
        if i == 2:  # a checkpoint round trip in the middle
            opt.load_state_dict(opt.state_dict())
    return [p.detach().clone() for p in net.parameters()], opt.state_dict()


def _reference(make, steps=6, max_grad_norm=0.5):
    """The same training in plain torch: zero_grad, backward, clip_grad_norm_, step."""
    net = _net()
    opt = make(net.parameters())
    data = torch.Generator().manual_seed(1)
    for i in range(steps):
        opt.zero_grad()
        net(torch.randn(16, 4, generator=data)).square().mean().backward()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm)
        opt.step()
        if i == 2:
            opt.load_state_dict(opt.state_dict())
    return [p.detach().clone() for p in net.parameters()], opt.state_dict()


def _assert_same(ours, theirs):
    (params, state), (want_params, want_state) = ours, theirs
    assert all(torch.equal(a, b) for a, b in zip(params, want_params, strict=True))
    assert state["state"].keys() == want_state["state"].keys()
    for k in state["state"]:
        assert state["state"][k].keys() == want_state["state"][k].keys()
        assert all(torch.equal(state["state"][k][f], want_state["state"][k][f]) for f in want_state["state"][k])
    assert state["param_groups"] == want_state["param_groups"]


def test_optimizers_are_torchs_and_step_as_torchs():
    opt = adam(_net().parameters(), 1e-2, 1e-5)
    assert type(opt) is torch.optim.Adam and opt.defaults["fused"]
    assert type(rmsprop(_net().parameters(), 1e-2, 0.99, 1e-5)) is torch.optim.RMSprop
    for max_grad_norm in (0.5, 0.0):
        _assert_same(_train(lambda p: adam(p, 1e-2, 1e-5), max_grad_norm=max_grad_norm),
                     _reference(lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-5, fused=True), max_grad_norm=max_grad_norm))
        _assert_same(_train(lambda p: rmsprop(p, 1e-2, 0.99, 1e-5), max_grad_norm=max_grad_norm),
                     _reference(lambda p: torch.optim.RMSprop(p, lr=1e-2, alpha=0.99, eps=1e-5),
                                max_grad_norm=max_grad_norm))


def test_radam_is_torchs_and_a_config_names_any_of_the_three():
    assert type(radam(_net().parameters(), 1e-2, 1e-5)) is torch.optim.RAdam
    for max_grad_norm in (0.5, 0.0):
        _assert_same(_train(lambda p: optimizer("radam", p, 1e-2, 1e-5), max_grad_norm=max_grad_norm),
                     _reference(lambda p: torch.optim.RAdam(p, lr=1e-2, eps=1e-5, foreach=True),
                                max_grad_norm=max_grad_norm))
    kinds = {name: type(optimizer(name, _net().parameters(), 1e-3, 1e-8)) for name in ("adam", "radam", "rmsprop")}
    assert kinds == {"adam": torch.optim.Adam, "radam": torch.optim.RAdam, "rmsprop": torch.optim.RMSprop}
    with pytest.raises(ValueError, match="'sgd' unknown"):
        optimizer("sgd", _net().parameters(), 1e-3, 1e-8)


def test_adam_falls_back_to_foreach_where_fused_does_not_exist():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    opt = adam([p], 1e-2)
    assert not opt.defaults["fused"] and opt.defaults["foreach"]
    p.grad = torch.ones(3, dtype=torch.complex64)
    opt.step()
    want = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    ref = torch.optim.Adam([want], lr=1e-2)
    want.grad = torch.ones(3, dtype=torch.complex64)
    ref.step()
    assert torch.allclose(p.detach(), want.detach())


def test_checkpoint_loads_into_plain_torch_adam_and_back():
    """An optimizer state saved by ours continues identically in a plain torch Adam, and one
    saved by plain torch Adam (an older checkpoint) in ours."""
    net = _net()
    opt = adam(net.parameters(), 1e-2, 1e-5)
    for _ in range(3):
        gradient_step(opt, net(torch.randn(16, 4)).square().mean(), net.parameters(), 0.5)
    twin = _net()
    twin.load_state_dict(net.state_dict())
    plain = torch.optim.Adam(twin.parameters(), lr=1e-2, eps=1e-5, fused=True)
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))  # as a checkpoint file would: no shared tensors
    ours_again = adam(_net().parameters(), 1e-2, 1e-5)
    ours_again.load_state_dict(copy.deepcopy(plain.state_dict()))
    assert ours_again.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    x = torch.randn(16, 4)
    gradient_step(opt, net(x).square().mean(), net.parameters(), 0.5)
    gradient_step(plain, twin(x).square().mean(), twin.parameters(), 0.5)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), twin.parameters(), strict=True))


def test_gradient_step_returns_the_norm_before_clipping_and_clips():
    p = torch.nn.Parameter(torch.zeros(2))
    q = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p, q], lr=1.0)
    loss = (p * torch.tensor([3.0, 0.0])).sum() + (q * 4.0).sum()  # gradient norm 5
    norm = gradient_step(opt, loss, [p, q], 1.0)
    assert torch.allclose(norm, torch.tensor(5.0))
    assert torch.allclose(p.detach(), torch.tensor([-0.6, 0.0])) and torch.allclose(q.detach(), torch.tensor([-0.8]))
    norm = gradient_step(opt, (p * 0.3).sum(), [p, q], 0.0)  # q has no gradient now; no clipping
    assert torch.allclose(norm, torch.tensor(0.3 * 2**0.5)) and q.grad is None
    assert torch.allclose(p.detach(), torch.tensor([-0.9, -0.3]))


RANKS_SCRIPT = r"""
import os
import sys
import torch
import torch.distributed as dist
from shared.algos.optim import gradient_step, ranks

rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
assert ranks() == 2
p = torch.nn.Parameter(torch.zeros(2))
opt = torch.optim.SGD([p], lr=1.0)
# rank 0's gradient is (6, 0), rank 1's (0, 8): the average (3, 4) has norm 5, clipped to 1
norm = gradient_step(opt, (p * torch.tensor([6.0, 0.0] if rank == 0 else [0.0, 8.0])).sum(), [p], 1.0)
assert torch.allclose(norm, torch.tensor(5.0)), norm
assert torch.allclose(p.detach(), torch.tensor([-0.6, -0.8])), p
dist.destroy_process_group()
print("ok", flush=True)
# gloo's threads can abort the interpreter's exit ("terminate called without an active exception")
# when the peer rank has already gone; that teardown is not what this checks
os._exit(0)
"""


def test_gradients_are_averaged_over_ranks_before_clipping(tmp_path):
    store = str(tmp_path / "store")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANKS_SCRIPT, str(rank), store], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert all(proc.returncode == 0 and out.strip().endswith("ok") for proc, out in zip(procs, outs)), outs
