"""The replay service against hostile and broken peers, in process with real sockets and
shared memory: hellos need the run's secret and the owner's own segments, roles stay bound
to their routing ids, and no single message (valid envelope, hostile values) ends the
service or loses what it accepted."""

from __future__ import annotations

import dataclasses
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from services.replay import core as replay_core
from services.replay.service import ReplayService
from services.replay.tables import make_table
from shared.config import loading as config
from shared.runtime import metrics
from shared.transport import shm
from shared.transport import wire
from services.build import batch_spec, env_probe, example_step, round_items
from shared.data.layout import segment_spec
from shared.data.namedarraytuple import from_leaves, leaves, with_leading_dims
from shared.transport.sockets import Endpoint
from tests.pipeline import CONFIGS

SECRET = "s3cret"
T, B, RING, N_STEP = 4, 2, 2, 2


@pytest.fixture(scope="module")
def exp_and_example():
    exp = config.load(CONFIGS / "cartpole_dqn.toml", [
        "sampler.count=2", f"sampler.envs={B}", f"sampler.horizon={T}", f"sampler.ring={RING}",
        "replay.capacity=1000", "replay.min_size_to_sample=1", f"replay.n_step={N_STEP}", "replay.samples_per_insert=0.0", "algo.batch_size=4"])
    probe = env_probe(exp)
    example = example_step(exp, probe)
    probe.close()
    return exp, example


class Hub:
    """A replay service on its own thread, and helpers to talk to it as peers do."""

    def __init__(self, exp, example, run_id, tmp_path):
        self.exp, self.example, self.run_id = exp, example, run_id
        self.ctx = zmq.Context()
        self.address = f"ipc://{tmp_path}/replay"
        self.bad: list[str] = []
        router = Endpoint(self.ctx, zmq.ROUTER, self.address, bind=True, name="replay0", on_bad=self.bad.append)
        columns = {i: B for i in range(exp.sampler.count)}
        self.service = ReplayService(exp.replay, lambda spec: make_table(exp.replay, columns, spec, round_items(exp)),
                                     router, metrics.for_service("replay", 0), run_id, SECRET,
                                     ranks=exp.learner.count,
                                     remote_writers=exp.placement.crosses("sampler", "replay"),
                                     remote_readers=exp.placement.crosses("learner", "replay"))
        self.rings: dict = {}  # purpose -> the ring's arrays
        self.segments: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.service.run, args=(self.stop.is_set,))
        self.thread.start()

    def client(self, name: str) -> Endpoint:
        return Endpoint(self.ctx, zmq.DEALER, self.address, bind=False, name=name)

    def ring(self, instance: int, purpose: str = "ring"):
        spec = with_leading_dims(segment_spec(self.example, T, B), [RING])
        seg, ring, desc = shm.allocate(shm.segment_name(self.run_id, "sampler", instance, purpose), spec)
        ring.samples.reward[:] = 1.0
        ring.samples.terminated[:] = False
        ring.samples.truncated[:] = False
        ring.samples.policy_version[:] = 0
        ring.samples.observation[:] = 0.5
        self.segments.append(seg)
        self.rings[(instance, purpose)] = ring
        return desc

    def batch_slots(self, n: int = 1, rank: int = 0) -> tuple[list, list]:
        """``n`` batch slots of learner rank ``rank``: their descriptors and arrays."""
        descs, trees = [], []
        for i in range(n):
            seg, tree, desc = shm.allocate(shm.segment_name(self.run_id, "learner", rank, f"batch{i}"),
                                           batch_spec(self.exp, self.example))
            self.segments.append(seg)
            descs.append(desc)
            trees.append(tree)
        return descs, trees

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.service.close()
        self.service.router.close()
        for seg in self.segments:
            seg.unlink()
            seg.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def hub(exp_and_example, run_id, tmp_path):
    h = Hub(*exp_and_example, run_id, tmp_path)
    yield h
    h.close()
    assert not h.thread.is_alive()


def replies(ep: Endpoint, n: int, timeout_ms: int = 5000) -> list:
    out = []
    deadline = time.monotonic() + timeout_ms / 1000
    while len(out) < n and time.monotonic() < deadline:
        got = ep.recv(100)
        if got is not None:
            out.append(got[1])
    return out


