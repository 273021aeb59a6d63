"""python -m services.replay --run-dir RUN"""

import logging

import zmq

from services.replay.service import ReplayService
from shared.runtime.runfiles import SNAPSHOT_DIR
from services.replay.tables import make_table, table_arena
from shared.runtime import metrics as metrics_mod
from shared.runtime import process as runtime
from shared.transport.auth import read_secret
from shared.config.endpoints import endpoint
from services.build import round_items
from services.process import serve
from shared.transport.sockets import Endpoint
from shared.config.topology import topology

log = logging.getLogger("services.replay")


def run(exp, run_dir, instance: int) -> None:
    m = metrics_mod.for_service("replay", instance, exp.placement.node("replay"))
    columns = topology(exp).columns()  # room for `rlpipe scale`
    ctx = zmq.Context()
    router = Endpoint(ctx, zmq.ROUTER, endpoint(exp, run_dir, "replay"), bind=True, name="replay0",
                      on_bad=metrics_mod.bad_message_counter(m))
    run_id = runtime.run_id_of(run_dir)

    def table_factory(spec):
        arena = table_arena(exp.replay, columns, spec, run_id, instance, run_dir / SNAPSHOT_DIR)
        return make_table(exp.replay, columns, spec, round_items(exp), exp.run.seed, arena)

    service = ReplayService(exp.replay, table_factory, router, m, run_id, read_secret(run_dir),
                            observation_moments=exp.model.normalize_observations, snapshot_dir=run_dir / SNAPSHOT_DIR,
                            ranks=exp.learner.count, remote_writers=exp.placement.crosses("sampler", "replay"),
                            remote_readers=exp.placement.crosses("learner", "replay"))
    m.healthy.set(1)
    log.info("replay: %s table of %d items on %s", exp.replay.table, exp.replay.storage.capacity, router.address)
    try:
        service.run()
    finally:
        service.close()
        router.close()
        ctx.term()


if __name__ == "__main__":
    serve("replay", run)
