"""The metrics endpoint's HTTP server: it serves scrapes, and idle connections neither pile up
threads without bound nor keep it from answering once they time out."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from services.metrics import server as http
from tests.pipeline import free_port


def test_connections_beyond_the_cap_are_closed_and_idle_ones_time_out(monkeypatch):
    monkeypatch.setattr(http._Handler, "timeout", 2.0)
    registry = CollectorRegistry()
    Counter("rlpipe_test_things_total", "things", registry=registry).inc(3)
    port = free_port()
    server = http.start("127.0.0.1", port, registry, max_connections=2)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        assert "rlpipe_test_things_total 3.0" in urllib.request.urlopen(url, timeout=5).read().decode()
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        deadline = time.monotonic() + 5
        while server.active < 2:  # both accepted, each holding its thread
            assert time.monotonic() < deadline
            time.sleep(0.01)
        extra = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
        for s in extra:
            assert s.recv(1) == b""  # closed at once: no thread for it
        assert server.refused == 20 and server.active == 2
        for s in idle:
            assert s.recv(1) == b""  # dropped by the connection timeout (2 s here)
        assert "rlpipe_test_things_total 3.0" in urllib.request.urlopen(url, timeout=5).read().decode()
        for s in idle + extra:
            s.close()
    finally:
        server.shutdown()
        server.server_close()
    # The serving thread is gone: closing the socket alone had left it spinning on it.
    assert not [t for t in threading.enumerate() if t.name == "metrics-http"]
