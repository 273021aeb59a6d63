"""python -m services.action_server --run-dir RUN --instance I"""

import logging

import zmq

from services.action_server.server import ActionServer
from shared.runtime import metrics as metrics_mod
from shared.transport import wire
from shared.agents.actor import seed_torch
from shared.transport.auth import read_secret
from shared.config.endpoints import endpoint, socket_dir
from services.build import env_probe, example_step, make_agent
from shared.data.layout import slot_spec
from shared.data.namedarraytuple import drop_leading_dims
from shared.runtime.process import run_id_of, torch_device
from services.process import serve
from shared.transport.sockets import Endpoint
from shared.config.topology import topology

log = logging.getLogger("services.action_server")


def run(exp, run_dir, instance: int) -> None:
    m = metrics_mod.for_service("action_server", instance, exp.placement.node("action_server"))
    device = torch_device(exp.run.device)
    probe = env_probe(exp)
    agent = make_agent(exp, probe).to(device).eval()
    topo = topology(exp)
    seed = topo.acting_seed("action_server", instance)
    seed_torch(seed)  # make_agent seeded it with run.seed
    slot_item_spec = drop_leading_dims(slot_spec(example_step(exp, probe), 1), 1)
    ctx = zmq.Context()
    bad = metrics_mod.bad_message_counter(m)
    router = Endpoint(ctx, zmq.ROUTER, endpoint(exp, run_dir, f"action_server{instance}"), bind=True,
                      name=f"action_server{instance}", on_bad=bad)
    frames = exp.placement.crosses("action_server", "learner")  # parameters as frames, not in shared memory
    params = Endpoint(ctx, zmq.SUB, endpoint(exp, run_dir, "params"), bind=False, name=f"action_server{instance}",
                      on_bad=bad, subscribe=wire.topic("params_data" if frames else "params"))
    server = ActionServer(exp.action_server, agent, router, params, m, socket_dir(run_dir), run_id_of(run_dir),
                          read_secret(run_dir), slot_item_spec, exp.sampler.envs, topo.total_envs,
                          seed, frames)
    m.healthy.set(1)
    log.info("action-server %d on %s, device %s", instance, router.address, device)
    if exp.sampler.inference != "server":
        log.warning("sampler.inference = %s: no sampler will use this action-server", exp.sampler.inference)
    try:
        server.run()
    finally:
        server.close()  # and its parameter reader with the params endpoint
        router.close()
        ctx.term()


if __name__ == "__main__":
    serve("action_server", run)
