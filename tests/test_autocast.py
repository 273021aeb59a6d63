"""The learner's bf16 autocast (``learner.autocast``): updates run, their losses are finite and
near fp32's, and the parameters and optimizer state stay fp32. Timings: tests/bench/test_learner_step.py."""

import logging
import math
import platform

import pytest
import torch

from shared.config import loading
from shared.config.schema import ConfigError
from services.learner.learner import cpu_emulates_bf16
from tests.bench.test_learner_step import rlpipe_learner
from tests.pipeline import CONFIGS

SAC = ("pendulum_sac.toml", ("model.hidden_sizes=[256, 256]", "algo.batch_size=256"), ("critic_loss", "actor_loss"))
DQN = ("minatar_breakout_dqn.toml", (), ("loss",))


@pytest.mark.parametrize("config_file, overrides, terms", [SAC, DQN], ids=["sac", "minatar_dqn"])
def test_bf16_updates_are_finite_and_near_fp32(config_file, overrides, terms):
    torch.set_num_threads(1)
    stats, agents = {}, {}
    for autocast in ("off", "bf16"):
        torch.manual_seed(0)  # the same initial networks
        train, *_ = rlpipe_learner(config_file, overrides=(*overrides, f"learner.autocast='{autocast}'"),
                                   prepare=lambda agent, name=autocast: agents.update({name: agent}))
        stats[autocast] = [train() for _ in range(3)]
    for fp32, bf16 in zip(stats["off"], stats["bf16"]):
        for term in terms:
            assert math.isfinite(bf16[term])
            # bf16 keeps 8 significant bits: ~0.4% a product, a few % through a network and a loss;
            # SAC's actor loss alpha log pi - Q is a small difference of such terms (~0.1 here,
            # 0.01 apart measured), so its error is absolute.
            assert bf16[term] == pytest.approx(fp32[term], rel=0.05, abs=0.02), term
    # fp32 parameters, hence fp32 gradients and Adam moments (torch makes them like the parameters).
    assert all(p.dtype == torch.float32 for p in agents["bf16"].parameters())


def test_autocast_and_threads_are_checked():
    with pytest.raises(ConfigError, match=r"^learner.autocast = 'fp8': allowed: off, bf16$"):
        loading.load(CONFIGS / "pendulum_sac.toml", ["learner.autocast='fp8'"])
    with pytest.raises(ConfigError, match=r"^learner.threads = 0: must be >= 1$"):
        loading.load(CONFIGS / "pendulum_sac.toml", ["learner.threads=0"])


def test_bf16_on_a_cpu_without_bf16_instructions_is_one_warning_line(caplog):
    """Emulated bf16 made SAC's update 15x slower than fp32 on an AVX2 EPYC: the learner says so
    where the CPU's flags (read here from /proc/cpuinfo, not from torch) have no bf16."""
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), None)
    if flags is None or platform.machine() != "x86_64":
        pytest.skip("needs an x86 Linux CPU's /proc/cpuinfo flags")
    emulated = not {"avx512_bf16", "amx_bf16"} & set(flags)
    assert cpu_emulates_bf16() == emulated
    with caplog.at_level(logging.WARNING, logger="services.learner.learner"):
        rlpipe_learner("pendulum_sac.toml", overrides=("learner.autocast='bf16'",))
    warned = [r.getMessage() for r in caplog.records if "learner.autocast = bf16" in r.getMessage()]
    assert len(warned) == emulated and all("\n" not in m and "set learner.autocast = off" in m for m in warned)
