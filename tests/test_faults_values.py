"""Faults in values (issue 27): non-finite rewards and observations are env failures, a
non-finite update is skipped, non-finite parameters are neither published nor checkpointed;
a segment replay refuses is dropped and a silent replay is given up on after a bound."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import zmq

from services.learner.learner import non_finite
from services.sampler.transport import RemoteSink
from shared.algos import optim
from shared.envs.group import EnvConfig, EnvError, EnvGroup
from shared.runtime import metrics
from tests.pipeline import metric_value
from tests.test_envs import HELPERS, Buffers
from tests.test_learner_files import make_learner
from tests.test_replay_service import RING, SECRET, T, B, Hub, exp_and_example, segment  # noqa: F401 (fixture)


# ---------------------------------------------------------------- envs


@pytest.mark.parametrize("mode,problem", [
    ("inf", "observation.x contains NaN or an infinity"),
    ("neg_inf", "observation.x contains NaN or an infinity"),
    ("inf_reward", "reward is inf"),
    ("huge_reward", "reward is 1e+16"),
])
def test_infinite_or_huge_values_are_env_errors(mode, problem):
    cfg = EnvConfig(id=f"{HELPERS}:make_faulty_env", kwargs=f'{{"fail_seed": 11, "fail_at": 2, "mode": "{mode}"}}')
    group = EnvGroup(cfg, 3, 10)
    buf = Buffers(group)
    group.reset(buf.obs)
    buf.step(group)
    with pytest.raises(EnvError) as info:
        buf.step(group)
    assert info.value.env_indices == (1,)
    assert str(info.value).startswith(f"env '{cfg.id}' #1: {problem}")
    np.testing.assert_array_equal(buf.reward, [1.0, 0.0, 1.0])
    np.testing.assert_array_equal(buf.truncated, [False, True, False])
    assert np.isfinite(buf.obs.x).all()  # the failed env's observation is the one before the step


def test_a_large_observation_with_an_infinity_is_caught():
    """Leaves of more than 16 values take the BLAS path."""
    from shared.envs.group import _non_finite

    x = np.zeros((4, 84), np.float32)
    assert not _non_finite(x)
    x[3, 5] = -np.inf
    assert _non_finite(x)
    x[3, 5] = np.nan
    assert _non_finite(x)


@pytest.mark.parametrize("dtype, big", [(np.float16, 300.0), (np.float16, 6e4), (np.float32, 1e30), (np.float64, 1e200)])
def test_large_finite_observations_are_finite_in_every_float_dtype(dtype, big):
    """Their squares overflow: the check does not take them for infinities."""
    from shared.envs.group import _non_finite

    for n in (4, 336):  # the Python loop over a few values and the whole-array path
        x = np.full(n, big, dtype)
        assert not _non_finite(x)
        x[n // 2] = np.inf
        assert _non_finite(x)
        x[n // 2] = np.nan
        assert _non_finite(x)


# ---------------------------------------------------------------- updates


def test_gradient_step_skips_a_non_finite_update_and_counts_it():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    opt = optim.adam(net.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in net.parameters()]
    skipped = optim.skipped_steps()
    x = torch.tensor([[1.0, float("inf"), 0.0]])
    norm = optim.gradient_step(opt, net(x).pow(2).mean(), net.parameters(), max_grad_norm=0.5)
    assert not torch.isfinite(norm)
    assert optim.skipped_steps() == skipped + 1
    for b, p in zip(before, net.parameters()):
        assert torch.equal(b, p) and p.grad is None
    assert not opt.state or all(float(s["step"]) == 0 for s in opt.state.values())  # Adam's moments untouched
    optim.gradient_step(opt, net(torch.ones(1, 3)).pow(2).mean(), net.parameters(), max_grad_norm=0.5)
    assert optim.skipped_steps() == skipped + 1
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert any(not torch.equal(b, p) for b, p in zip(before, net.parameters()))


def _ppo_batch(exp, bad_obs: bool):
    """A filled batch slot of CartPole PPO (numpy), with one +inf observation if ``bad_obs``."""
    from services.build import batch_spec, env_probe, example_step
    from shared.data.namedarraytuple import from_spec

    probe = env_probe(exp)
    batch = from_spec(batch_spec(exp, example_step(exp, probe)))
    probe.close()
    rng = np.random.default_rng(0)
    batch.samples.observation[:] = rng.normal(size=batch.samples.observation.shape)
    if bad_obs:
        batch.samples.observation[3, 1, 2] = np.inf
    batch.samples.action[:] = rng.integers(0, 2, size=batch.samples.action.shape)
    batch.samples.reward[:] = 1.0
    batch.samples.terminated[:] = False
    batch.samples.truncated[:] = False
    batch.samples.policy_version[:] = 0
    batch.bootstrap_observation[:] = 0.0
    return batch


def test_the_learner_skips_and_counts_a_non_finite_update_and_checkpoints_only_finite_state(tmp_path):
    from prometheus_client import REGISTRY, generate_latest

    from shared.config import loading as config
    from tests.pipeline import CONFIGS

    exp = config.load(CONFIGS / "cartpole_ppo.toml")
    learner = make_learner(tmp_path)
    learner.m = metrics.for_service("learner", 7)
    before = {k: v.clone() for k, v in learner.agent.state_dict().items()}
    meta = {"env_steps": 256, "episodes": [], "dropped": 0}
    learner.train(_ppo_batch(exp, bad_obs=True), meta)
    assert learner.skipped_steps >= 1
    for k, v in learner.agent.state_dict().items():
        assert torch.equal(before[k], v), k  # every gradient step of the update was skipped
    page = generate_latest(REGISTRY).decode()
    assert metric_value(page, "rlpipe_learner_skipped_steps_total", instance="7") == learner.skipped_steps
    learner.train(_ppo_batch(exp, bad_obs=False), meta)  # a clean batch trains again
    assert any(not torch.equal(before[k], v) for k, v in learner.agent.state_dict().items())

    learner.maybe_checkpoint(force=True)
    latest = tmp_path / "checkpoints" / "latest.pt"
    stamp = latest.stat().st_mtime_ns
    with torch.no_grad():
        next(learner.agent.parameters()).view(-1)[0] = float("nan")
    assert non_finite(learner.agent.state_dict())
    learner.maybe_checkpoint(force=True)  # refused: the checkpoint on disk stays the finite one
    assert latest.stat().st_mtime_ns == stamp
    assert not non_finite(torch.load(latest, weights_only=True))
    with pytest.raises(RuntimeError, match="not finite after update"):  # before anything is published
        learner.train(_ppo_batch(exp, bad_obs=False), meta)


# ---------------------------------------------------------------- refusals


@pytest.fixture
def hub(exp_and_example, run_id, tmp_path):  # noqa: F811
    h = Hub(*exp_and_example, run_id, tmp_path)
    yield h
    h.close()


def _sink(ctx, address, desc, timeout_ms=200, give_up_s=30.0):
    m = metrics.for_service("sampler", 9)
    return RemoteSink(ctx, address, "sampler0", 0, desc, 1, RING, timeout_ms, m, SECRET, give_up_s=give_up_s), m


def _meta(serial: int, episodes=()):
    body = segment(serial, 0, episodes)
    del body["index"]
    return body


def test_a_segment_replay_refuses_is_dropped_and_the_sampler_goes_on(hub):
    from prometheus_client import REGISTRY, generate_latest

    def count(name):
        return metric_value(generate_latest(REGISTRY).decode(), name, service="sampler", instance="9")

    refused0, dropped0 = count("rlpipe_sampler_refused_segments_total"), count("rlpipe_sampler_dropped_steps_total")
    sink, _ = _sink(hub.ctx, hub.address, hub.ring(0))
    try:
        t0 = time.monotonic()
        sink.announce(RING + 3, _meta(1))  # outside replay's ring: refused as "value"
        sink.acquire(RING + 3)
        assert time.monotonic() - t0 < 2.0, "a refusal must end the wait, not a timeout"
        assert count("rlpipe_sampler_refused_segments_total") == refused0 + 1
        assert count("rlpipe_sampler_dropped_steps_total") == dropped0 + T * B
        sink.announce(0, _meta(2, [[float("inf"), 5]]))  # replay's wire check would refuse it: never sent
        sink.acquire(0)
        assert count("rlpipe_sampler_refused_segments_total") == refused0 + 2
        sink.announce(0, _meta(3, [[10.0, 5]]))  # a good one is taken and released
        sink.announce(1, _meta(4))
        sink.acquire(0)
        sink.acquire(1)
        assert not sink.in_flight
        assert count("rlpipe_sampler_refused_segments_total") == refused0 + 2
    finally:
        sink.close()


def test_a_replay_that_never_answers_is_given_up_on_with_a_clear_error(tmp_path):
    ctx = zmq.Context()
    try:
        sink, m = _sink(ctx, f"ipc://{tmp_path}/nobody", {"name": "x"}, timeout_ms=50, give_up_s=0.6)
        sink.announce(0, _meta(1))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="released nothing for .* giving up"):
            sink.acquire(0)
        elapsed = time.monotonic() - t0
        assert 0.6 <= elapsed < 3.0, elapsed
        sink.close()
    finally:
        ctx.destroy(linger=0)


# ---------------------------------------------------------------- through the pipeline


@pytest.mark.learning
@pytest.mark.parametrize("mode", ["inf_reward", "inf_obs"])
def test_ppo_cartpole_reaches_its_target_through_an_infinite_value_once(runs, mode):
    """The default experiment, its env returning +inf (reward, or in an observation) once in
    the sampler: the env is recreated and counted, the run reaches 475, every checkpoint is finite."""
    run = runs("cartpole_ppo.toml", "env.id='tests.envs_for_tests:make_cartpole_failing_once'",
               f"env.kwargs='{{\"mode\": \"{mode}\", \"at\": 300}}'", "learner.checkpoint_interval_s=1.0")
    result = run.wait_result(240)
    assert result["reason"] == "target", result
    page = run.metrics()
    assert metric_value(page, "rlpipe_sampler_env_errors_total") == 1
    assert metric_value(page, "rlpipe_learner_skipped_steps_total") == 0  # nothing non-finite got that far
    assert metric_value(page, "rlpipe_replay_bad_messages_total") == 0
    assert "reward is inf" in run.logs("sampler0") if mode == "inf_reward" else "infinity" in run.logs("sampler0")
    checkpoints = sorted((run.dir / "checkpoints").glob("*.pt"))
    assert checkpoints
    for path in checkpoints:
        assert not non_finite(torch.load(path, weights_only=True)), path


def test_a_loss_that_is_always_nan_ends_the_run_failed_with_one_line(tmp_path):
    """PPO with a NaN value coefficient: every gradient step of every update is skipped; after
    run.max_skipped_updates such updates the run ends failed, said in one line, exit 1; progress
    rows, result.json and `rlpipe status` count the skipped updates."""
    from shared.launch import rundirs, supervisor
    from tests.pipeline import CONFIGS, rlpipe, rlpipe_here

    out = rlpipe("launch", str(CONFIGS / "cartpole_ppo.toml"), "--set", f"run.runs_dir='{tmp_path}'",
                 "--set", "network.metrics_port=0", "--set", "algo.value_coef=nan", "--set", "run.max_skipped_updates=5",
                 "--set", "run.log_interval_s=0.2")
    (run_dir,) = tmp_path.glob("cartpole_ppo_*")
    assert out.returncode == 1, out.stdout + out.stderr
    error = ("the last 5 updates (run.max_skipped_updates) learned nothing: every gradient step was skipped for a "
             "non-finite loss or gradient norm (a NaN or an infinity in the batch, the loss or the config?)")
    result = rundirs.read_result(run_dir)
    assert out.stderr.splitlines() == [f"rlpipe: run {run_dir} failed after {result['env_steps']} env steps: {error}"]
    assert result["reason"] == "failed" and result["error"] == error
    assert result["skipped_updates"] == result["updates"] == 5
    assert int(rundirs.read_progress(run_dir)[-1]["skipped_updates"]) == 5
    status = rlpipe_here("status", str(run_dir)).stdout.splitlines()
    assert status[:2] == [f"{run_dir.name}: not running; ended (failed): {error}",
                          "skipped updates: 5 of 5 learned nothing (every gradient step skipped: loss or gradient "
                          "norm not finite)"]
    killed, removed = supervisor.clean(run_dir)
    assert not killed and not removed


def test_an_action_server_that_never_welcomes_is_given_up_on_with_a_clear_error(tmp_path):
    from services.sampler.transport import RemoteActions

    ctx = zmq.Context()
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="did not welcome us in .* giving up"):
            RemoteActions(ctx, f"ipc://{tmp_path}/nobody", "sampler0", 0, [{"name": "x"}], tmp_path, 50,
                          metrics.for_service("sampler", 9), 1, SECRET, give_up_s=0.5)
        assert time.monotonic() - t0 < 3.0
    finally:
        ctx.destroy(linger=0)


def test_an_action_server_that_welcomes_but_never_acts_is_given_up_on_with_a_clear_error(tmp_path):
    """Each hello is welcomed, no ring is ever answered: that was a hello, ring, time-out loop
    without an end."""
    import threading

    from services.sampler.transport import RemoteActions
    from shared.transport.doorbell import ServerBell
    from shared.transport.sockets import Endpoint

    ctx = zmq.Context()
    address, stop = f"ipc://{tmp_path}/mute", threading.Event()
    router = Endpoint(ctx, zmq.ROUTER, address, bind=True, name="action_server0")

    def mute_server():
        bells = []
        while not stop.is_set():
            got = router.recv(50)
            if got is not None and got[1].type == "hello_actor":
                bells = bells or [ServerBell(tmp_path, "sampler0")]  # its ends of the doorbell, open for good
                router.send("welcome", {"peer": "x"}, to=got[0])
        for bell in bells:
            bell.close()

    server = threading.Thread(target=mute_server, daemon=True)
    server.start()
    try:
        actions = RemoteActions(ctx, address, "sampler0", 0, [{"name": "x"}], tmp_path, 50,
                                metrics.for_service("sampler", 9), 1, SECRET, give_up_s=0.5)
        t0 = time.monotonic()
        actions.request(0)
        with pytest.raises(RuntimeError, match="sent no actions in .* though it welcomed our hellos; giving up"):
            actions.wait(0)
        assert time.monotonic() - t0 < 3.0
        actions.close()
    finally:
        stop.set()
        server.join(5)
        router.close()
        ctx.destroy(linger=0)


def test_a_learner_that_replay_keeps_refusing_backs_off_and_gives_up(tmp_path):
    """A replay that answers every message with an error: the learner asks again with growing
    pauses, not at once, and gives up with replay's reason after MAX_REFUSALS."""
    from services.learner.transport import RemoteBatches
    from shared.transport.sockets import Endpoint

    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/replay"
    router = Endpoint(ctx, zmq.ROUTER, address, bind=True, name="replay0")
    try:
        source = RemoteBatches(ctx, address, [{"name": "x"}], 4, 1000, metrics.for_service("learner", 8), SECRET)
        source.REFUSAL_BACKOFF_S, source.MAX_REFUSALS = 0.05, 4
        source.request(0, 0)
        hellos, t0 = 0, time.monotonic()
        with pytest.raises(RuntimeError, match="refused us 4 times in a row, last: (hello_reader|sample): no"):
            while time.monotonic() - t0 < 10:
                got = router.recv(10)
                if got is not None:
                    hellos += got[1].type == "hello_reader"
                    router.reject(got[0], got[1].type, "auth", "no", seq=got[1].seq)
                source.next(10)
        assert 0.05 + 0.1 + 0.2 <= time.monotonic() - t0 < 5  # backed off: 0.05, 0.1, 0.2 s
        assert hellos <= 4
        source.close()
    finally:
        router.close()
        ctx.destroy(linger=0)
