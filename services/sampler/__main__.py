"""python -m services.sampler --run-dir RUN --instance I"""

import logging
import time

import numpy as np
import zmq

from services.sampler.sampler import Sampler, run_loop
from services.sampler.transport import RemoteActions, RemoteSink
from shared.runtime import heartbeat
from shared.runtime import metrics as metrics_mod
from shared.transport import shm
from shared.transport import wire
from shared.transport.auth import read_secret
from shared.config.endpoints import endpoint, socket_dir
from services.build import agent_info, env_probe, make_agent
from shared.runtime.process import run_id_of, torch_device
from services.process import serve
from shared.transport.sockets import Endpoint
from shared.config.topology import Topology, topology

log = logging.getLogger("services.sampler")
POLL_S = 0.02  # waiting for the learner's first publication at start-up
NOTE_S = 10.0  # a note in the log this often while the learner is not there
ACTING_WAIT_S = 300.0  # the longest wait for the learner's agent where run.watchdog_startup_s = 0


def local_actions(exp, topo: Topology, sampler: Sampler, run_dir, run_id: str, ctx: zmq.Context):
    """Local inference: the agent's copy that follows the learner's parameter segment (or, on
    another node than the learner, the versions it publishes as frames). Where the learner
    published a numpy acting plan (``shared.agents.acting``), the sampler acts in numpy on its own
    copy of the state and never imports torch; else it builds the torch agent."""
    from services.sampler.local import LocalActions
    from services.sampler.opponent import sampler_opponent
    from shared.agents.acting import numpy_actor, read_acting_file
    from shared.transport.params import ModuleState, ParamFollower, ParamStream, StateArrays

    seed = topo.acting_seed("sampler", sampler.instance)
    segment, owner = shm.segment_name(run_id, "learner", 0, "params"), shm.Owner(run_id, "learner", 0)

    def follow(target):
        if not exp.placement.crosses("sampler", "learner"):
            return ParamFollower(target, segment, owner)
        sub = Endpoint(ctx, zmq.SUB, endpoint(exp, run_dir, "params"), bind=False, name=f"sampler{sampler.instance}",
                       on_bad=metrics_mod.bad_message_counter(sampler.metrics), subscribe=wire.topic("params_data"))
        return ParamStream(target, sub)

    limit_s = exp.run.watchdog_startup_s or ACTING_WAIT_S
    published = wait_for("the learner's acting.json", lambda: read_acting_file(run_dir), limit_s)
    # Self-play against a pool: copies of the agent act for the opponent seat with past versions.
    opponent_seeds = topo.acting_seed("opponent", sampler.instance).spawn(2) if exp.selfplay.on else None
    if published["plan"] is not None:
        state = StateArrays(published["spec"])
        act = numpy_actor(published["plan"], state.arrays, exp.agent, np.random.default_rng(seed))
        params = follow(state)
        wait_for("the learner's first parameter version", params.poll, limit_s)  # it follows acting.json at once

        def opponent_copy():
            past = StateArrays(published["spec"])
            rng = np.random.default_rng(opponent_seeds[0].spawn(1)[0])
            return numpy_actor(published["plan"], past.arrays, exp.agent, rng), past
    else:
        from shared.agents.actor import Actor, seed_torch

        torch_device("cpu")
        agent = make_agent(exp, env_probe(exp)).eval()
        seed_torch(seed)  # make_agent seeded it with run.seed
        act = Actor(agent, seed)
        params = follow(agent)

        def opponent_copy():
            other = make_agent(exp, env_probe(exp)).eval()
            return Actor(other, opponent_seeds[0].spawn(1)[0]), ModuleState(other)
    opponent = None
    if opponent_seeds is not None:
        opponent = sampler_opponent(exp, run_dir, sampler, opponent_copy, opponent_seeds[1])
        sampler.opponent = opponent
    return LocalActions(act, sampler, params, topo.total_envs, opponent)


def wait_for(what: str, ready, limit_s: float):
    """``ready()``'s first true value, polled, beating the heartbeat with its phase "waiting for
    <what>"; a note in the log every NOTE_S while waiting; RuntimeError after ``limit_s``
    (supervisord restarts the sampler, the note says where to look)."""
    heartbeat.phase(f"waiting for {what}")
    t0 = t_note = time.monotonic()
    while not (value := ready()):
        now = time.monotonic()
        if now - t0 > limit_s:
            raise RuntimeError(f"waited {limit_s:g} s (run.watchdog_startup_s) for {what}, in vain: is the "
                               "learner building its agent? see logs/learner0.log")
        if now - t_note > NOTE_S:
            log.info("waiting for %s (%.0f s so far, at most %g s)", what, now - t0, limit_s)
            t_note = now
        heartbeat.beat()
        time.sleep(POLL_S)
    return value


def run(exp, run_dir, instance: int) -> None:
    m = metrics_mod.for_service("sampler", instance, exp.placement.node("sampler"))
    ctx = zmq.Context()
    run_id = run_id_of(run_dir)
    topo = topology(exp)
    sampler = Sampler(exp.sampler, exp.env, topo, instance, agent_info(exp), run_id, metrics=m)
    name = f"sampler{instance}"
    incarnation, secret = time.time_ns(), read_secret(run_dir)  # a restarted sampler's incarnation is newer
    actions = sink = None
    try:
        if exp.sampler.inference == "local":
            actions = local_actions(exp, topo, sampler, run_dir, run_id, ctx)
        else:
            server = topo.action_server_of(instance)
            actions = RemoteActions(ctx, endpoint(exp, run_dir, f"action_server{server}"), name, instance,
                                    sampler.slot_descriptors, socket_dir(run_dir), exp.sampler.timeout_ms, m,
                                    incarnation, secret)
        sink = RemoteSink(ctx, endpoint(exp, run_dir, "replay"), name, instance, sampler.ring_descriptor,
                          incarnation, exp.sampler.ring, exp.sampler.timeout_ms, m, secret,
                          frames=sampler.ring if exp.placement.crosses("sampler", "replay") else None)
        m.healthy.set(1)
        log.info("sampler %d: %d envs of %s in %d group(s)%s, T=%d, %s inference", instance, exp.sampler.envs,
                 exp.env.id, len(sampler.groups), ", steps split (send, recv)" if sampler.split else "",
                 exp.sampler.horizon, exp.sampler.inference)
        run_loop(sampler, actions, sink)
    finally:
        for part in (actions, sink):
            if part is not None:
                part.close()
        sampler.close()
        ctx.term()


if __name__ == "__main__":
    serve("sampler", run)
