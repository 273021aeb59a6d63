"""python -m services.sampler --run-dir RUN --instance I"""

import logging
import time

import zmq

from services.sampler.sampler import Sampler, run_loop
from services.sampler.transport import RemoteActions, RemoteSink
from shared import metrics as metrics_mod
from shared import shm
from shared.auth import read_secret
from shared.config import endpoint, most_count, socket_dir
from shared.factory import env_probe, make_agent
from shared.runtime import run_id_of, serve, torch_device

log = logging.getLogger("services.sampler")


def local_actions(exp, sampler: Sampler, run_id: str):
    """Local inference: a copy of the agent on the CPU that follows the learner's parameter segment."""
    from services.sampler.local import LocalActions
    from shared.acting import acting_seed, seed_torch
    from shared.params import ParamFollower

    torch_device("cpu")
    agent = make_agent(exp, env_probe(exp)).eval()
    seed_torch(acting_seed(exp.run.seed, "sampler", sampler.instance))  # make_agent seeded it with run.seed
    params = ParamFollower(agent, shm.segment_name(run_id, "learner", 0, "params"), shm.Owner(run_id, "learner", 0))
    return LocalActions(agent, sampler, params, most_count(exp.sampler) * exp.sampler.envs, exp.run.seed)


def run(exp, run_dir, instance: int) -> None:
    m = metrics_mod.for_service("sampler", instance)
    ctx = zmq.Context()
    run_id = run_id_of(run_dir)
    sampler = Sampler(exp, instance, run_id, metrics=m)
    name = f"sampler{instance}"
    incarnation, secret = time.time_ns(), read_secret(run_dir)  # a restarted sampler's incarnation is newer
    actions = sink = None
    try:
        if exp.sampler.inference == "local":
            actions = local_actions(exp, sampler, run_id)
        else:
            server = instance % exp.action_server.count
            actions = RemoteActions(ctx, endpoint(exp, run_dir, f"action_server{server}"), name, instance,
                                    sampler.slot_descriptors, socket_dir(run_dir), exp.sampler.timeout_ms, m,
                                    incarnation, secret)
        sink = RemoteSink(ctx, endpoint(exp, run_dir, "replay"), name, instance, sampler.ring_descriptor,
                          incarnation, exp.sampler.ring, exp.sampler.timeout_ms, m, secret)
        m.healthy.set(1)
        log.info("sampler %d: %d envs of %s in %d group(s), T=%d, %s inference", instance, exp.sampler.envs,
                 exp.env.id, len(sampler.groups), exp.sampler.horizon, exp.sampler.inference)
        run_loop(sampler, actions, sink)
    finally:
        for part in (actions, sink):
            if part is not None:
                part.close()
        sampler.close()
        ctx.term()


if __name__ == "__main__":
    serve("sampler", run)
