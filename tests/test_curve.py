"""TCP runs speak ZeroMQ CURVE with the run's keys: the run works; a client without the run's
client key gets nothing through, even with the server's public key (it sees nothing in clear
text); idle connections do not take a service's file descriptors."""

from __future__ import annotations

import os
import resource
import selectors
import socket
import stat
import time

import pytest
import zmq

from shared.runtime import runfiles
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
    sockets.use_curve(auth.read_curve_keys(tmp_path, server=True))
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


def test_keys_are_private_to_the_run_directory_and_clients_hold_no_server_secret(run_keys):
    keys = run_keys / runfiles.CURVE_DIR
    for path in (keys, keys / runfiles.CLIENTS_DIR):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    for path in (keys / "server.key_secret", keys / runfiles.CLIENTS_DIR / "client.key_secret"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    client = auth.read_curve_keys(run_keys, server=False)
    assert client.server_secret is None and client.clients_dir is None
    assert client.server_public == auth.read_curve_keys(run_keys, server=True).server_public


def test_a_client_without_the_run_key_gets_nothing_through(ctx, run_keys):
    address = f"tcp://127.0.0.1:{free_port()}"
    server = Endpoint(ctx, zmq.ROUTER, address, bind=True, name="replay0")
    client = Endpoint(ctx, zmq.DEALER, address, bind=False, name="sampler0")  # has the run's key
    client.send("release", {"index": 1})
    peer, msg = server.recv(timeout_ms=5000)
    server.send("release", {"index": 2}, to=peer)
    assert client.recv(timeout_ms=5000)[1].body == {"index": 2}
    server_public = auth.read_curve_keys(run_keys, server=False).server_public
    strangers = [plain_dealer(ctx, address), plain_dealer(ctx, address, zmq.curve_keypair()[0]),
                 plain_dealer(ctx, address, server_public)]  # the server's public key is no password
    for s in strangers:
        s.send_multipart(wire.pack("release", {"index": 3}, "x", 1))
    assert server.recv(timeout_ms=1000) is None  # neither clear text, the wrong server key nor a foreign client key
    server.send("release", {"index": 5}, to=peer)
    client.send("release", {"index": 4})
    assert server.recv(timeout_ms=5000)[1].body == {"index": 4}
    assert client.recv(timeout_ms=5000)[1].body == {"index": 5}
    assert not any(s.poll(200) for s in strangers)
    client.close()
    server.close()
    assert not sockets._zap  # the ZAP handler ended with the context's last server socket


def test_a_publisher_serves_no_subscriber_without_a_run_client_key(ctx, run_keys):
    address = f"tcp://127.0.0.1:{free_port()}"
    pub = Endpoint(ctx, zmq.PUB, address, bind=True, name="learner0")
    sub = Endpoint(ctx, zmq.SUB, address, bind=False, name="sampler0")
    stranger = ctx.socket(zmq.SUB)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.setsockopt(zmq.SUBSCRIBE, b"")
    stranger.curve_serverkey = auth.read_curve_keys(run_keys, server=False).server_public
    stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
    stranger.connect(address)
    deadline = time.monotonic() + 5
    got = None
    while got is None and time.monotonic() < deadline:  # a SUB joins some time after its connect
        pub.send("params", {"version": 1, "segment": {}, "env_steps": 0})
        got = sub.recv(timeout_ms=100)
    assert got is not None and got[1].type == "params"
    for _ in range(5):
        pub.send("params", {"version": 2, "segment": {}, "env_steps": 0})
    assert not stranger.poll(500)
    stranger.close()
    sub.close()
    pub.close()


def open_idle(port: int, count: int) -> list[socket.socket]:
    """``count`` TCP connections to ``port`` that never send a byte."""
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]


def wait_closed_by_peer(conns: list[socket.socket], timeout: float) -> int:
    """Read each connection (the server's greeting) until the peer closes it, for at most
    ``timeout`` s; how many are still open then."""
    sel = selectors.DefaultSelector()
    for c in conns:
        c.setblocking(False)
        sel.register(c, selectors.EVENT_READ)
    open_ = len(conns)
    deadline = time.monotonic() + timeout
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            try:
                data = key.fileobj.recv(4096)
            except ConnectionError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                open_ -= 1
    sel.close()
    return open_


def open_files_limit(pid: int) -> tuple[int, int]:
    for line in open(f"/proc/{pid}/limits"):
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open-files limit for {pid}")


IDLE_CONNECTIONS = 1100  # more than the usual soft limit of 1024 file descriptors


