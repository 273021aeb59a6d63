"""python -m services.sampler --run-dir RUN --instance I"""

import logging
import time

import zmq

from services.sampler.sampler import Sampler, run_loop
from services.sampler.transport import RemoteActions, RemoteSink
from shared import metrics as metrics_mod
from shared.auth import read_secret
from shared.factory import env_probe, make_agent
from shared.config import endpoint
from shared.runtime import start_service, run_id_of

log = logging.getLogger("services.sampler")


def run(exp, run_dir, instance: int) -> None:
    m = metrics_mod.for_service("sampler", instance)
    ctx = zmq.Context()
    sampler = Sampler(exp, instance, run_id_of(run_dir), make_agent(exp, env_probe(exp)).example_info(), metrics=m)
    name = f"sampler{instance}"
    incarnation, secret = time.time_ns(), read_secret(run_dir)  # a restarted sampler's incarnation is newer
    actions = sink = None
    try:
        server = instance % exp.action_server.count
        actions = RemoteActions(ctx, endpoint(exp, run_dir, f"action_server{server}"), name, instance,
                                sampler.slot_descriptors, exp.sampler.timeout_ms, m, incarnation, secret)
        sink = RemoteSink(ctx, endpoint(exp, run_dir, "replay"), name, instance, sampler.ring_descriptor,
                          incarnation, exp.sampler.ring, exp.sampler.timeout_ms, m, secret)
        m.healthy.set(1)
        log.info("sampler %d: %d envs of %s in %d group(s), T=%d", instance, exp.sampler.envs, exp.env.id,
                 len(sampler.groups), exp.sampler.horizon)
        run_loop(sampler, actions, sink)
    finally:
        for part in (actions, sink):
            if part is not None:
                part.close()
        sampler.close()
        ctx.term()


if __name__ == "__main__":
    run(*start_service("sampler"))
