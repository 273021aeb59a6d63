"""Benchmark: how long a run takes to start sampling and to stop.

- start: from the moment `rlpipe launch --detach` starts to the first env step of the
  last sampler to begin (the time its "sampler N: ..." line is logged, just before its
  loop steps the envs), for local and server inference;
- stop: the wall-clock of `rlpipe stop RUN` on the running default experiment, until
  supervisord and every service are gone.

Five runs each, medians. Run with `make bench`.
"""

from __future__ import annotations

import re
import statistics
import time
from datetime import datetime

import pytest

from shared.config import loading as config
from tests.pipeline import CONFIGS, Run, rlpipe

pytestmark = pytest.mark.bench
REPEATS = 5
SAMPLERS = config.load(CONFIGS / "cartpole_ppo.toml").sampler.count
_STARTED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) sampler\d+ INFO services\.sampler: sampler \d+:", re.M)


def first_steps(run: Run, samplers: int) -> list[float]:
    """Wall-clock times at which each sampler began stepping its envs."""
    def found():
        stamps = [_STARTED.search(run.logs(f"sampler{i}")) for i in range(samplers)]
        return stamps if all(stamps) else None

    stamps = run.wait_for(found, 60, "every sampler to start")
    return [datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() for m in stamps]


@pytest.mark.parametrize("inference", ["local", "server"])
def test_launch_to_first_env_step_and_stop(tmp_path, inference):
    starts, stops = [], []
    for i in range(REPEATS):
        t0 = time.time()
        run = Run.launch(tmp_path / str(i), "cartpole_ppo.toml", f"sampler.inference={inference}",
                         "run.target_return=1e9", command_line=True)
        try:
            starts.append(max(first_steps(run, SAMPLERS)) - t0)
            run.wait_steps(2_000)
            t1 = time.monotonic()
            out = rlpipe("stop", str(run.dir))
            stops.append(time.monotonic() - t1)
            assert out.returncode == 0, out.stdout + out.stderr
        finally:
            run.close()
    print(f"\n{inference} inference: `rlpipe launch` -> first env step of every sampler: median "
          f"{statistics.median(starts):.2f} s (runs {[round(s, 2) for s in starts]}); `rlpipe stop`: median "
          f"{statistics.median(stops):.2f} s (runs {[round(s, 2) for s in stops]})")
