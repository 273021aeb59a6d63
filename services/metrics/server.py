"""The metrics endpoint's HTTP server: prometheus_client's WSGI app, with a bound on the
connections served at once and on how long one may take.

prometheus_client's own ``start_http_server`` starts one thread per connection with no cap
and no timeout, so idle connections to the port hold threads (and memory) without bound.
Here a connection beyond ``MAX_CONNECTIONS`` is closed at once (counted in ``refused``), and
one that sends nothing for ``CONNECTION_TIMEOUT_S`` is dropped.
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

MAX_CONNECTIONS = 16  # a Prometheus server or two, a person's curl, and room to spare
CONNECTION_TIMEOUT_S = 10.0


class _Handler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT_S  # socketserver.StreamRequestHandler sets it on the connection

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass  # one line per scrape in the service's log is noise


class BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``max_connections`` of them at once."""

    daemon_threads = True  # the process exits without joining a slow client's thread
    request_queue_size = 128  # listen backlog: connections beyond the cap are accepted to be closed, not left waiting

    def __init__(self, address: tuple[str, int], family: int, max_connections: int):
        self.address_family = family
        self.max_connections, self.active, self.refused = max_connections, 0, 0
        self._lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request, client_address):
        with self._lock:
            full = self.active >= self.max_connections
            self.refused += full
            self.active += not full
        if full:
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done()

    def _done(self) -> None:
        with self._lock:
            self.active -= 1


def start(host: str, port: int, registry: CollectorRegistry, max_connections: int = MAX_CONNECTIONS) -> BoundedServer:
    """Serve ``registry`` on ``host:port`` (IPv4 or IPv6) from a daemon thread; the server.
    ``shutdown()`` ends the thread (at its next poll, within 0.5 s), then ``server_close()``
    the socket: the socket closed alone leaves the thread spinning on it, a core's worth of CPU
    for as long as the process lives (the metrics service closes it as it exits)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server = BoundedServer((sockaddr[0], port), family, max_connections)
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
