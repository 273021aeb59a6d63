"""The optimizers (shared/algos/optim.py) step exactly as torch's own, and never import
torch._dynamo (1.5-1.9 s of CPU at every learner's start-up)."""

import subprocess
import sys

SCRIPT = r"""
import sys
import torch
from shared.algos.optim import adam, gradient_step, rmsprop

def train(make, steps=6):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = make(net.parameters())
    for i in range(steps):
        gradient_step(opt, net(torch.randn(16, 4)).square().mean(), list(net.parameters()), 0.5)
        if i == 2:  # a checkpoint round trip in the middle
            opt.load_state_dict(opt.state_dict())
    return [p.detach().clone() for p in net.parameters()], opt.state_dict()

ours = [train(lambda p: adam(p, 1e-2, 1e-5)), train(lambda p: rmsprop(p, 1e-2, 0.99, 1e-5))]
assert "torch._dynamo" not in sys.modules, "an optimizer imported torch._dynamo"
theirs = [train(lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-5, fused=True)),
          train(lambda p: torch.optim.RMSprop(p, lr=1e-2, alpha=0.99, eps=1e-5))]
for (params, state), (want_params, want_state) in zip(ours, theirs):
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))
    assert state["state"].keys() == want_state["state"].keys()
    for k in state["state"]:
        assert all(torch.equal(state["state"][k][f], want_state["state"][k][f]) for f in want_state["state"][k])
print("ok")
"""


def test_optimizers_step_as_torchs_without_importing_dynamo():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
