"""Data-parallel learner ranks (``learner.count`` > 1): one ``torch.distributed`` group.

Rendezvous: rank 0 hosts the group's store on a free loopback port and writes that port, with
its pid, to ``<run>/learner.rendezvous``; the other ranks wait for the file to name a live
rank 0, and join. The backend is gloo on CPU and nccl on CUDA.

A rank that dies takes the group with it, and the group starts again together: gloo fails the
next collective of every other rank at once ("Connection closed by peer"), and a rank that
waits for a batch instead sees within its poll that a peer's pid is gone. Either way the rank
raises ``RankLost``, exits non-zero without writing a checkpoint, and supervisord restarts it;
the ranks meet again and every one resumes from rank 0's latest checkpoint. Ranks find each
other's pids on this host: the group spans one workstation.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shared.runtime.process import pid_alive

log = logging.getLogger(__name__)
RENDEZVOUS = "learner.rendezvous"
HOST = "127.0.0.1"


class RankLost(RuntimeError):
    """A rank of the group is gone: this one must restart with the group."""


class Group:
    """This process's place in the learner group: its rank, the world size, its peers' pids,
    and the device its collectives run on (nccl takes CUDA tensors only)."""

    def __init__(self, rank: int, world: int, pids: list[int], device: torch.device):
        self.rank, self.world, self.pids, self.device = rank, world, pids, device

    def check_peers(self) -> None:
        """RankLost when a peer's process is gone (killed, or restarted under another pid)."""
        for rank, pid in enumerate(self.pids):
            if rank != self.rank and not pid_alive(pid):
                raise RankLost(f"learner rank {rank} (pid {pid}) is gone; restarting with the group")

    def broadcast(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (a decision that must be the same everywhere)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(t, 0)
        return int(t.item())

    def checksums(self, module: torch.nn.Module) -> list[int]:
        """The CRC-32 of ``module``'s parameters and buffers on every rank, rank order."""
        local = torch.tensor([parameter_checksum(module)], dtype=torch.int64, device=self.device)
        gathered = [torch.zeros_like(local) for _ in range(self.world)]
        dist.all_gather(gathered, local)
        return [int(t.item()) for t in gathered]

    def check_identical(self, module: torch.nn.Module, when: str) -> int:
        """RuntimeError unless every rank holds the same parameters; returns their checksum."""
        sums = self.checksums(module)
        if len(set(sums)) != 1:
            raise RuntimeError(f"learner ranks hold different parameters {when}: checksums {sums}")
        return sums[0]

    def close(self) -> None:
        dist.destroy_process_group()


def parameter_checksum(module: torch.nn.Module) -> int:
    """CRC-32 of the bytes of ``module``'s state (parameters and buffers, in order)."""
    crc = 0
    for value in module.state_dict().values():
        crc = zlib.crc32(np.ascontiguousarray(value.detach().cpu().numpy()).view(np.uint8), crc)
    return crc


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of learner rank ``rank``: on CUDA each rank its own GPU (rank mod the GPUs),
    as nccl needs; the CPU is shared."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", rank % torch.cuda.device_count())


def join(run_dir: Path, rank: int, world: int, device: torch.device, timeout_s: float) -> Group:
    """Join the run's learner group as ``rank`` of ``world`` on ``device`` (``rank_device``);
    RuntimeError after ``timeout_s`` without the whole group."""
    path = run_dir / RENDEZVOUS
    timeout = datetime.timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        store = dist.TCPStore(HOST, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": store.port, "pid": os.getpid()}))
        os.replace(tmp, path)
    else:
        store = _connect(path, world, timeout, deadline)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # nccl's communicator binds to the current device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=timeout)
    pids = torch.zeros(world, dtype=torch.int64, device=device)
    pids[rank] = os.getpid()
    dist.all_reduce(pids)
    log.info("learner rank %d of %d joined the group (pids %s)", rank, world, pids.tolist())
    return Group(rank, world, pids.tolist(), device)


def _connect(path: Path, world: int, timeout: datetime.timedelta, deadline: float) -> dist.TCPStore:
    """The store of the live rank 0 that ``path`` names, once there is one."""
    while True:
        try:
            where = json.loads(path.read_text())
            if pid_alive(where["pid"]):
                return dist.TCPStore(HOST, where["port"], world, is_master=False, timeout=timeout)
        except (FileNotFoundError, json.JSONDecodeError, KeyError, RuntimeError):
            pass  # not written yet, half written, or a rank 0 that died since: wait for the next one
        if time.monotonic() > deadline:
            raise RuntimeError(f"no learner rank 0 to join within {timeout.total_seconds():.0f} s ({path})")
        time.sleep(0.05)

