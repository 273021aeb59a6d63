"""`rlpipe scale`: samplers added to and removed from live runs, which go on to their targets."""

from __future__ import annotations

import os

import pytest

from shared.config import checks, loading
from shared.config.schema import ConfigError
from shared.config.topology import SAMPLER_SEED_STRIDE
from tests.pipeline import CONFIGS, metric_value, rlpipe_here


def test_scale_refuses_a_stopped_run_and_bad_requests_in_one_line(tmp_path):
    prepared = rlpipe_here("prepare", str(CONFIGS / "cartpole_ppo.toml"), "--set", f"run.runs_dir='{tmp_path}'",
                           "--set", "sampler.max_count=4")
    run_dir = prepared.stdout.strip().splitlines()[-1]
    for args, message in ((["sampler=3"], "is not running: scale applies to a live run"),
                          (["sampler=two"], "'sampler=two': expected SERVICE=N"),
                          (["learner=2"], "cannot scale learner: scalable services are sampler")):
        out = rlpipe_here("scale", run_dir, *args)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out


def default_room(count: int) -> int:
    """max(4 x count, cores), at most 99 samplers: the default eval.seed_offset's 1_000_003 // SAMPLER_SEED_STRIDE."""
    return min(max(checks.HEADROOM * count, len(os.sched_getaffinity(0))), 1_000_003 // SAMPLER_SEED_STRIDE)


def test_room_to_scale_is_given_where_it_costs_nothing():
    ppo = loading.load(CONFIGS / "cartpole_ppo.toml")
    assert ppo.sampler.max_count == 0 and checks.resolve_max_count(ppo).sampler.max_count == default_room(1)
    asked = loading.load(CONFIGS / "cartpole_ppo.toml", ["sampler.max_count=2"])
    assert checks.resolve_max_count(asked) == asked
    # The held-out evaluation seeds bound the room: sampler i seeds from SAMPLER_SEED_STRIDE * i.
    near = loading.load(CONFIGS / "cartpole_ppo.toml", ["sampler.count=2", "eval.seed_offset=30021"])
    assert checks.resolve_max_count(near).sampler.max_count == 3
    with pytest.raises(ConfigError, match="eval.seed_offset"):  # one more would collide with them
        loading.load(CONFIGS / "cartpole_ppo.toml", ["sampler.count=2", "eval.seed_offset=30021", "sampler.max_count=4"])
    # An off-policy table would split replay.capacity over the room's columns: none unless asked.
    dqn = loading.load(CONFIGS / "cartpole_dqn.toml")
    assert checks.resolve_max_count(dqn) == dqn


def test_the_default_config_launched_without_options_scales_to_3_samplers_that_ship_segments(runs):
    run = runs("cartpole_ppo.toml")
    assert run.config().sampler.max_count == default_room(1)  # set at launch
    run.wait_for(lambda: metric_value(run.metrics(), "rlpipe_sampler_segments_total", instance="0") > 0, 60,
                 "sampler 0's first segment")
    kept = run.pid("sampler0")
    assert run.scale(3) < 10
    assert run.pid("sampler0") == kept
    before = metric_value(run.metrics(), "rlpipe_replay_inserts_total")
    run.wait_for(lambda: all(metric_value(run.metrics(), "rlpipe_sampler_segments_total", instance=str(i)) > 3
                             for i in (0, 1, 2)), 60, "segments from each of the 3 samplers")
    assert metric_value(run.metrics(), "rlpipe_replay_inserts_total") > before + 6  # replay took them


@pytest.mark.learning
def test_ppo_scaled_from_2_to_4_samplers_and_back_to_1_loses_nothing_and_reaches_475(runs):
    run = runs("cartpole_ppo.toml", "sampler.count=2", "sampler.max_count=4", "sampler.ring=2")
    run.wait_steps(8_000, timeout=60)
    kept = run.pid("sampler0"), run.pid("sampler1")
    for request, message in (("sampler=5", "sampler=5: this run takes 1 to 4"),
                             ("action_server=2", "act locally (sampler.inference = local): it runs no action-servers")):
        out = rlpipe_here("scale", str(run.dir), request)
        assert out.returncode == 2 and message in out.stderr, out
    assert run.scale(4) < 10
    assert (run.pid("sampler0"), run.pid("sampler1")) == kept  # the others were not touched
    run.wait_for(lambda: all(metric_value(run.metrics(), "rlpipe_sampler_segments_total", instance=str(i)) > 5
                             for i in (2, 3)), 30, "the new samplers' segments")
    assert run.scale(1) < 10
    assert run.pid("sampler0") == kept[0]
    result = run.wait_result(180)
    assert result["reason"] == "target" and result["mean_return"] >= 475, result
    # Every segment the samplers handed over was inserted once (but those in flight when a
    # sampler stopped: at most its ring), and trained on or dropped for lag at most once.
    def counts():
        page = run.metrics()  # removed samplers' counts stay
        return page, metric_value(page, "rlpipe_sampler_segments_total"), metric_value(page, "rlpipe_replay_inserts_total")

    # A scrape reads the processes' counters one after another, so sampler 0 and replay could
    # count a segment in between: compare once they have stalled (the learner is done and
    # replay holds sampler 0's ring slots), i.e. when two scrapes agree.
    previous = [counts()]

    def settled():
        now, before = counts(), previous[0]
        previous[0] = now
        return now if now[1:] == before[1:] else None

    page, sent, inserted = run.wait_for(settled, 20, "the segment counts to settle")
    taken = metric_value(page, "rlpipe_replay_samples_total") + metric_value(page, "rlpipe_replay_dropped_total")
    assert sent - 4 * 2 <= inserted <= sent, (sent, inserted)
    # What the 3 removed samplers had collected but not handed over: dropped and counted (none
    # for a sampler stopped while it waited for a ring slot replay held, all announced).
    dropped = metric_value(page, "rlpipe_sampler_dropped_steps_total")
    assert dropped <= 3 * 2 * 8 * 16, dropped  # at most a pending and a partial segment of T x envs each
    assert taken <= inserted <= taken + 2 + 4 * 2, (inserted, taken)  # the queue, held ring slots
