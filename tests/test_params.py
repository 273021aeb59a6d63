"""Parameter versions through shared memory: state_dicts (parameters and buffers) move
version by version, torn and stale copies are refused, other architectures are rejected,
and a restarted learner learns the highest version its crashed predecessor published."""

import time

import msgpack
import pytest
import torch
from torch import nn

from shared.transport import params
from shared.transport import shm

torch.set_num_threads(1)


def make_net(seed: int, hidden: int = 8) -> nn.Module:
    """Linear + BatchNorm: float parameters, float buffers and a 0-d int64 buffer."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 2))
    net.register_buffer("step_scale", torch.tensor([0.5, 2.0], dtype=torch.float64))
    return net


def train_a_little(net: nn.Module, version: int) -> None:
    """Change every entry of the state_dict, as a learner update would."""
    net.train()
    net(torch.randn(16, 4))  # BatchNorm running stats and num_batches_tracked move
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01 * version)
        net.step_scale.mul_(1.5)


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def learner_owner(run_id: str) -> shm.Owner:
    return shm.Owner(run_id, "learner")


def wire_copy(descriptor: dict) -> dict:
    """The descriptor as a reader gets it from a message."""
    return msgpack.unpackb(msgpack.packb(descriptor))


def test_versions_move_parameters_and_buffers(run_id):
    learner, actor = make_net(0), make_net(1)
    writer = params.ParamWriter(learner, shm.segment_name(run_id, "learner", 0, "params"))
    assert writer.previous_version == -1
    reader = params.ParamReader(actor, learner_owner(run_id))
    desc = wire_copy(writer.descriptor)
    assert not reader.read(0, desc)  # nothing published yet
    for version in range(1, 6):
        train_a_little(learner, version)
        writer.write(version)
        assert reader.read(version, desc)
        assert_same_state(learner, actor)
    assert int(actor[1].num_batches_tracked) == 5
    assert not reader.read(3, desc)  # copy 3 % 2 now holds version 5: stale, refused
    writer.close()
    assert not (shm.SHM_DIR / writer.descriptor["name"]).exists()


def test_torn_reads_return_false_and_leave_the_module_alone(run_id, monkeypatch):
    learner, actor = make_net(0), make_net(1)
    writer = params.ParamWriter(learner, shm.segment_name(run_id, "learner", 0, "params"))
    reader = params.ParamReader(actor, learner_owner(run_id))
    writer.write(1)
    assert reader.read(1, writer.descriptor)
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    train_a_little(learner, 3)
    writer.write(3)
    stamp = writer.slots.stamp[1]

    # The learner has begun overwriting copy 1 with version 5 (its first stamp) but not finished.
    stamp[0] = 5
    assert not reader.read(3, writer.descriptor)

    # The learner begins version 5 while the reader is copying version 3.
    stamp[0] = 3
    real_leaves = params.leaves

    def leaves_while_learner_starts_v5(tree):
        for k, item in enumerate(real_leaves(tree)):
            if k == 1 and tree is reader.slots.tensors:
                stamp[0] = 5
            yield item

    monkeypatch.setattr(params, "leaves", leaves_while_learner_starts_v5)
    assert not reader.read(3, writer.descriptor)
    monkeypatch.undo()
    for k, v in actor.state_dict().items():
        assert torch.equal(v, before[k]), k

    # Once the learner has finished version 5, it loads; version 3 is gone.
    train_a_little(learner, 5)
    writer.write(5)
    assert not reader.read(3, writer.descriptor)
    assert reader.read(5, writer.descriptor)
    assert_same_state(learner, actor)
    writer.close()


def test_descriptor_of_another_architecture_raises_and_keeps_the_current_segment(run_id):
    learner, actor, wide = make_net(0), make_net(1), make_net(2, hidden=16)
    writer = params.ParamWriter(learner, shm.segment_name(run_id, "learner", 0, "params"))
    other = params.ParamWriter(wide, shm.segment_name(run_id, "learner", 1, "params"))
    reader = params.ParamReader(actor, learner_owner(run_id))
    writer.write(1)
    other.write(1)
    assert reader.read(1, writer.descriptor)
    with pytest.raises(ValueError, match=rf"{other.descriptor['name']} does not match this agent's state_dict"):
        reader.read(1, wire_copy(other.descriptor))
    train_a_little(learner, 2)
    writer.write(2)
    assert reader.read(2, writer.descriptor)  # still following the right learner
    assert_same_state(learner, actor)
    with pytest.raises(ValueError, match="does not match"):
        params.ParamReader(make_net(3).double(), learner_owner(run_id)).read(1, writer.descriptor)  # same shapes, other dtypes
    writer.close()
    other.close()


def test_restarted_writer_learns_the_crashed_ones_highest_version(run_id):
    name = shm.segment_name(run_id, "learner", 0, "params")
    crashed, actor = make_net(0), make_net(1)
    first = params.ParamWriter(crashed, name)
    reader = params.ParamReader(actor, learner_owner(run_id))
    for version in range(1, 8):
        first.write(version)
    assert reader.read(7, first.descriptor)
    # The learner dies without close(): its segment stays, and a new learner starts.
    restarted = make_net(5)
    second = params.ParamWriter(restarted, name)
    try:
        assert second.previous_version == 7
        assert second.descriptor["nonce"] != first.descriptor["nonce"]
        version = second.previous_version + 1
        second.write(version)
        assert reader.read(version, second.descriptor)  # the new nonce makes the reader re-attach
        assert_same_state(restarted, actor)
    finally:
        second.close()
        first.segment.close()
    assert not (shm.SHM_DIR / name).exists()


def test_follower_waits_for_the_segment_then_loads_each_newer_version_with_its_env_steps(run_id):
    name = shm.segment_name(run_id, "learner", 0, "params")
    learner, actor = make_net(0), make_net(1)
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    follower = params.ParamFollower(actor, name, learner_owner(run_id), recheck_s=0.0)
    assert not follower.poll() and follower.version == -1  # no learner yet: the actor keeps its own parameters
    assert all(torch.equal(before[k], v) for k, v in actor.state_dict().items())
    writer = params.ParamWriter(learner, name)
    try:
        for version in range(3):
            train_a_little(learner, version + 1)
            writer.write(version, env_steps=1000 * version)
            assert follower.poll()
            assert (follower.version, follower.env_steps) == (version, 1000 * version)
            assert_same_state(learner, actor)
            assert not follower.poll()  # nothing newer: no copy
        # A torn copy (the learner is half-way through version 4 in copy 0) is not taken.
        writer.slots.stamp[0][0] = 4
        writer.slots.stamp[0][1] = 4
        writer.slots.stamp[0][0] = 6
        assert not follower.poll() and follower.version == 2
    finally:
        writer.close()
        follower.close()


def test_follower_follows_a_restarted_learner_to_its_new_segment(run_id):
    name = shm.segment_name(run_id, "learner", 0, "params")
    first, actor = make_net(0), make_net(1)
    writer = params.ParamWriter(first, name)
    follower = params.ParamFollower(actor, name, learner_owner(run_id), recheck_s=0.0)
    writer.write(5, env_steps=50)
    assert follower.poll() and follower.version == 5
    writer.segment.close()  # killed: the segment stays until the new learner replaces it
    restarted = make_net(7)
    second = params.ParamWriter(restarted, name)
    try:
        second.write(second.previous_version + 1, env_steps=60)
        assert follower.poll() and (follower.version, follower.env_steps) == (6, 60)
        assert_same_state(restarted, actor)
    finally:
        second.close()
        follower.close()


def test_a_consumer_on_another_node_follows_the_versions_sent_as_frames(run_id, tmp_path):
    """PublishedParams with frames sends each version's arrays as ``params_data``; a
    ParamStream on a SUB for that type loads them (into a module, and into numpy arrays); a
    subscriber of ``params`` gets only the announcements; arrays that do not fit are skipped."""
    import numpy as np
    import zmq

    from services.learner.transport import PublishedParams
    from shared.transport import wire
    from shared.transport.sockets import Endpoint

    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/params"
    learner, actor = make_net(0), make_net(1)
    writer = params.ParamWriter(learner, shm.segment_name(run_id, "learner", 0, "params"))
    pub = PublishedParams(ctx, address, writer, frames=True)
    bad: list[str] = []
    module_stream = params.ParamStream(actor, Endpoint(ctx, zmq.SUB, address, False, "a", bad.append,
                                                        subscribe=wire.topic("params_data")))
    arrays = params.StateArrays(writer.descriptor["spec"])
    numpy_stream = params.ParamStream(arrays, Endpoint(ctx, zmq.SUB, address, False, "b",
                                                       subscribe=wire.topic("params_data")))
    announcements = Endpoint(ctx, zmq.SUB, address, False, "c", subscribe=wire.topic("params"))
    try:
        deadline, connected = time.monotonic() + 10, set()
        while len(connected) < 2 and time.monotonic() < deadline:  # until both SUBs are connected
            pub.publish(0, 0)
            time.sleep(0.05)
            connected |= {name for name, s in (("module", module_stream), ("numpy", numpy_stream)) if s.poll()}
        time.sleep(0.1)
        announcements.drain()
        for version in (1, 2, 3):
            train_a_little(learner, version)
            pub.publish(version, 100 * version)
        time.sleep(0.2)
        assert module_stream.poll() and module_stream.version == 3 and module_stream.env_steps == 300
        assert_same_state(learner, actor)
        assert numpy_stream.poll() and numpy_stream.version == 3
        for value, arr in zip(learner.state_dict().values(), arrays.arrays.values()):
            assert np.array_equal(value.numpy(), arr)
        assert [m.type for _, m in announcements.drain()] == ["params"] * 3

        pub.ep.send("params_data", {"version": 4, "env_steps": 400}, arrays=[np.zeros(3, np.float32)])
        time.sleep(0.2)
        assert not module_stream.poll() and module_stream.version == 3 and bad == ["value"]
    finally:
        for ep in (module_stream, numpy_stream, announcements, pub):
            ep.close()
        ctx.destroy(linger=0)


def announcing(learner: nn.Module, run_id: str, tmp_path):
    """(ctx, writer, pub, sub): ``learner``'s parameter segment, a ``PublishedParams`` on it at an
    ipc address in ``tmp_path``, and a SUB endpoint subscribed to its announcements."""
    import zmq

    from services.learner.transport import PublishedParams
    from shared.transport import wire
    from shared.transport.sockets import Endpoint

    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/params"
    writer = params.ParamWriter(learner, shm.segment_name(run_id, "learner", 0, "params"))
    return ctx, writer, PublishedParams(ctx, address, writer), Endpoint(ctx, zmq.SUB, address, False, "a",
                                                                        subscribe=wire.topic("params"))


def publish_until_heard(pub, follower, env_steps: int = 0) -> None:
    """Publish version 0 until ``follower`` takes it: a SUB drops what comes before it is connected."""
    deadline = time.monotonic() + 10
    while not follower.poll() and time.monotonic() < deadline:
        pub.publish(0, env_steps)
        time.sleep(0.05)


def test_announcements_load_the_newest_version_follow_a_restarted_learner_and_skip_bad_segments(run_id, tmp_path):
    """What an action-server does on one node: PublishedParams announces each version (the
    segment's descriptor), ParamAnnouncements loads only the newest of those that came, a
    restarted learner's lower versions (new nonce) too, and a descriptor it cannot attach is
    logged and skipped."""
    learner, actor = make_net(0), make_net(1)
    ctx, writer, pub, sub = announcing(learner, run_id, tmp_path)
    follower = params.ParamAnnouncements(actor, sub, learner_owner(run_id))
    second = None
    try:
        publish_until_heard(pub, follower)
        assert follower.version == 0
        for version in (1, 2, 3):
            train_a_little(learner, version)
            pub.publish(version, 100 * version)
        time.sleep(0.2)
        assert follower.poll() and (follower.version, follower.env_steps) == (3, 300)
        assert_same_state(learner, actor)
        assert not follower.poll()  # nothing new

        writer.segment.close()  # the learner is killed; its successor numbers on from its checkpoint's 2
        restarted = make_net(7)
        second = params.ParamWriter(restarted, writer.segment.name)
        second.write(2, env_steps=200)
        pub.ep.send("params", {"version": 2, "segment": second.descriptor, "env_steps": 200})
        time.sleep(0.2)
        assert follower.poll() and follower.version == 2
        assert_same_state(restarted, actor)

        pub.ep.send("params", {"version": 9, "segment": {**second.descriptor, "nonce": "x", "spec": {}},
                               "env_steps": 900})
        time.sleep(0.2)
        assert not follower.poll() and follower.version == 2  # another layout: refused, the version held stays
    finally:
        follower.close()
        pub.ep.close()
        (writer if second is None else second).close()  # the name is the successor's segment by then
        ctx.destroy(linger=0)


def test_announced_steps_take_the_newest_announcements_env_steps_and_load_nothing(run_id, tmp_path):
    """What a server-inference sampler playing against a pool follows for its opponent's
    exploration: the run's env steps of the newest announcement, a restarted learner's lower
    ones too; no segment is attached."""
    ctx, writer, pub, sub = announcing(make_net(0), run_id, tmp_path)
    steps = params.AnnouncedSteps(sub)
    try:
        assert steps.env_steps == 0
        publish_until_heard(pub, steps, 5)
        assert steps.env_steps == 5
        for version in (1, 2, 3):
            pub.publish(version, 100 * version)
        time.sleep(0.2)
        assert steps.poll() and steps.env_steps == 300
        assert not steps.poll() and steps.env_steps == 300  # nothing new: the steps held stay
        pub.publish(2, 200)  # a restarted learner counts on from its checkpoint
        time.sleep(0.2)
        assert steps.poll() and steps.env_steps == 200
    finally:
        steps.close()
        pub.ep.close()
        writer.close()
        ctx.destroy(linger=0)


def test_the_newest_stamp_is_the_newest_complete_versions_env_steps_read_without_the_state(run_id):
    """What a server-inference sampler starting against a pool reads for its opponent's
    exploration: nothing before the learner's segment or its first version, then the newest
    version's env steps, without a copy of the state; nothing while that copy is being
    overwritten (the seqlock); a segment of another layout is refused."""
    net = make_net(0)
    name, owner = shm.segment_name(run_id, "learner", 0, "params"), learner_owner(run_id)
    spec = params.state_spec(net)
    assert params.newest_stamp(name, spec, owner) is None  # no segment yet
    writer = params.ParamWriter(net, name)
    try:
        assert params.newest_stamp(name, spec, owner) is None  # no version yet
        writer.write(1, env_steps=100)
        writer.write(2, env_steps=200)
        assert params.newest_stamp(name, spec, owner) == (2, 200)
        writer.slots.stamp[0, 0] = 4  # version 4 being written over version 2's copy: torn, not read
        assert params.newest_stamp(name, spec, owner) is None
        writer.write(4, env_steps=400)
        assert params.newest_stamp(name, spec, owner) == (4, 400)
        with pytest.raises(ValueError, match="bytes"):
            params.newest_stamp(name, params.state_spec(make_net(0, hidden=16)), owner)
    finally:
        writer.close()


def test_a_follower_keeps_its_parameters_when_the_segment_is_not_its_agents_and_follows_the_right_one_later(run_id):
    """An evaluator or local sampler did crash on it, and again after every restart."""
    name = shm.segment_name(run_id, "learner", 0, "params")
    wide, actor = make_net(2, hidden=16), make_net(1)
    before = [t.clone() for t in actor.state_dict().values()]
    wrong = params.ParamWriter(wide, name)
    follower = params.ParamFollower(actor, name, learner_owner(run_id), recheck_s=0.0)
    wrong.write(3)
    assert not follower.poll() and not follower.poll() and follower.failed == 2 and follower.version == -1
    assert all(torch.equal(a, b) for a, b in zip(before, actor.state_dict().values()))
    wrong.close()
    learner = make_net(0)
    writer = params.ParamWriter(learner, name)
    try:
        writer.write(4)
        assert follower.poll() and follower.version == 4
        assert_same_state(learner, actor)
    finally:
        writer.close()
        follower.close()
