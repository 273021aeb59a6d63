"""The sampler <-> action-server doorbell: no lost wake-up, no crossed replies, dead peers seen."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.transport.doorbell import STEP_MOD, PeerGone, SamplerBell, ServerBell
from tests.pipeline import REPO

SLOTS = 2


class World:
    """K samplers with SLOTS step slots each, their bells, and one server end per sampler."""

    def __init__(self, directory, k: int):
        self.samplers = [SamplerBell(directory, f"sampler{i}") for i in range(k)]
        self.servers = [ServerBell(directory, f"sampler{i}") for i in range(k)]
        for bell in self.samplers:
            bell.connect()
        # the "step slots": what the server writes as actions, per sampler and slot
        self.actions = np.full((k, SLOTS), -1, np.int64)
        self.step = np.zeros((k, SLOTS), np.int64)
        self.outstanding = [set() for _ in range(k)]
        self.pending: list[tuple[int, int, int]] = []  # server side: (sampler, slot, step)
        self.answered = 0

    def close(self):
        for bell in self.servers + self.samplers:
            bell.close()


def _code(sampler: int, slot: int, step: int) -> int:
    return (sampler * SLOTS + slot) * 1_000_003 + step


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 4), ops=st.lists(st.tuples(st.sampled_from(["ring", "serve", "wait"]),
                                                   st.integers(0, 3), st.integers(0, SLOTS - 1),
                                                   st.randoms(use_true_random=False)), max_size=60))
def test_interleaved_rings_and_replies_lose_no_wakeup_and_never_cross(tmp_path_factory, k, ops):
    world = World(tmp_path_factory.mktemp("bells"), k)
    try:
        for op, who, slot, rnd in ops:
            who %= k
            if op == "ring" and slot not in world.outstanding[who]:
                world.step[who, slot] += 1
                world.outstanding[who].add(slot)
                world.samplers[who].ring(slot, int(world.step[who, slot]))
            elif op == "serve":
                # the server takes whatever rang, from every bell, then answers a random subset in random order
                for s, bell in enumerate(world.servers):
                    world.pending += [(s, sl, st_) for sl, st_ in bell.read()]
                rnd.shuffle(world.pending)
                cut = rnd.randint(0, len(world.pending))
                for s, sl, st_ in world.pending[:cut]:
                    world.actions[s, sl] = _code(s, sl, st_)
                    world.servers[s].reply(sl, st_, version=st_ + 1000)
                world.pending = world.pending[cut:]
            elif op == "wait":
                _take_replies(world, who, timeout_ms=0)
        # Drain: every outstanding request must be answered to its own sampler.
        for s, bell in enumerate(world.servers):
            world.pending += [(s, sl, st_) for sl, st_ in bell.read()]
        for s, sl, st_ in world.pending:
            world.actions[s, sl] = _code(s, sl, st_)
            world.servers[s].reply(sl, st_, version=st_ + 1000)
        for who in range(k):
            deadline = time.monotonic() + 5
            while world.outstanding[who] and time.monotonic() < deadline:
                _take_replies(world, who, timeout_ms=100)
            assert not world.outstanding[who], f"sampler {who} lost the wake-up of slots {world.outstanding[who]}"
    finally:
        world.close()


def _take_replies(world: World, who: int, timeout_ms: float) -> None:
    for slot, step, version in world.samplers[who].wait(timeout_ms):
        assert slot in world.outstanding[who], f"sampler {who} got a reply for slot {slot} it did not ring"
        assert step == world.step[who, slot] % STEP_MOD and version == step + 1000
        # The actions in its slot are its own, for this very step.
        assert world.actions[who, slot] == _code(who, slot, step)
        world.outstanding[who].discard(slot)


def test_steps_wrap_around_the_record_width(tmp_path):
    world = World(tmp_path, 1)
    try:
        world.samplers[0].ring(1, STEP_MOD + 5)
        assert world.servers[0].read() == [(1, 5)]
        world.servers[0].reply(1, STEP_MOD + 5, version=7)
        assert world.samplers[0].wait(1000) == [(1, 5, 7)]
    finally:
        world.close()


SAMPLER = """
import sys, time
from shared.transport.doorbell import SamplerBell
bell = SamplerBell(sys.argv[1], "sampler0")
print("ready", flush=True)
sys.stdin.readline()
bell.connect()
bell.ring(0, 1)
print("rang", flush=True)
time.sleep(60)
"""


def test_a_sampler_killed_mid_step_is_seen_at_once_by_the_server(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SAMPLER, str(tmp_path)], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        server = ServerBell(tmp_path, "sampler0")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "rang"
        assert server.read() == [(0, 1)]
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        poller = select.poll()
        poller.register(server.fileno(), select.POLLIN)
        assert poller.poll(5000), "the server's end did not wake up when the sampler died"
        with pytest.raises(PeerGone):
            server.read()
        assert time.monotonic() - t0 < 1.0
        # A dying process closes its files one at a time: the request FIFO's end may be closed (what
        # woke the poll) while the reply FIFO's read end is still open. Once it is reaped, none is.
        proc.wait(timeout=5)
        with pytest.raises(PeerGone):
            server.reply(0, 1, 0)  # nobody reads the replies any more: EPIPE, not a crash
        server.close()
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_server_is_seen_by_the_sampler(tmp_path):
    sampler = SamplerBell(tmp_path, "sampler0")
    server = ServerBell(tmp_path, "sampler0")
    sampler.connect()
    server.close()  # what the kernel does for a killed action-server
    with pytest.raises(PeerGone):
        sampler.ring(0, 1)
    with pytest.raises(PeerGone):
        sampler.wait(1000)
    sampler.close()
    assert list(tmp_path.iterdir()) == []  # the sampler removes its FIFOs


def test_the_server_refuses_a_symlink_or_a_plain_file_in_place_of_a_fifo(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "sampler0.req").symlink_to(victim)
    os.mkfifo(tmp_path / "sampler0.rep")
    with pytest.raises(PeerGone, match="symbolic link"):
        ServerBell(tmp_path, "sampler0")
    (tmp_path / "sampler0.req").unlink()
    (tmp_path / "sampler0.req").write_text("")
    with pytest.raises(PeerGone, match="not a FIFO"):
        ServerBell(tmp_path, "sampler0")
    assert victim.read_text() == "keep me"
