"""python -m services.learner --run-dir RUN --instance RANK"""

import contextlib
import logging

import zmq

from services.learner.learner import Learner, run_loop
from services.learner.transport import PublishedParams, RemoteBatches, Unpublished
from shared.runtime import heartbeat
from shared.runtime import metrics as metrics_mod
from shared.transport import ranks
from shared.transport import shm
from shared.agents.acting import write_acting_file
from shared.agents.actor import acting_plan
from shared.transport.auth import read_secret
from shared.config.endpoints import endpoint, socket_dir
from services.build import batch_items, batch_spec, env_probe, example_step, make_agent, make_algo
from shared.transport.params import ParamWriter
from shared.runtime.process import run_id_of, torch_device
from services.process import serve

log = logging.getLogger("services.learner")
JOIN_TIMEOUT_S = 120.0
"""How long a rank waits for the rest of its group (their start-up, a restart of them all)."""


def start_publishing(ctx: zmq.Context, exp, run_dir, agent, version: int, env_steps: int) -> tuple[PublishedParams, int]:
    """Rank 0's parameters: its segment, its PUB socket bound, ``agent``'s first version published
    (numbered on past the segment's previous one), then ``acting.json``, which the samplers
    wait for; (the publisher, the version)."""
    writer = ParamWriter(agent, shm.segment_name(run_id_of(run_dir), "learner", 0, "params"))
    try:
        version = max(version, writer.previous_version + 1)
        consumer = "action_server" if exp.sampler.inference == "server" else "sampler"
        params = PublishedParams(ctx, endpoint(exp, run_dir, "params"), writer,
                                 frames=exp.placement.crosses(consumer, "learner"))
    except BaseException:
        writer.close()
        raise
    params.publish(version, env_steps)
    write_acting_file(run_dir, writer.descriptor["spec"], acting_plan(agent))  # for torch-free local samplers
    return params, version


def run(exp, run_dir, instance: int) -> None:
    m = metrics_mod.for_service("learner", instance, exp.placement.node("learner"))
    device = torch_device(exp.run.device, exp.learner.threads)
    group = None
    if exp.learner.count > 1:
        device = ranks.rank_device(device, instance)
        group = ranks.join(run_dir, instance, exp.learner.count, device, JOIN_TIMEOUT_S)
    probe = env_probe(exp)
    agent = make_agent(exp, probe).to(device)
    learner = Learner(exp, agent, None, device, run_dir, m, group)
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
    ctx = zmq.Context()
    if learner.leads:
        # the samplers act while the algorithm is built
        params, learner.version = start_publishing(ctx, exp, run_dir, agent, learner.version, learner.env_steps)
    else:
        params = Unpublished()
    learner.attach(make_algo(exp, agent))
    if group is not None:
        learner.version = group.broadcast(learner.version)
        group.check_identical(agent, "after resuming")
    source = RemoteBatches(ctx, endpoint(exp, run_dir, "replay"), descriptors, batch_items(exp),
                           exp.learner.timeout_ms, m, read_secret(run_dir), instance,
                           frames=slots if exp.placement.crosses("learner", "replay") else None)
    m.healthy.set(1)
    log.info("learner%s: %s on %s, %d item(s) a batch, starting at version %d",
             "" if group is None else f" rank {instance} of {group.world}", exp.algo_name, device,
             batch_items(exp), learner.version)
    # A rank > 0 waits in the group's collectives while rank 0 checkpoints: alive as long as rank 0 is.
    beats = contextlib.nullcontext() if group is None or group.rank == 0 else \
        heartbeat.following(socket_dir(run_dir) / heartbeat.DIR / "learner0")
    try:
        with beats:
            result = run_loop(learner, slots, source, params)
        log.info("run finished: %s", result)
    finally:
        learner.progress.close()  # also when stopped: the W&B run ends here, not in an exit hook
        source.close()
        params.close()
        for seg in segments:
            seg.unlink()
            seg.close()
        ctx.term()


if __name__ == "__main__":
    serve("learner", run)
