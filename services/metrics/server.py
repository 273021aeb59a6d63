"""The metrics endpoint's HTTP server: prometheus_client's WSGI app, so that connections held
open without a request cannot keep a scrape from being answered.

prometheus_client's own ``start_http_server`` starts one thread per connection with no cap
and no timeout, so idle connections to the port hold threads (and memory) without bound; a
cap on those threads alone lets a few held-open connections take every one of them. Here a
connection gets no thread until its request begins to arrive: until then it waits in the
serving thread's selector (a file descriptor, no more), at most ``MAX_IDLE`` of them (beyond,
the oldest is closed) and each for ``IDLE_TIMEOUT_S``. A scrape, which sends its request as
it connects, is handed to a thread at once. At most ``max_connections`` requests are served
at once (one beyond is closed, counted in ``refused``), each socket operation of one within
``REQUEST_TIMEOUT_S``.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

MAX_CONNECTIONS = 16  # requests served at once: a Prometheus server or two, a person's curl, and room to spare
MAX_IDLE = 256  # connections waiting for their request: well under the 1024 files a process may open by default
IDLE_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 5.0
STOP_WAIT_S = 5.0  # the longest ``shutdown`` waits for the serving thread (it wakes at once)


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S  # socketserver.StreamRequestHandler sets it on the connection

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass  # one line per scrape in the service's log is noise


class BoundedServer(ThreadingMixIn, WSGIServer):
    """Connections wait in the serving thread until their request arrives; then a thread
    each, at most ``max_connections`` of them at once."""

    daemon_threads = True  # the process exits without joining a slow client's thread
    request_queue_size = 128  # listen backlog; the serving thread accepts at once whatever comes

    def __init__(self, address: tuple[str, int], family: int, max_connections: int):
        self.address_family = family
        self.max_connections, self.active, self.refused, self.dropped = max_connections, 0, 0, 0
        self.waiting: dict[socket.socket, tuple[object, float]] = {}  # connection -> (address, deadline), oldest first
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stopped = threading.Event()  # set while serve_forever is not running
        self._stopped.set()
        self._wake_r, self._wake_w = socket.socketpair()
        super().__init__(address, _Handler)
        self.socket.setblocking(False)  # accept() after a readiness that a client's reset withdrew: no wait

    def serve_forever(self) -> None:
        """Serve until ``shutdown``, which wakes it: no polling."""
        self._stopped.clear()
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self.socket, selectors.EVENT_READ)
                sel.register(self._wake_r, selectors.EVENT_READ)
                while not self._stop.is_set():
                    first = next(iter(self.waiting.values()), None)
                    timeout = None if first is None else max(first[1] - time.monotonic(), 0.0)
                    for key, _ in sel.select(timeout):
                        conn = key.fileobj
                        if conn is self.socket:
                            self._accept(sel)
                        elif conn in self.waiting:  # not the wake-up, nor one closed by an accept of this turn
                            sel.unregister(conn)
                            self._dispatch(conn, self.waiting.pop(conn)[0])
                    self._expire(sel, time.monotonic())
        finally:
            for conn in self.waiting:
                conn.close()
            self.waiting.clear()
            self._stopped.set()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            conn, address = self.socket.accept()
        except OSError:  # gone before we took it, or out of file descriptors: the next turn tries again
            return
        if len(self.waiting) >= MAX_IDLE:
            oldest = next(iter(self.waiting))
            sel.unregister(oldest)
            del self.waiting[oldest]
            self.dropped += 1
            oldest.close()
        self.waiting[conn] = (address, time.monotonic() + IDLE_TIMEOUT_S)
        sel.register(conn, selectors.EVENT_READ)

    def _expire(self, sel: selectors.BaseSelector, now: float) -> None:
        """Close the connections that sent nothing within ``IDLE_TIMEOUT_S``."""
        while self.waiting:
            conn, (_, deadline) = next(iter(self.waiting.items()))
            if deadline > now:
                return
            sel.unregister(conn)
            del self.waiting[conn]
            self.dropped += 1
            conn.close()

    def _dispatch(self, conn: socket.socket, address) -> None:
        """A thread for ``conn``, whose request is arriving, or its close if all are busy."""
        with self._lock:
            full = self.active >= self.max_connections
            self.refused += full
            self.active += not full
        if full:
            self.shutdown_request(conn)
            return
        try:
            self.process_request(conn, address)
        except BaseException:
            self._done()
            self.shutdown_request(conn)
            raise

    def handle_error(self, request, client_address) -> None:
        pass  # a client that stalled past the timeout or went away: socketserver would print its traceback

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done()

    def _done(self) -> None:
        with self._lock:
            self.active -= 1

    def shutdown(self) -> None:
        """End ``serve_forever`` (at once: it is woken), closing the connections still waiting."""
        self._stop.set()
        self._wake_w.send(b"\0")
        self._stopped.wait(STOP_WAIT_S)

    def server_close(self) -> None:
        """``shutdown``, then close the listening socket."""
        self.shutdown()
        super().server_close()
        self._wake_r.close()
        self._wake_w.close()


def start(host: str, port: int, registry: CollectorRegistry, max_connections: int = MAX_CONNECTIONS) -> BoundedServer:
    """Serve ``registry`` on ``host:port`` (IPv4 or IPv6) from a daemon thread; the server.
    ``server_close()`` ends the thread (at once) and closes the socket."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server = BoundedServer((sockaddr[0], port), family, max_connections)
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
