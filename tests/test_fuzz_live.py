"""A protocol-aware fuzz of a live DQN run: thousands of messages with valid envelopes and
hostile values (every message type, extreme ints, NaN/inf, wrong list lengths, bogus and
foreign descriptors, a symlinked segment, mismatched array frames, other peers' names as
routing ids) at every bound endpoint. No service may crash or restart, every rejection is
counted by reason, and the run still reaches its target."""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from shared.transport import auth
from shared.config import endpoints as config
from shared.transport import wire
from tests.pipeline import metric_value

pytestmark = pytest.mark.learning

MESSAGES = 3000  # per ROUTER endpoint
INTS = [0, 1, -1, 3, 2**31, 2**53 + 1, 2**62, 2**63 - 1, -2**63, 2**64 - 1]
FLOATS = [0.0, -0.0, 1e308, -1e308, math.nan, math.inf, -math.inf, 5e-324]
IDENTITIES = [None, b"sampler0", b"sampler1", b"learner0", b"replay0", b"action_server0"]


def descriptors(run_id: str, decoy: str) -> list:
    """Bogus and foreign shared-memory descriptors (none names a segment with its real spec)."""
    leaf = {"dtype": "<f4", "shape": [4]}
    return [
        {}, {"name": None}, {"name": 7, "spec": leaf}, {"name": "x", "spec": leaf},
        {"name": f"rlpipe-{run_id}-sampler0-ring", "spec": None, "nonce": 1},
        {"name": f"rlpipe-{run_id}-sampler0-ring", "spec": leaf, "nonce": 2**64 - 1},  # real name, wrong size
        {"name": f"rlpipe-{run_id}-sampler0-slot0", "spec": {"type": "StepSlot", "fields": []}},
        {"name": f"rlpipe-{run_id}-learner0-params", "spec": {"dtype": "<f8", "shape": [2**40, 2**40]}},
        {"name": f"rlpipe-{run_id}-learner0-batch0", "spec": {"dtype": "(2,)<f8", "shape": [1]}},
        {"name": f"rlpipe-{run_id}-learner0-batch0", "spec": {"dtype": "<f4", "shape": [1] * 12}},
        {"name": "rlpipe-other-sampler0-ring", "spec": leaf},  # another run's
        {"name": "rlpipe-../../etc-passwd", "spec": leaf},
        {"name": decoy, "spec": leaf, "nonce": 1},  # a symlink named like sampler 0's segment
        {"name": f"rlpipe-{run_id}-sampler0-ring", "spec": {"type": "A", "fields": [["a", {"dtype": "<f4"}]]}},
    ]


def hostile_value(rng: random.Random, name: str, types: tuple, run_id: str, secret: str, descs: list):
    t = types[0]
    if rng.random() < 0.05:
        return rng.choice([None, "x", 1.5, [], {}, True])  # the wrong type now and then
    if t is int:
        return rng.choice(INTS + [rng.randrange(0, 40)])
    if t is str:
        return secret if name == "secret" and rng.random() < 0.7 else rng.choice(["", "guess", "é" * 50, "x" * 5000])
    if t is dict:
        return rng.choice(descs)
    n = rng.choice([0, 1, 2, 3, 100, 1000])
    return rng.choice([
        [rng.choice(descs) for _ in range(min(n, 20))],
        [[rng.choice(FLOATS + INTS), rng.choice(INTS)] for _ in range(n)],  # episodes
        [[1e308, 5]] * 100,
        [rng.choice(INTS) for _ in range(n)],
        [rng.choice(FLOATS) for _ in range(n)],
        [[1.0], [1.0, 2, 3], "x", None][: rng.randrange(1, 5)],
    ])


def hostile_frames(rng: random.Random, run_id: str, secret: str, descs: list) -> list[bytes]:
    mtype = rng.choice(sorted(wire.SCHEMAS))
    body = {name: hostile_value(rng, name, types, run_id, secret, descs)
            for name, types in wire.SCHEMAS[mtype].items() if rng.random() > 0.02}
    if mtype == "priorities" and rng.random() < 0.5:  # equal lengths, hostile elements
        n = rng.choice([1, 5])
        body.update(keys=[rng.choice(INTS) for _ in range(n)], generations=[rng.choice(INTS) for _ in range(n)],
                    priorities=[rng.choice(FLOATS) for _ in range(n)])
    header = {"v": wire.PROTOCOL_VERSION, "type": mtype, "from": rng.choice(["sampler0", "learner0", "", "é"]),
              "seq": rng.choice(INTS[:8]), "body": body, "arrays": []}
    roll = rng.random()
    if roll < 0.1:  # array frames that do not match their specs
        header["arrays"] = [rng.choice([{"dtype": "(2,)<f8", "shape": [1]}, {"dtype": "<f8", "shape": [3]},
                                        {"dtype": "|O", "shape": [1]}, {"dtype": "<f8", "shape": [2**62, 4]}])]
        return [msgpack.packb(header), b"\0" * rng.choice([0, 16, 24])]
    if roll < 0.15:
        return [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))]
    return [msgpack.packb(header)]


