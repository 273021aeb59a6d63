"""`rlpipe scale`: samplers added to and removed from live runs, which go on to their targets."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from services.replay.tables import make_table, table_arena
from shared import config as config_mod
from shared.factory import batch_items, env_probe, example_step
from shared.layout import segment_spec
from shared.runtime import RUN_CONFIG
from tests.pipeline import CONFIGS, instances, metric_value, rlpipe_here


def test_scale_refuses_a_stopped_run_and_bad_requests_in_one_line(tmp_path):
    prepared = rlpipe_here("prepare", str(CONFIGS / "cartpole_ppo.toml"), "--set", f"run.runs_dir='{tmp_path}'",
                           "--set", "sampler.max_count=4")
    run_dir = prepared.stdout.strip().splitlines()[-1]
    for args, message in ((["sampler=3"], "is not running: scale applies to a live run"),
                          (["sampler=two"], "'sampler=two': expected SERVICE=N"),
                          (["learner=2"], "cannot scale learner: scalable services are sampler")):
        out = rlpipe_here("scale", run_dir, *args)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out


def _scale(run, count: int) -> float:
    """Scale to ``count`` samplers; seconds until the metrics endpoint shows exactly them."""
    t0 = time.monotonic()
    out = rlpipe_here("scale", str(run.dir), f"sampler={count}")
    assert out.returncode == 0, out.stderr
    want = {str(i) for i in range(count)}
    run.wait_for(lambda: instances(run.metrics(), "rlpipe_sampler_up") == want, 10,
                 f"the metrics endpoint to show samplers {sorted(want)}")
    assert config_mod.load(run.dir / RUN_CONFIG).sampler.count == count  # the run's config records it
    return time.monotonic() - t0


@pytest.mark.learning
def test_ppo_scaled_from_2_to_4_samplers_and_back_to_1_loses_nothing_and_reaches_475(runs):
    run = runs("cartpole_ppo.toml", "sampler.max_count=4", "sampler.ring=2")
    run.wait_steps(8_000, timeout=60)
    kept = run.pid("sampler0"), run.pid("sampler1")
    out = rlpipe_here("scale", str(run.dir), "sampler=5")
    assert out.returncode == 2 and "sampler=5: this run takes 1 to 4 samplers" in out.stderr, out
    assert _scale(run, 4) < 10
    assert (run.pid("sampler0"), run.pid("sampler1")) == kept  # the others were not touched
    run.wait_for(lambda: all(metric_value(run.metrics(), "rlpipe_sampler_segments_total", instance=str(i)) > 5
                             for i in (2, 3)), 30, "the new samplers' segments")
    assert _scale(run, 1) < 10
    assert run.pid("sampler0") == kept[0]
    result = run.wait_result(180)
    assert result["reason"] == "target" and result["mean_return"] >= 475, result
    # Every segment the samplers handed over was inserted once (but those in flight when a
    # sampler stopped: at most its ring), and trained on or dropped for lag at most once.
    page = run.metrics()
    sent = metric_value(page, "rlpipe_sampler_segments_total")  # removed samplers' counts stay
    inserted = metric_value(page, "rlpipe_replay_inserts_total")
    taken = metric_value(page, "rlpipe_replay_samples_total") + metric_value(page, "rlpipe_replay_dropped_total")
    assert sent - 4 * 2 <= inserted <= sent, (sent, inserted)
    # What the 3 removed samplers had collected but not handed over: dropped, and counted.
    dropped = metric_value(page, "rlpipe_sampler_dropped_steps_total")
    assert 0 < dropped <= 3 * 2 * 8 * 16, dropped  # a pending and a partial segment of T x envs each
    assert taken <= inserted <= taken + 2 + 4 * 2, (inserted, taken)  # the queue, held ring slots


def _check_nstep(table, gamma: float, n: int) -> np.ndarray:
    """Recompute every live item's n-step return, discount and bootstrap step from the steps in
    the table's ring and compare with what the table stored; returns the live items' columns."""
    st, ring = table.storage, table.storage.ring
    keys = np.flatnonzero(table.live)
    B, rows = ring.B_total, ring.rows
    row, col = keys // B, keys % B
    ret, disc = np.zeros(len(keys)), np.zeros(len(keys))
    boot, final = np.full(len(keys), -1), np.zeros(len(keys), bool)
    open_ = np.ones(len(keys), bool)
    for j in range(n):
        k = ((row + j) % rows) * B + col
        ret[open_] += gamma ** j * ring.flat.reward[k][open_]
        term, trunc = ring.flat.terminated[k], ring.flat.truncated[k]
        ends = open_ & (term | trunc)
        disc[ends] = np.where(term[ends], 0.0, gamma ** (j + 1))
        boot[ends], final[ends] = k[ends], True
        open_ &= ~ends
    disc[open_] = gamma ** n
    boot[open_] = (((row + n) % rows) * B + col)[open_]
    np.testing.assert_allclose(st.return_[keys], ret, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(st.discount[keys], disc, rtol=1e-6)
    np.testing.assert_array_equal(st.bootstrap_key[keys], boot)
    np.testing.assert_array_equal(st.bootstrap_final[keys], final)
    return col


@pytest.mark.learning
def test_dqn_scaled_from_2_to_3_samplers_keeps_n_step_returns_right_in_every_column_and_learns(runs):
    run = runs("cartpole_dqn.toml", "sampler.max_count=3", "run.target_return=400", "run.max_env_steps=150000",
               "sampler.timeout_ms=2000", "learner.timeout_ms=2000")
    run.wait_steps(10_000, timeout=60)
    assert _scale(run, 3) < 10
    run.wait_for(lambda: metric_value(run.metrics(), "rlpipe_sampler_segments_total", instance="2") > 50,
                 30, "sampler 2's segments")
    # The table as the replay holds it, read from shared memory while replay is stopped.
    exp = config_mod.load(run.dir / RUN_CONFIG)
    before = run.stop_replay_between_operations()
    columns = {i: exp.sampler.envs for i in range(3)}
    spec = segment_spec(example_step(exp, env_probe(exp)), exp.sampler.horizon, exp.sampler.envs)
    table = make_table(exp.replay, columns, spec, batch_items(exp), arena=table_arena(exp.replay, columns, spec, run.id))
    assert table.arena.restored and table.size == before["size"]
    cols = _check_nstep(table, exp.replay.gamma, exp.replay.n_step)
    assert set(cols // exp.sampler.envs) == {0, 1, 2}  # items of every sampler, the added one too
    # Then kill it: the restarted replay re-attaches the table and the run learns on.
    os.kill(before["pid"], signal.SIGKILL)
    result = run.wait_result(240)
    assert result["reason"] == "target" and result["mean_return"] >= 400, result
    assert metric_value(run.metrics(), "rlpipe_replay_table_restarts") == 2  # ours, then the restarted replay's
