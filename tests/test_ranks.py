"""Data-parallel learner ranks (shared/transport/ranks.py): two processes, one gloo group, each training
on a batch of its own; after every update both hold bit-identical parameters."""

from __future__ import annotations

import multiprocessing as mp
import queue
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from shared.config import loading as config
from services.build import batch_spec, env_probe, example_step, make_agent, make_algo
from shared.data.namedarraytuple import from_spec, map_leaves, torchify
from tests.pipeline import CONFIGS

UPDATES = 3


def random_batch(exp, example, seed: int):
    """A batch slot of the experiment's layout filled with random, valid-typed data."""
    rng = np.random.default_rng(seed)

    def fill(leaf):
        if leaf.dtype.kind == "f":
            leaf[...] = rng.uniform(0.0, 1.0, leaf.shape)
        elif leaf.dtype.kind == "b":
            leaf[...] = rng.random(leaf.shape) < 0.1
        else:
            leaf[...] = rng.integers(0, 2, leaf.shape)  # discrete actions of CartPole, versions
        return leaf

    return map_leaves(fill, from_spec(batch_spec(exp, example)))


def train_rank(rank: int, run_dir: str, config_file: str, averaged: bool, out) -> None:
    import torch

    from shared.transport import ranks

    torch.set_num_threads(1)
    exp = config.load(CONFIGS / config_file, ["learner.count=2"])
    probe = env_probe(exp)
    agent = make_agent(exp, probe)
    algo = make_algo(exp, agent)
    batch = torchify(random_batch(exp, example_step(exp, probe), seed=rank))  # each rank its own data
    group = ranks.join(Path(run_dir), rank, 2, torch.device("cpu"), 60.0) if averaged else None
    sums = []
    for _ in range(UPDATES):
        algo.update(batch, 0.1)
        sums.append(ranks.parameter_checksum(agent))
    out.put((rank, sums))
    if group is not None:
        group.close()


def impala_rank(rank: int | None, run_dir: str, out) -> None:
    """IMPALA's first update of test_vtrace's bandit batch (4 x 32), without clipping: the whole
    batch (rank None) or rank ``rank``'s half of its columns in a group of two."""
    import torch

    from shared.agents.pg import PgAgent
    from shared.algos import registry
    from shared.algos.hparams import ImpalaConfig
    from shared.data.batches import column_share
    from shared.transport import ranks
    from tests import test_pg_algos

    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same agent and batch in every process
    agent = PgAgent(test_pg_algos.OBS, gym.spaces.Discrete(2))
    batch = test_pg_algos.bandit_batch(agent, 4, 32, test_pg_algos.match_context, seed=0)
    algo = registry.resolve("impala").make(agent, ImpalaConfig(max_grad_norm=0.0))
    if rank is None:
        out.put((rank, algo.update(batch, 0.0).stats["grad_norm"]))
        return
    group = ranks.join(Path(run_dir), rank, 2, torch.device("cpu"), 60.0)
    out.put((rank, algo.update(column_share(batch, rank, 2), 0.0).stats["grad_norm"]))
    group.close()


def rank_worker(rank: int, tasks, out) -> None:
    """Rank ``rank`` of the module's pair: runs ``target(rank, *args, out)`` for each ``(target, args)``
    from ``tasks`` until None; a task that raises puts ``(rank, FAILED, traceback)`` and ends it."""
    import traceback

    while (task := tasks.get()) is not None:
        target, args = task
        try:
            target(rank, *args, out)
        except BaseException:
            out.put((rank, FAILED, traceback.format_exc()))
            raise


FAILED = "failed"


@pytest.fixture(scope="module")
def rank_pair():
    """Two spawned rank processes for the whole module (each start imports torch and the agents:
    seconds on 2 cores): ``rank_pair(target, *args)`` runs ``target(rank, *args, out)`` on ranks 0
    and 1 and returns what each put in ``out``, by rank. Every task joins (and closes) a group of
    its own, in its own run directory."""
    ctx = mp.get_context("spawn")
    out, tasks = ctx.Queue(), [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=rank_worker, args=(rank, tasks[rank], out)) for rank in (0, 1)]
    for p in procs:
        p.start()

    def run(target, *args) -> dict:
        assert all(p.is_alive() for p in procs), "a rank process of the module ended after a failed task"
        for q in tasks:
            q.put((target, args))
        try:
            got = [out.get(timeout=120) for _ in procs]
        except queue.Empty:
            pytest.fail("the two ranks did not finish their updates within 120 s")
        failed = [g[2] for g in got if len(g) == 3 and g[1] == FAILED]
        assert not failed, "\n".join(failed)
        return dict(got)

    yield run
    for q in tasks:
        q.put(None)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def run_ranks(rank_pair, config_file: str, run_dir: Path, averaged: bool = True) -> list[list[int]]:
    got = rank_pair(train_rank, str(run_dir), config_file, averaged)
    return [got[0], got[1]]


@pytest.mark.parametrize("config_file", ["cartpole_ppo.toml", "cartpole_dqn.toml", "pendulum_sac.toml"])
def test_two_ranks_hold_bit_identical_parameters_after_every_update(rank_pair, config_file, tmp_path):
    rank0, rank1 = run_ranks(rank_pair, config_file, tmp_path)
    assert rank0 == rank1, "the ranks' parameters differ after an update"
    assert len(set(rank0)) == UPDATES  # the parameters did change at every update


def test_without_the_group_the_same_ranks_drift_apart(rank_pair, tmp_path):
    """The check above can fail: on their different batches, unaveraged ranks diverge at once."""
    rank0, rank1 = run_ranks(rank_pair, "cartpole_ppo.toml", tmp_path, averaged=False)
    assert all(a != b for a, b in zip(rank0, rank1))


def test_impalas_summed_loss_is_the_whole_batchs_over_two_ranks(rank_pair, tmp_path):
    """Each rank sums its half and the group averages the gradients: the ranks' step must be the
    whole batch's sum, as one learner takes it (twice the average of the halves' sums)."""
    whole = queue.Queue()
    impala_rank(None, str(tmp_path), whole)
    got = rank_pair(impala_rank, str(tmp_path))
    assert got[0] == got[1] == pytest.approx(whole.get()[1], rel=1e-5)