def fuzz_router(ctx: zmq.Context, address: str, rng: random.Random, run_id: str, secret: str, descs: list) -> int:
    socks = []
    for identity in IDENTITIES:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, 5000)
        if identity is not None:
            s.setsockopt(zmq.IDENTITY, identity)
        s.connect(address)
        socks.append(s)
    for i in range(MESSAGES):
        s = socks[i % len(socks)]
        s.send_multipart(hostile_frames(rng, run_id, secret, descs))
        while s.poll(0):
            s.recv_multipart()  # error replies
        if i % 200 == 199:
            time.sleep(0.05)  # let the real samplers through too
    for s in socks:
        # What a socket still queues is sent after close: with linger 0 it was dropped, and on a
        # loaded machine that is hundreds of messages the service then never counts.
        s.close(linger=60_000)
    return MESSAGES


def fuzz_params(ctx: zmq.Context, address: str, rng: random.Random) -> None:
    """The learner's PUB from a subscriber's side: subscription frames and garbage."""
    s = ctx.socket(zmq.XSUB)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    for _ in range(500):
        s.send(rng.choice([b"\x01", b"\x00", b"\x01" + bytes(rng.randrange(256) for _ in range(30)), b"",
                           bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))]))
    s.close(linger=0)


def wait_counting(run, name: str, n: int, stall_s: float = 20.0) -> None:
    """Wait until counter ``name`` reaches ``n`` for as long as it keeps rising: a loaded machine
    works through the queued messages slowly, a service that stopped handling them is stuck."""
    last, rose = -1.0, time.monotonic()
    while (value := metric_value(run.metrics(), name)) < n:
        if value > last:
            last, rose = value, time.monotonic()
        elif time.monotonic() - rose > stall_s:
            raise AssertionError(f"{name} stuck at {value:.0f} of {n} for {stall_s:.0f} s\n{run.logs(tail=3000)}")
        time.sleep(0.25)


def test_fuzzing_every_endpoint_of_a_live_dqn_run_crashes_nothing(runs, tmp_path):
    # Server inference: the action-server is one of the endpoints. 475 is test_pipeline_dqn's; here: still
    # learning, at half the config's batch (the updates per env step kept): a cheaper learner, 200 sooner.
    run = runs("cartpole_dqn.toml", "run.target_return=200.0", "sampler.inference=server", "algo.batch_size=128",
               "replay.samples_per_insert=32")
    run.wait_steps(2_000)
    before = run.status()
    sockets = config.socket_dir(run.dir)
    decoy_target = tmp_path / "precious"
    decoy_target.write_bytes(b"untouched")
    decoy = Path("/dev/shm") / f"rlpipe-{run.id}-sampler0-decoy"
    decoy.symlink_to(decoy_target)
    rng = random.Random(7)
    ctx = zmq.Context()
    t0 = time.monotonic()
    try:
        descs = descriptors(run.id, decoy.name)
        secret = auth.read_secret(run.dir)
        sent = {"replay": fuzz_router(ctx, f"ipc://{sockets / 'replay'}", rng, run.id, secret, descs),
                "action_server": fuzz_router(ctx, f"ipc://{sockets / 'action_server0'}", rng, run.id, secret, descs)}
        fuzz_params(ctx, f"ipc://{sockets / 'params'}", rng)
    finally:
        ctx.destroy(linger=0)
        decoy.unlink()
    fuzz_s = time.monotonic() - t0
    assert decoy_target.read_bytes() == b"untouched"
    for service, n in sent.items():
        name = f"rlpipe_{service}_bad_messages_total"
        wait_counting(run, name, n)
    page = run.metrics()

    def rejected(reason: str) -> float:  # every reason's counter exists from the start, at 0
        return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                   if line.startswith("rlpipe_") and "_bad_messages_total{" in line and f'reason="{reason}"' in line)

    for reason in ("wire", "auth", "descriptor", "state"):
        assert rejected(reason) > 0, reason
    assert rejected("internal") == 0, "a handler raised something it did not check for (see the logs)"
    assert run.status() == before, "a service crashed or restarted"
    result = run.wait_result(300)  # (the learner exits when it is reached: check the pids before)
    assert result["reason"] == "target" and result["mean_return"] >= 200, result
    print(f"fuzz: {sum(sent.values())} messages in {fuzz_s:.1f} s")
