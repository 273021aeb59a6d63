"""python -m services.metrics --run-dir RUN

Serves the metrics every process of the run records into PROMETHEUS_MULTIPROC_DIR
(prometheus_client's multiprocess mode) on the configured host and port. Gauges of
processes that died (a kill -9, a restart) are dropped from the live view, so `up` and the
instance counts show the processes that run now; so are the series a live process removed (a
self-play pool's version that left the pool: shared/runtime/metrics.py).
"""

import logging
import os
import re
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import mark_process_dead

from shared.runtime.process import pid_alive
from services.metrics import server as http
from services.process import serve
from shared.runtime import heartbeat
from shared.runtime.metrics import Served
from shared.runtime.runfiles import METRICS_DIR

log = logging.getLogger("services.metrics")
_PID = re.compile(r"_(\d+)\.db$")


def reap_dead(directory: Path) -> None:
    for path in directory.glob("*_live*.db"):
        m = _PID.search(path.name)
        if m is None:
            continue
        pid = int(m.group(1))
        if not pid_alive(pid):
            mark_process_dead(pid, str(directory))


def run(exp, run_dir, instance: int) -> None:
    directory = Path(os.environ.get("PROMETHEUS_MULTIPROC_DIR", run_dir / METRICS_DIR))
    registry = CollectorRegistry()
    registry.register(Served(directory))
    server = http.start(exp.network.metrics_host, exp.network.metrics_port, registry)  # connections capped
    log.info("metrics on http://%s:%d/metrics", exp.network.metrics_host, exp.network.metrics_port)
    try:
        while True:
            reap_dead(directory)
            heartbeat.sleep(1.0)
    finally:
        server.server_close()


if __name__ == "__main__":
    serve("metrics", run)