def test_a_tcp_run_learns_over_curve_and_a_keyless_client_gets_nothing(runs, ctx):
    """Also: 1100 idle connections cost no service a file descriptor it needs (services raise
    their open-files limit to the hard one; each idle connection is dropped after the handshake
    timeout), and what the run writes is private to its user."""
    base = free_port()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < IDLE_CONNECTIONS + 200:
        pytest.skip(f"the hard open-files limit ({hard}) is below {IDLE_CONNECTIONS + 200}: raise it (ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, soft), hard))  # the services start with a usual soft limit
    try:
        run = runs("cartpole_ppo.toml", 'network.transport="tcp"', f"network.base_port={base}",
                   "learner.checkpoint_interval_s=1", "run.target_return=1e9", "run.max_wall_s=90")  # runs on until stopped
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, IDLE_CONNECTIONS + 200), hard))
    run.wait_steps(2_000)
    pids = {name: run.pid(name) for name in ("replay0", "learner0", "sampler0")}
    for name, pid in pids.items():
        assert open_files_limit(pid)[0] == open_files_limit(pid)[1], name
    exp = loading.load(run.dir / "config.toml")
    replay = endpoints.endpoint(exp, run.dir, "replay")
    stranger = plain_dealer(ctx, replay)
    stranger.send_multipart(wire.pack("hello_reader", {"slots": [{}], "incarnation": 1, "secret": "x"}, "x", 1))
    server_public = auth.read_curve_keys(run.dir, server=False).server_public
    keyed = plain_dealer(ctx, replay, server_public)  # the server's public key, a key pair of its own
    keyed.send_multipart(wire.pack("hello_reader", {"slots": [{}], "incarnation": 1, "secret": "x"}, "x", 1))
    listener = ctx.socket(zmq.SUB)
    listener.setsockopt(zmq.LINGER, 0)
    listener.setsockopt(zmq.SUBSCRIBE, b"")
    listener.curve_serverkey = server_public
    listener.curve_publickey, listener.curve_secretkey = zmq.curve_keypair()
    listener.connect(endpoints.endpoint(exp, run.dir, "params"))
    sockets.use_curve(auth.read_curve_keys(run.dir, server=False))
    try:
        member = Endpoint(ctx, zmq.DEALER, replay, bind=False, name="x")  # the run's client key, not its secret
    finally:
        sockets.use_curve(None)
    member.send("hello_reader", {"slots": [{}], "incarnation": 1, "secret": "x"})
    reply = member.recv(timeout_ms=5000)
    assert reply is not None and "wrong run secret" in reply[1].body["reason"]  # admitted, then refused by the hello
    member.close()
    # Not even an error: the handshake never completed (ZAP refused the client key); no parameters either.
    assert not stranger.poll(100) and not keyed.poll(100) and not listener.poll(100)

    started = time.monotonic()
    idle = open_idle(base, IDLE_CONNECTIONS)  # to replay
    steps = max(int(r["env_steps"]) for r in run.progress())
    run.wait_steps(steps + 1_000, timeout=20)  # the run goes on while they are held
    assert wait_closed_by_peer(idle, sockets.HANDSHAKE_IVL_MS / 1000 + 10) == 0  # replay dropped every one
    assert time.monotonic() - started < sockets.HANDSHAKE_IVL_MS / 1000 + 10
    for c in idle:
        c.close()
    steps = max(int(r["env_steps"]) for r in run.progress())
    run.wait_steps(steps + 1_000, timeout=20)
    assert {name: run.pid(name) for name in pids} == pids, "a service restarted"
    assert "Too many open files" not in run.logs()
    assert not stranger.poll(0) and not keyed.poll(0) and not listener.poll(0)
    for s in (stranger, keyed, listener):
        s.close()

    # Private: every directory of the run, and what the services and supervisord write (the
    # files the launcher writes later, such as supervisord.conf, lie in the 0700 run directory).
    assert list((run.dir / "checkpoints").glob("*.pt")), "no checkpoint written"
    written = [run.dir / "progress.csv", *(run.dir / "checkpoints").iterdir(), *(run.dir / "logs").iterdir(),
               *(run.dir / "metrics").iterdir()]
    for path in [p for p in [run.dir, *run.dir.rglob("*")] if p.is_dir()] + written:
        assert stat.S_IMODE(os.lstat(path).st_mode) & 0o077 == 0, f"{path} is readable by other users"


def test_a_process_without_the_server_key_binds_no_tcp_socket(ctx, tmp_path):
    auth.write_curve_keys(tmp_path)
    sockets.use_curve(auth.read_curve_keys(tmp_path, server=False))
    try:
        with pytest.raises(RuntimeError, match="holds no CURVE server key"):
            Endpoint(ctx, zmq.ROUTER, f"tcp://127.0.0.1:{free_port()}", bind=True, name="sampler0")
    finally:
        sockets.use_curve(None)
    assert not sockets._zap
