"""The metrics endpoint's HTTP server: connections held open without a request cannot keep a
scrape from its answer; requests served at once are capped, and stalled ones time out."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from services.metrics import server as http
from tests.pipeline import free_port

SCRAPE = b"GET /metrics HTTP/1.0\r\n\r\n"


@pytest.fixture
def serve():
    """``serve(max_connections)``: a server of one counter on 127.0.0.1; (it, its url). Shut down after the test."""
    started = []

    def start(max_connections: int = http.MAX_CONNECTIONS):
        registry = CollectorRegistry()
        Counter("rlpipe_test_things_total", "things", registry=registry).inc(3)
        port = free_port()
        started.append(http.start("127.0.0.1", port, registry, max_connections=max_connections))
        return started[-1], f"http://127.0.0.1:{port}/metrics"

    yield start
    for server in started:
        server.server_close()
    # The serving thread is gone: ended by server_close at once.
    assert not [t for t in threading.enumerate() if t.name == "metrics-http"]


def until(predicate, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def scraped(url: str) -> bool:
    return "rlpipe_test_things_total 3.0" in urllib.request.urlopen(url, timeout=5).read().decode()


def connect(url: str, n: int) -> list[socket.socket]:
    port = int(url.split(":")[2].split("/")[0])
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]


def test_fifty_idle_connections_held_open_do_not_keep_a_scrape_from_its_answer(serve, monkeypatch):
    monkeypatch.setattr(http, "IDLE_TIMEOUT_S", 3.0)
    server, url = serve()
    idle = connect(url, 50)
    until(lambda: len(server.waiting) == 50, "the 50 idle connections to be accepted")
    assert scraped(url) and server.dropped == 0  # answered while all 50 were held open
    for s in idle:
        assert s.recv(1) == b""  # closed by the server after 3 s without a request
        s.close()
    assert server.dropped == 50 and server.waiting == {} and server.active == 0


def test_past_the_idle_cap_the_oldest_waiting_connection_is_closed(serve, monkeypatch):
    monkeypatch.setattr(http, "MAX_IDLE", 3)
    server, url = serve()
    idle = connect(url, 5)
    until(lambda: server.dropped == 2, "the two oldest to be closed")
    assert idle[0].recv(1) == idle[1].recv(1) == b"" and len(server.waiting) == 3
    assert scraped(url)
    for s in idle:
        s.close()


def test_requests_beyond_the_cap_are_closed_and_stalled_ones_time_out(serve, monkeypatch):
    monkeypatch.setattr(http._Handler, "timeout", 1.0)
    server, url = serve(max_connections=2)
    stalled = connect(url, 2)
    for s in stalled:
        s.sendall(b"GET /metrics HTTP/1.0\r\n")  # a request begun and never finished: a thread each
    until(lambda: server.active == 2, "both stalled requests to hold their threads")
    [extra] = connect(url, 1)
    extra.sendall(SCRAPE)
    assert extra.recv(1) == b"" and server.refused == 1  # closed at once: no thread for it
    for s in stalled:
        assert s.recv(1) == b""  # dropped by the request timeout (1 s here)
        s.close()
    extra.close()
    until(lambda: server.active == 0, "the stalled threads to end")
    assert scraped(url)
