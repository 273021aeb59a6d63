"""python -m services.sampler --run-dir RUN --instance I"""

import logging
import time

import numpy as np
import zmq

from services.sampler.sampler import Sampler, run_loop
from services.sampler.transport import RemoteActions, RemoteSink
from shared.runtime import heartbeat
from shared.runtime.retry import worth_logging
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
    from shared.agents.acting import numpy_actor
    from shared.transport.params import ParamFollower, ParamStream, StateArrays

    seed = topo.acting_seed("sampler", sampler.instance)
    segment, owner = shm.segment_name(run_id, "learner", 0, "params"), shm.Owner(run_id, "learner", 0)

    def follow(target):
        if not exp.placement.crosses("sampler", "learner"):
            return ParamFollower(target, segment, owner)
        sub = Endpoint(ctx, zmq.SUB, endpoint(exp, run_dir, "params"), bind=False, name=f"sampler{sampler.instance}",
                       on_bad=metrics_mod.bad_message_counter(sampler.metrics), subscribe=wire.topic("params_data"))
        return ParamStream(target, sub)

    published = wait_for_acting(exp, run_dir)
    limit_s = startup_limit_s(exp)
    if published["plan"] is not None:
        state = StateArrays(published["spec"])
        act = numpy_actor(published["plan"], state.arrays, exp.agent, np.random.default_rng(seed))
        params = follow(state)
        wait_for("the learner's first parameter version", params.poll, limit_s)  # it follows acting.json at once
    else:
        from shared.agents.actor import Actor, seed_torch

        torch_device("cpu")
        agent = make_agent(exp, env_probe(exp)).eval()
        seed_torch(seed)  # make_agent seeded it with run.seed
        act = Actor(agent, seed)
        params = follow(agent)
    opponent = pool_opponent(exp, topo, run_dir, sampler, published) if exp.selfplay.on else None
    return LocalActions(act, sampler, params, topo.total_envs, opponent)


def wait_for_acting(exp, run_dir) -> dict:
    """The learner's acting.json (``shared.agents.acting.read_acting_file``), waited for."""
    from shared.agents.acting import read_acting_file

    return wait_for("the learner's acting.json", lambda: read_acting_file(run_dir), startup_limit_s(exp))


def startup_limit_s(exp) -> float:
    """How long a starting sampler waits for what the learner publishes (its acting.json, versions, steps)."""
    return exp.run.watchdog_startup_s or ACTING_WAIT_S


def pool_opponent(exp, topo: Topology, run_dir, sampler: Sampler, published: dict):
    """The self-play pool's opponent seat of ``sampler``, set as ``sampler.opponent``: copies of
    the agent that load past versions and act in this process under either inference mode, in
    numpy where the learner published an acting plan (``published``: its acting.json), else in
    torch on the cpu, all copies in one pass where they can (``shared.agents.stacked``)."""
    from services.sampler.opponent import sampler_opponent
    from shared.agents.acting import numpy_actor
    from shared.transport.params import ModuleState, StateArrays

    acting, drawing = topo.acting_seed("opponent", sampler.instance).spawn(2)
    stack = None
    if published["plan"] is not None:
        def opponent_copy():
            past = StateArrays(published["spec"])
            rng = np.random.default_rng(acting.spawn(1)[0])
            return numpy_actor(published["plan"], past.arrays, exp.agent, rng), past
    else:
        from shared.agents.actor import Actor
        from shared.agents.stacked import stacked_actor

        torch_device("cpu")
        stack = stacked_actor

        def opponent_copy():
            other = make_agent(exp, env_probe(exp)).eval()
            return Actor(other, acting.spawn(1)[0]), ModuleState(other)
    sampler.opponent = sampler_opponent(exp, run_dir, sampler, opponent_copy, drawing, stack)
    return sampler.opponent


def served_actions(exp, topo: Topology, sampler: Sampler, run_dir, ctx: zmq.Context, incarnation: int,
                   secret: str):
    """Server inference: the action-server of ``sampler`` acts for every column; in self-play
    against a pool the opponent seat then acts here (``opponent.ServedWithOpponent``), following
    the run's env steps (``announced_steps``)."""
    instance, m = sampler.instance, sampler.metrics
    server = topo.action_server_of(instance)
    served = RemoteActions(ctx, endpoint(exp, run_dir, f"action_server{server}"), f"sampler{instance}", instance,
                           sampler.slot_descriptors, socket_dir(run_dir), exp.sampler.timeout_ms, m, incarnation,
                           secret)
    if not exp.selfplay.on:
        return served
    from services.sampler.opponent import ServedWithOpponent

    sub = None
    try:
        published = wait_for_acting(exp, run_dir)
        opponent = pool_opponent(exp, topo, run_dir, sampler, published)
        sub = Endpoint(ctx, zmq.SUB, endpoint(exp, run_dir, "params"), bind=False, name=f"sampler{instance}",
                       on_bad=metrics_mod.bad_message_counter(m), subscribe=wire.topic("params"))
        steps = announced_steps(exp, run_dir, sub, published)
    except BaseException:
        if sub is not None:
            sub.close()
        served.close()
        raise
    return ServedWithOpponent(served, opponent, sampler, steps, topo.total_envs)


def announced_steps(exp, run_dir, sub: Endpoint, published: dict):
    """The run's env steps for the opponent of a server-inference sampler (``params.AnnouncedSteps``
    on ``sub``), from where the run is when the sampler starts, not from 0: a restarted sampler's
    opponent copies would otherwise explore as at env step 0 until the learner's next
    announcement. Read once from the stamps of the newest version in the learner's parameter
    segment (``params.newest_stamp``; ``published``: the learner's acting.json, whose spec is the
    segment's), waited for as a local-inference sampler waits for its first version; where the
    learner runs on another node, its first announcement is waited for (as a local sampler there
    waits for its first version)."""
    from shared.transport.params import AnnouncedSteps, newest_stamp

    limit_s = startup_limit_s(exp)
    if exp.placement.crosses("sampler", "learner"):
        steps = AnnouncedSteps(sub)
        wait_for("the learner's env steps", steps.poll, limit_s)
        return steps
    run_id = run_id_of(run_dir)
    name, owner = shm.segment_name(run_id, "learner", 0, "params"), shm.Owner(run_id, "learner", 0)
    refused = 0

    def newest():
        nonlocal refused
        try:
            return newest_stamp(name, published["spec"], owner)
        except ValueError as e:  # a learner still sizing its new segment; one of another agent is waited out too
            refused += 1
            if worth_logging(refused):
                log.warning("cannot read the learner's parameter segment (%d tries so far): %s", refused, e)
            return None

    _, env_steps = wait_for("the learner's first parameter version", newest, limit_s)
    return AnnouncedSteps(sub, env_steps)


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
            actions = served_actions(exp, topo, sampler, run_dir, ctx, incarnation, secret)
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