def raw_send(ep: Endpoint, mtype: str, body: dict) -> None:
    """A message with a valid envelope whatever the values (pack would refuse hostile ones)."""
    header = {"v": wire.PROTOCOL_VERSION, "type": mtype, "from": "x", "seq": 1, "body": body, "arrays": []}
    ep.sock.send_multipart([msgpack.packb(header)])


def hello_writer(hub, ep, instance=0, incarnation=1, secret=SECRET, ring=None):
    ep.send("hello_writer", {"instance": instance, "incarnation": incarnation, "secret": secret,
                             "ring": ring if ring is not None else hub.ring(instance)})


def segment(serial: int, index: int = 0, episodes=()) -> dict:
    return {"index": index, "serial": serial, "steps": T * B, "episodes": list(episodes), "version_min": 0,
            "version_max": 0}


def wait_for(predicate, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_hello_without_the_run_secret_is_rejected_and_counted(hub):
    sampler = hub.client("sampler0")
    hello_writer(hub, sampler, secret="guess")
    [reply] = replies(sampler, 1)
    assert reply.type == "error" and "wrong run secret" in reply.body["reason"]
    assert hub.bad == ["auth"] and hub.service.writers == {}
    sampler.send("segment", segment(1))
    [reply] = replies(sampler, 1)
    assert reply.body["reason"] == "segment: unknown sampler: send hello_writer first"


def test_a_writer_role_stays_bound_until_a_newer_incarnation_says_hello(hub):
    sampler, spoof = hub.client("sampler0"), hub.client("sampler0")
    ring = hub.ring(0)
    hello_writer(hub, sampler, incarnation=10, ring=ring)
    wait_for(lambda: 0 in hub.service.writers, "the sampler to attach")
    hello_writer(hub, spoof, incarnation=10, ring=ring)  # same incarnation from another routing id
    [reply] = replies(spoof, 1)
    assert "bound to another routing id" in reply.body["reason"] and hub.bad == ["auth"]
    sampler.send("segment", segment(1))
    [reply] = replies(sampler, 1)
    assert (reply.type, reply.body) == ("release", {"index": 0})  # the real sampler still owns the role
    hello_writer(hub, spoof, incarnation=11, ring=ring)  # a restarted sampler: newer incarnation wins
    wait_for(lambda: hub.service.writers[0].peer == spoof.identity, "the restarted sampler to take over")


def test_the_reader_role_cannot_be_taken_by_another_peer(hub):
    learner, other = hub.client("learner0"), hub.client("learner0")
    learner.send("hello_reader", {"slots": hub.batch_slots()[0], "incarnation": 5, "secret": SECRET})
    wait_for(lambda: 0 in hub.service.readers, "the learner to attach")
    other.send("hello_reader", {"slots": [{"name": "x"}], "incarnation": 5, "secret": SECRET})
    [reply] = replies(other, 1)
    assert "learner rank 0 is bound to another routing id" in reply.body["reason"]
    raw_send(other, "hello_reader", {"slots": [], "incarnation": 6, "secret": SECRET})  # took the role before
    assert replies(other, 1)[0].type == "error" and hub.bad == ["auth", "wire"]
    other.send("hello_reader", {"slots": hub.batch_slots(rank=1)[0], "incarnation": 7, "secret": SECRET, "rank": 1})
    [reply] = replies(other, 1)
    assert "rank 1 is not one of the run's 1 learner rank(s)" in reply.body["reason"]
    reader = hub.service.readers[0]
    assert list(hub.service.readers) == [0] and reader.peer == learner.identity and len(reader.slots) == 1
    other.send("sample", {"slot": 0, "n": 4, "min_version": 0})
    [reply] = replies(other, 1)
    assert reply.body["reason"] == "sample: unknown reader: send hello_reader first"


@pytest.mark.parametrize("mtype,body,reason", [
    ("priorities", {"keys": [2**64 - 1], "generations": [0], "priorities": [1.0]}, "wire"),  # OverflowError before
    ("priorities", {"keys": [10**9], "generations": [0], "priorities": [1.0]}, "state"),  # not the reader
    ("segment", {**segment(2), "steps": -1}, "wire"),  # a negative counter increment before
    ("segment", segment(2, episodes=[[1.0]]), "wire"),  # the learner crashed on this before
    ("segment", segment(2, episodes=[[1e308, 5]] * 100), "wire"),  # ended the run claiming its target before
    ("segment", segment(2, index=RING), "value"),
    ("segment", segment(2, index=2**62), "wire"),
    ("hello_writer", {"instance": 2**62, "incarnation": 1, "secret": SECRET, "ring": {}}, "wire"),
    ("hello_writer", {"instance": 1, "incarnation": 1, "secret": SECRET, "ring": {"name": "x", "spec": None}},
     "descriptor"),  # a null spec
    ("hello_writer", {"instance": 1, "incarnation": 1, "secret": SECRET, "ring": {"name": 5, "spec": {}}},
     "descriptor"),
    ("hello_writer", {"instance": 1, "incarnation": 1, "secret": SECRET, "ring": {"name": "x"}}, "descriptor"),
    ("hello_reader", {"slots": [{"name": None, "spec": None}], "incarnation": 1, "secret": SECRET}, "descriptor"),
    ("sample", {"slot": 0, "n": 4, "min_version": 0}, "state"),
    ("release", {"index": 0}, "state"),
])
def test_each_message_that_crashed_replay_is_answered_and_the_data_stays(hub, mtype, body, reason):
    sampler, attacker = hub.client("sampler0"), hub.client("sampler0")
    hello_writer(hub, sampler)
    sampler.send("segment", segment(1))
    assert replies(sampler, 1)[0].type == "release"
    raw_send(sampler if mtype == "segment" else attacker, mtype, body)
    [reply] = replies(sampler if mtype == "segment" else attacker, 1)
    assert reply.type == "error" and hub.bad == [reason], (reply.body, hub.bad)
    assert hub.thread.is_alive() and hub.service.table.size > 0
    size = hub.service.table.size
    sampler.send("segment", segment(2, index=1))  # still serving, nothing accepted lost
    assert replies(sampler, 1)[0].body == {"index": 1}
    assert hub.service.table.size > size


def test_a_sampler_the_config_does_not_have_is_refused_before_it_is_registered(hub):
    stranger = hub.client("sampler5")
    hello_writer(hub, stranger, instance=5)  # a valid ring of "sampler 5" in a run of 2 samplers
    [reply] = replies(stranger, 1)
    assert "unknown writer_id 5" in reply.body["reason"] and hub.bad == ["value"]
    assert 5 not in hub.service.writers
    sampler = hub.client("sampler0")
    hello_writer(hub, sampler)
    sampler.send("segment", segment(1))
    assert replies(sampler, 1)[0].type == "release"


def test_batch_slots_of_the_wrong_layout_get_an_error_not_a_crash(hub):
    sampler, learner = hub.client("sampler0"), hub.client("learner0")
    hello_writer(hub, sampler)
    sampler.send("segment", segment(1))
    seg, _, desc = shm.allocate(shm.segment_name(hub.run_id, "learner", 0, "odd"), {"dtype": "<f4", "shape": [3]})
    hub.segments.append(seg)
    learner.send("hello_reader", {"slots": [desc], "incarnation": 1, "secret": SECRET})
    learner.send("sample", {"slot": 0, "n": 4, "min_version": 0})
    [reply] = replies(learner, 1)
    assert reply.type == "error" and "batch slot 0 cannot hold 4 items" in reply.body["reason"]
    assert hub.bad == ["descriptor"] and hub.thread.is_alive()


@pytest.mark.parametrize("serials,new_items", [
    ((1, 2, 3), T * B),  # contiguous: each segment also completes the previous one's open windows
    ((1, 2, 4), (T - N_STEP) * B),  # serial 3 lost: no n-step window may run across the gap
])
def test_a_gap_in_serial_numbers_is_a_seam_for_n_step_returns(hub, serials, new_items):
    sampler = hub.client("sampler0")
    hello_writer(hub, sampler)
    for i, serial in enumerate(serials):
        size = hub.service.table.size if hub.service.table else 0
        sampler.send("segment", segment(serial, index=i % RING))
        assert replies(sampler, 1)[0].type == "release"
    assert hub.service.table.size - size == new_items


def test_episodes_waiting_for_the_learner_are_bounded_the_oldest_dropped_and_counted(hub, monkeypatch):
    monkeypatch.setattr(replay_core, "MAX_UNREPORTED_EPISODES", 3)
    sampler, learner = hub.client("sampler0"), hub.client("learner0")
    hello_writer(hub, sampler)
    for serial in (1, 2):  # four episodes end before the learner asks
        sampler.send("segment", segment(serial, index=serial - 1, episodes=[[float(serial), 3], [serial + 0.5, 3]]))
        assert replies(sampler, 1)[0].type == "release"
    learner.send("hello_reader", {"slots": hub.batch_slots()[0], "incarnation": 1, "secret": SECRET})
    learner.send("sample", {"slot": 0, "n": 4, "min_version": 0})
    [reply] = replies(learner, 1)
    assert reply.type == "sampled" and reply.body["episodes"] == [[1.5, 3], [2, 3], [2.5, 3]]
    assert hub.service.core.episodes_dropped == 1


def test_store_steps_fills_the_learners_slot_with_each_step_of_every_window(exp_and_example, run_id, tmp_path):
    exp, example = exp_and_example
    exp = dataclasses.replace(exp, replay=dataclasses.replace(
        exp.replay, transitions=dataclasses.replace(exp.replay.transitions, store_steps=True)))
    hub = Hub(exp, example, run_id, tmp_path)
    try:
        sampler, learner = hub.client("sampler0"), hub.client("learner0")
        hello_writer(hub, sampler)
        ring = hub.rings[(0, "ring")].samples  # [RING, T, B]: no done, so each window is N_STEP steps
        ring.reward[:] = np.arange(RING * T * B, dtype=np.float32).reshape(RING, T, B)
        ring.action[:] = np.arange(RING * T * B).reshape(RING, T, B) % 3 % 2
        for serial in range(1, RING + 1):
            sampler.send("segment", segment(serial, index=serial - 1))
            assert replies(sampler, 1)[0].type == "release"
        descs, [slot] = hub.batch_slots()
        learner.send("hello_reader", {"slots": descs, "incarnation": 1, "secret": SECRET})
        learner.send("sample", {"slot": 0, "n": 4, "min_version": 0})
        [reply] = replies(learner, 1)
        assert reply.type == "sampled"
        reward, action = ring.reward.reshape(RING * T, B), ring.action.reshape(RING * T, B)  # [step, column]
        for i in range(4):
            [[t], [b]] = np.nonzero(reward == slot.steps.reward[i, 0])
            assert slot.steps.reward[i].tolist() == reward[t:t + N_STEP, b].tolist()
            assert slot.steps.action[i].tolist() == action[t:t + N_STEP, b].tolist()
            assert slot.steps.discount[i].tolist() == pytest.approx(exp.replay.transitions.gamma ** np.arange(N_STEP))
            assert slot.return_[i] == pytest.approx(float((slot.steps.discount[i] * slot.steps.reward[i]).sum()))
        assert np.all(slot.steps.observation == 0.5) and hub.bad == []
    finally:
        hub.close()


def ranked_hub(config_file: str, overrides: list, run_id, tmp_path) -> Hub:
    """A hub for a run of two learner ranks and two samplers of ``B`` envs."""
    exp = config.load(CONFIGS / config_file, ["learner.count=2", "sampler.count=2", f"sampler.envs={B}",
                                              f"sampler.horizon={T}", f"sampler.ring={RING}", *overrides])
    probe = env_probe(exp)
    example = example_step(exp, probe)
    probe.close()
    return Hub(exp, example, run_id, tmp_path)


def attach_ranks(hub: Hub) -> tuple[list, list]:
    """Both ranks say hello with a batch slot each; returns their endpoints and slots."""
    eps, slots = [], []
    for rank in range(2):
        descs, trees = hub.batch_slots(rank=rank)
        ep = hub.client(f"learner{rank}")
        ep.send("hello_reader", {"slots": descs, "incarnation": 1, "secret": SECRET, "rank": rank})
        eps.append(ep)
        slots.append(trees[0])
    wait_for(lambda: len(hub.service.readers) == 2, "both ranks to attach")
    return eps, slots


def test_two_ranks_get_disjoint_env_columns_of_one_on_policy_batch_with_the_same_counters(run_id, tmp_path):
    hub = ranked_hub("cartpole_ppo.toml", ["learner.batch_segments=2"], run_id, tmp_path)
    try:
        samplers = [hub.client(f"sampler{i}") for i in range(2)]
        for i, ep in enumerate(samplers):
            ring = hub.ring(i)
            hello_writer(hub, ep, instance=i, ring=ring)
            wait_for(lambda: i in hub.service.writers, f"sampler {i} to attach")
            # each env column of each sampler's segment carries its own reward: 10 * sampler + column
            hub.service.writers[i].ring.samples.reward[0] = 10 * i + np.arange(B)
            ep.send("segment", segment(1, episodes=[[float(i), 3]]))
        (rank0, rank1), (slot0, slot1) = attach_ranks(hub)
        rank0.send("sample", {"slot": 0, "n": 2, "min_version": 0})
        assert replies(rank0, 1, timeout_ms=300) == []  # a round waits for every rank
        rank1.send("sample", {"slot": 0, "n": 2, "min_version": 0})
        [got0], [got1] = replies(rank0, 1), replies(rank1, 1)
        assert got0.type == got1.type == "sampled"
        assert got0.body == got1.body  # the same counters: the same books on every rank
        assert got0.body["env_steps"] == 2 * T * B and sorted(got0.body["episodes"]) == [[0.0, 3], [1.0, 3]]
        assert slot0.samples.reward.shape == slot1.samples.reward.shape == (T, B)
        columns = np.concatenate([slot0.samples.reward[0], slot1.samples.reward[0]])
        assert sorted(columns.tolist()) == [0, 1, 10, 11]  # every column once, none on both ranks
    finally:
        hub.close()


def test_off_policy_ranks_each_get_a_sample_of_their_own_and_both_send_priorities(run_id, tmp_path):
    hub = ranked_hub("cartpole_dqn.toml", ["replay.capacity=1000", "replay.min_size_to_sample=1",
                                           f"replay.n_step={N_STEP}", "replay.samples_per_insert=0.0",
                                           "replay.table='prioritized'", "algo.batch_size=4"], run_id, tmp_path)
    try:
        sampler = hub.client("sampler0")
        hello_writer(hub, sampler)
        sampler.send("segment", segment(1))
        assert replies(sampler, 1)[0].type == "release"
        (rank0, rank1), _ = attach_ranks(hub)
        for ep in (rank0, rank1):
            ep.send("sample", {"slot": 0, "n": 4, "min_version": 0})
        [got0], [got1] = replies(rank0, 1), replies(rank1, 1)
        assert got0.body["env_steps"] == got1.body["env_steps"] == T * B and len(got0.body["keys"]) == 4
        before = hub.service.table.counts.priority_updates
        for ep, got in ((rank0, got0), (rank1, got1)):
            ep.send("priorities", {"keys": got.body["keys"], "generations": got.body["generations"],
                                   "priorities": [2.0] * 4})
        wait_for(lambda: hub.service.table.counts.priority_updates - before == 8, "both ranks' priorities")
        assert hub.bad == []
    finally:
        hub.close()


def test_peers_on_another_node_send_segments_and_get_batches_as_frames(exp_and_example, run_id, tmp_path):
    """Samplers and learner placed on other nodes: nothing is mapped, every array travels in
    the messages; a segment whose frames do not fit the layout is refused, nothing lost."""
    exp, example = exp_and_example
    exp = dataclasses.replace(exp, placement=dataclasses.replace(exp.placement, sampler="b", learner="c"))
    hub = Hub(exp, example, run_id, tmp_path)
    try:
        sampler, learner = hub.client("sampler0"), hub.client("learner0")
        hello_writer(hub, sampler)
        ring = hub.rings[(0, "ring")]
        ring.samples.reward[0] = 3.0
        sampler.send("segment", segment(1), arrays=[leaf for _, leaf in leaves(ring[0])])
        assert replies(sampler, 1)[0].body == {"index": 0}
        size = hub.service.table.size
        assert hub.service.writers[0].segment is None and size > 0  # inserted from the frames, not mapped
        sampler.send("segment", segment(2, index=1), arrays=[leaf for _, leaf in leaves(ring[1])][:-1])
        [reply] = replies(sampler, 1)
        assert reply.type == "error" and "segment 2's arrays" in reply.body["reason"] and hub.bad == ["value"]
        assert hub.service.table.size == size

        spec = batch_spec(exp, example)
        learner.send("hello_reader", {"slots": [{"name": "on-another-node", "spec": spec}], "incarnation": 1,
                                      "secret": SECRET})
        learner.send("sample", {"slot": 0, "n": 4, "min_version": 0})
        [reply] = replies(learner, 1)
        assert reply.type == "sampled" and hub.service.readers[0].segments == []
        batch = from_leaves(spec, reply.arrays)
        assert np.all(batch.observation == 0.5) and np.all(batch.return_ >= 3.0)  # the first step's reward, 3
    finally:
        hub.close()
