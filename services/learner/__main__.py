"""python -m services.learner --run-dir RUN"""

import logging

import zmq

from services.learner.learner import Learner, lock_run, run_loop
from services.learner.transport import PublishedParams, RemoteBatches
from shared import metrics as metrics_mod
from shared import shm
from shared.acting import write_acting_file
from shared.agents.actor import acting_plan
from shared.auth import read_secret
from shared.config import endpoint
from shared.factory import batch_items, batch_spec, env_probe, example_step, make_agent, make_algo
from shared.params import ParamWriter
from shared.runtime import run_id_of, serve, torch_device

log = logging.getLogger("services.learner")


def run(exp, run_dir, instance: int) -> None:
    lock = lock_run(run_dir)  # noqa: F841 (held until exit): a second learner would unlink our segments
    m = metrics_mod.for_service("learner", instance)
    device = torch_device(exp.run.device)
    probe = env_probe(exp)
    agent = make_agent(exp, probe).to(device)
    algo = make_algo(exp, agent)
    learner = Learner(exp, agent, algo, device, run_dir, m)
    learner.resume()
    run_id = run_id_of(run_dir)
    spec = batch_spec(exp, example_step(exp, probe))
    probe.close()
    segments, slots, descriptors = [], [], []
    for i in range(exp.learner.prefetch):
        seg, tree, desc = shm.allocate(shm.segment_name(run_id, "learner", instance, f"batch{i}"), spec)
        segments.append(seg)
        slots.append(tree)
        descriptors.append(desc)
    writer = ParamWriter(agent, shm.segment_name(run_id, "learner", instance, "params"))
    write_acting_file(run_dir, writer.descriptor["spec"], acting_plan(agent))  # for torch-free local samplers
    learner.version = max(learner.version, writer.previous_version + 1)
    ctx = zmq.Context()
    params = PublishedParams(ctx, endpoint(exp, run_dir, "params"), writer)
    source = RemoteBatches(ctx, endpoint(exp, run_dir, "replay"), descriptors, batch_items(exp),
                           exp.learner.timeout_ms, m, read_secret(run_dir))
    m.healthy.set(1)
    log.info("learner: %s on %s, %d item(s) a batch, starting at version %d", exp.algo_name, device,
             batch_items(exp), learner.version)
    try:
        result = run_loop(learner, slots, source, params)
        log.info("run finished: %s", result)
    finally:
        source.close()
        params.close()
        for seg in segments:
            seg.unlink()
            seg.close()
        ctx.term()


if __name__ == "__main__":
    serve("learner", run)
