"""The GPU check: what rlpipe does with a CUDA device, measured in a few minutes on any machine that has one.

    python -m tests.bench.gpu_check                      # (make gpu-check) on a CUDA machine
    python -m tests.bench.gpu_check --device cpu --quick # a tiny version, to see that it runs

It prints one table and writes it as gpu_check.md and gpu_check.json (under --out) with the
hardware, torch version and commit, in the shape of docs/benchmarks.md's "GPU rows":

- PPO Pong (atari_pong_ppo.toml, Nature CNN on 84x84x4) end to end under supervisord, learner on
  the device: env steps/s and learner updates/s with local inference (each sampler acts on its
  CPU) and with server inference (one action-server batching every sampler on the device);
- the PPO Pong learner update in-process (``Learner.train`` on a Pong batch, as
  tests/bench/test_learner_step.py times it) and the R2D1 Pong update (``algo.update`` on a
  sequence batch, as tests/bench/test_r2d1.py), each in fp32, TF32 (CUDA only), bf16 autocast,
  and with ``torch.compile`` of the Nature CNN's forward.

A variant that fails is a row saying so (its first line), not the end of the check. Without a
CUDA device and without ``--device cpu`` it stops at once with one line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from shared.agents.models import NatureCNN
from tests.bench.test_learner_step import per_step_ms, rlpipe_learner
from tests.bench.test_pipeline_throughput import pipeline_rates
from tests.bench.test_r2d1 import pong_r2d1_update_s
from tests.pipeline import REPO

PRECISIONS = ("fp32", "tf32", "bf16", "compile")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="torch device of the learner and action-server (default: cuda)")
    p.add_argument("--quick", action="store_true", help="a tiny version: small batches, 2 envs a sampler, short windows")
    p.add_argument("--samplers", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 4)),
                   help="samplers of the end-to-end PPO Pong runs (default: cores - 4, at most 8)")
    p.add_argument("--window-s", type=float, default=30.0, help="seconds each end-to-end run is measured over")
    p.add_argument("--out", default="runs/gpu_check", help="directory for gpu_check.md and gpu_check.json")
    return p.parse_args(argv)


@contextlib.contextmanager
def precision(variant: str, device: torch.device):
    """fp32: full-precision matmuls and convolutions; tf32: TensorFloat-32 for both (CUDA);
    bf16: autocast to bfloat16; compile: fp32 (the compiling is done by ``prepare``)."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high" if variant == "tf32" else "highest")
    torch.backends.cudnn.allow_tf32 = variant == "tf32"
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16) if variant == "bf16" else contextlib.nullcontext():
            yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


def prepare_for(variant: str):
    """What to do to a built agent for ``variant``: compile each Nature CNN's forward (in place,
    so parameter names and the algorithm's optimizer and target copies stay as they are)."""
    def compile_cnns(agent: torch.nn.Module) -> None:
        for m in agent.modules():
            if isinstance(m, NatureCNN):
                m.forward = torch.compile(m.forward)

    return compile_cnns if variant == "compile" else (lambda agent: None)


def applies(variant: str, device: torch.device) -> str | None:
    """Why ``variant`` does not apply on ``device`` (None: it does)."""
    if variant == "tf32" and device.type != "cuda":
        return "n/a: TF32 is a CUDA mode"
    return None


def learner_rows(device: torch.device, quick: bool) -> list[dict]:
    rows = []
    ppo = ("sampler.envs=2", "sampler.horizon=8") if quick else ()  # 2 samplers x 2 envs x 8: a batch of 32
    for variant in PRECISIONS:
        row = {"what": "PPO Pong learner update (Learner.train)", "mode": variant}
        if why := applies(variant, device):
            rows.append({**row, "result": why})
            continue
        try:
            train, steps, n, _ = rlpipe_learner("atari_pong_ppo.toml", device, ppo, prepare_for(variant))
            with precision(variant, device):
                ms = per_step_ms(lambda: sync(train(), device), steps, 2 if quick else 10)
            rows.append({**row, "result": f"{1e3 / (ms * steps):.2f} updates/s ({steps} gradient steps an "
                                           f"update on a batch of {n}: {ms:.1f} ms a step)",
                         "updates_per_s": 1e3 / (ms * steps)})
        except Exception as e:  # a variant this torch or device cannot run is a row, not the end of the check
            rows.append({**row, "result": f"failed: {first_line(e)}"})
    batch = 2 if quick else 64
    for variant in PRECISIONS:
        row = {"what": f"R2D1 Pong update (algo.update, batch {batch})", "mode": variant}
        if why := applies(variant, device):
            rows.append({**row, "result": why})
            continue
        try:
            seconds, length = pong_r2d1_update_s(batch, device, 1 if quick else 5, lambda: precision(variant, device),
                                                 prepare_for(variant))
            rows.append({**row, "result": f"{1 / seconds:.2f} updates/s ({batch} sequences of {length})",
                         "updates_per_s": 1 / seconds})
        except Exception as e:
            rows.append({**row, "result": f"failed: {first_line(e)}"})
    return rows


def pipeline_rows(device: torch.device, args: argparse.Namespace) -> list[dict]:
    shape = ["sampler.count=2", "sampler.envs=2", "sampler.horizon=8"] if args.quick else \
        [f"sampler.count={args.samplers}"]
    warm, window = (200, 5.0) if args.quick else (5_000, args.window_s)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlpipe-gpu-check-") as tmp:
        for inference in ("local", "server"):
            row = {"what": "PPO Pong end to end (supervisord), learner on the device", "mode": f"{inference} inference"}
            try:
                rates = pipeline_rates(Path(tmp) / inference, "atari_pong_ppo.toml",
                                       [f"run.device='{device}'", f"sampler.inference='{inference}'",
                                        "run.max_env_steps=100000000", *shape], warm, window, timeout=300)
                rows.append({**row, "result": f"{rates['env_steps_per_s']:,.0f} env steps/s, "
                                              f"{rates['updates_per_s']:.2f} updates/s", **rates})
            except Exception as e:
                rows.append({**row, "result": f"failed: {first_line(e)}"})
    local, server = (r.get("env_steps_per_s") for r in rows)
    if local and server:
        rows.append({"what": "server / local inference, env steps/s", "mode": "", "result": f"{server / local:.2f}x",
                     "ratio": server / local})
    return rows


def sync(value, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return value


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def hardware(device: torch.device) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cpu": f"{cpu}, {os.cpu_count()} cores", "torch": torch.__version__,
            "commit": commit.stdout.strip() or "unknown (no git here)",
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def markdown(info: dict, rows: list[dict], quick: bool) -> str:
    head = (f"GPU check{' (--quick: tiny sizes, not a measurement)' if quick else ''}: {info['date']}, commit "
            f"{info['commit']}, {info['device']}; {info['cpu']}; torch {info['torch']}\n\n")
    table = ["| measurement | mode | result |", "|---|---|---|"]
    table += [f"| {r['what']} | {r['mode']} | {r['result']} |" for r in rows]
    return head + "\n".join(table) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); "
              "`python -m tests.bench.gpu_check --device cpu --quick` runs a tiny version on the CPU", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    info = hardware(device)
    rows = learner_rows(device, args.quick) + pipeline_rows(device, args)
    text = markdown(info, rows, args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.md").write_text(text)
    (out / "gpu_check.json").write_text(json.dumps({**info, "quick": args.quick, "rows": rows}, indent=1))
    print(text + f"\n{time.monotonic() - t0:.0f} s; written to {out / 'gpu_check.md'} and {out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
