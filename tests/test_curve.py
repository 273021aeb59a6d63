"""TCP runs speak ZeroMQ CURVE with the run's key pair: the run works, and a client
without the run's key gets nothing through (and sees nothing in clear text)."""

from __future__ import annotations

import os
import stat

import pytest
import zmq

from shared.transport import auth
from shared.config import endpoints, loading
from shared.transport import sockets
from shared.transport import wire
from shared.transport.sockets import Endpoint
from tests.pipeline import free_port


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def run_keys(tmp_path):
    auth.write_curve_keys(tmp_path)
    sockets.use_curve(auth.read_curve_keys(tmp_path))
    yield tmp_path
    sockets.use_curve(None)


def plain_dealer(ctx, address: str, server_key: bytes | None = None) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        s.curve_serverkey = server_key
        s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
    s.connect(address)
    return s


def test_keys_are_private_to_the_run_directory(run_keys):
    assert stat.S_IMODE(os.stat(run_keys / auth.CURVE_DIR).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(run_keys / auth.CURVE_DIR / "server.key_secret").st_mode) == 0o600


def test_a_client_without_the_run_key_gets_nothing_through(ctx, run_keys):
    address = f"tcp://127.0.0.1:{free_port()}"
    server = Endpoint(ctx, zmq.ROUTER, address, bind=True, name="replay0")
    client = Endpoint(ctx, zmq.DEALER, address, bind=False, name="sampler0")  # has the run's key
    client.send("release", {"index": 1})
    peer, msg = server.recv(timeout_ms=5000)
    server.send("release", {"index": 2}, to=peer)
    assert client.recv(timeout_ms=5000)[1].body == {"index": 2}
    strangers = [plain_dealer(ctx, address), plain_dealer(ctx, address, zmq.curve_keypair()[0])]
    for s in strangers:
        s.send_multipart(wire.pack("release", {"index": 3}, "x", 1))
    assert server.recv(timeout_ms=1000) is None  # neither clear text nor the wrong server key gets in
    client.send("release", {"index": 4})
    assert server.recv(timeout_ms=5000)[1].body == {"index": 4}


def test_a_tcp_run_learns_over_curve_and_a_keyless_client_gets_nothing(runs, ctx):
    base = free_port()
    run = runs("cartpole_ppo.toml", 'network.transport="tcp"', f"network.base_port={base}")
    run.wait_steps(2_000)
    exp = loading.load(run.dir / "config.toml")
    replay = endpoints.endpoint(exp, run.dir, "replay")
    stranger = plain_dealer(ctx, replay)
    stranger.send_multipart(wire.pack("hello_reader", {"slots": [{}], "incarnation": 1, "secret": "x"}, "x", 1))
    assert not stranger.poll(1000)  # not even an error: the handshake never completed
    keyed = plain_dealer(ctx, replay, auth.read_curve_keys(run.dir).server_public)
    keyed.send_multipart(wire.pack("hello_reader", {"slots": [{}], "incarnation": 1, "secret": "x"}, "x", 1))
    assert keyed.poll(5000) and "wrong run secret" in wire.unpack(keyed.recv_multipart()).body["reason"]
