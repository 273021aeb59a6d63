"""python -m services.learner --run-dir RUN"""

import logging

import zmq

from services.learner.learner import Learner, run_loop
from services.learner.transport import PublishedParams, RemoteBatches
from shared import metrics as metrics_mod
from shared import shm
from shared.config import endpoint
from shared.factory import env_probe, make_agent, make_algo
from shared.layout import segment_spec, step_example
from shared.params import ParamWriter
from shared.runtime import resolve_device, run_id_of, start_service

log = logging.getLogger("services.learner")


def run(exp, run_dir, instance: int) -> None:
    m = metrics_mod.for_service("learner", instance)
    device = resolve_device(exp.run.device)
    probe = env_probe(exp)
    agent = make_agent(exp, probe).to(device)
    algo = make_algo(exp, agent)
    learner = Learner(exp, agent, algo, device, run_dir, m)
    learner.resume()
    run_id = run_id_of(run_dir)
    example = step_example(probe.example_observation(), probe.example_action(), agent.example_info())
    probe.close()
    spec = segment_spec(example, exp.sampler.horizon, exp.sampler.envs * exp.learner.batch_segments)
    segments, slots, descriptors = [], [], []
    for i in range(exp.learner.prefetch):
        seg, tree, desc = shm.allocate(shm.segment_name(run_id, "learner", instance, f"batch{i}"), spec)
        segments.append(seg)
        slots.append(tree)
        descriptors.append(desc)
    writer = ParamWriter(agent, shm.segment_name(run_id, "learner", instance, "params"))
    learner.version = max(learner.version, writer.previous_version + 1)
    ctx = zmq.Context()
    params = PublishedParams(ctx, endpoint(exp, run_dir, "params"), writer)
    source = RemoteBatches(ctx, endpoint(exp, run_dir, "replay"), descriptors, exp.learner.batch_segments,
                           exp.learner.timeout_ms, m)
    m.healthy.set(1)
    log.info("learner: %s on %s, batch %d x %d, starting at version %d", exp.algo_name, device, exp.sampler.horizon,
             exp.sampler.envs * exp.learner.batch_segments, learner.version)
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
    run(*start_service("learner"))
