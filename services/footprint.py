"""What a run holds in /dev/shm and writes to its run directory, from the layouts the services allocate.

The launcher checks these against the free space before it starts anything
(``shared.launch.space``). Every size comes from the function the service itself sizes its
segments with: the sampler's ``segment_specs``, the learner's ``batch_spec``, the replay
table composed over a ``Footprint`` arena (``replay.persist``: its state lives in shared
memory). The learner's params segment is left out: its size is the model's, and the launcher
does not build the model (it does not import torch: docs/benchmarks.md, "Start-up and stop");
a params segment that does not fit is the learner's one-line NoSpace at start-up.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

from shared.config.schema import Experiment
from shared.data.layout import segment_spec
from shared.data.namedarraytuple import spec_nbytes
from shared.replay.arena import Footprint
from shared.runtime.metrics import MULTIPROC_FILE_BYTES, MULTIPROC_FILES

from services.build import batch_spec, env_probe, example_step, round_items
from services.replay.tables import make_table
from services.sampler.sampler import segment_specs
from shared.config.topology import topology

PAGE = mmap.PAGESIZE
RUN_DIR_FLOOR = 16 << 20
"""Bytes the run directory needs beyond what is counted (logs, checkpoints, CSV rows, TensorBoard)."""


@dataclass(frozen=True)
class Needs:
    """Bytes a run needs, by what for (each a page-rounded sum of segment or file sizes)."""

    shm: dict[str, int]
    """/dev/shm: ``sampler rings and slots``, ``learner batch slots``, ``replay table``."""
    run_dir: dict[str, int]
    """The run directory: ``metrics files``, ``replay snapshots``, ``logs, checkpoints, CSV``."""


def pages(nbytes: int) -> int:
    """What a file of ``nbytes`` takes on tmpfs: whole pages."""
    return -(-nbytes // PAGE) * PAGE


def needs(exp: Experiment, processes: int) -> Needs:
    """What ``exp`` needs, ``processes``: how many processes record metrics (each its files)."""
    probe = env_probe(exp)
    try:
        example = example_step(exp, probe)
    finally:
        probe.close()
    sampler = sum(pages(spec_nbytes(spec)) for spec in segment_specs(exp.sampler, example).values())
    learner = pages(spec_nbytes(batch_spec(exp, example))) * exp.learner.prefetch * exp.learner.count
    sizes = table_sizes(exp, example) if exp.replay.persist else {}
    table = sum(pages(n) for n in sizes.values())
    shm = {"sampler rings and slots": sampler * exp.sampler.count, "learner batch slots": learner,
           "replay table": table}
    # A snapshot is written beside the last one before it replaces it: two copies at once.
    snapshots = 2 * sum(sizes.values()) if exp.replay.snapshot_interval_s else 0
    run_dir = {"metrics files": processes * MULTIPROC_FILES * MULTIPROC_FILE_BYTES, "replay snapshots": snapshots,
               "logs, checkpoints, CSV": RUN_DIR_FLOOR}
    return Needs({k: v for k, v in shm.items() if v}, {k: v for k, v in run_dir.items() if v})


def table_sizes(exp: Experiment, example) -> dict[str, int]:
    """Bytes of each segment of the run's replay table (``ShmArena``'s, by purpose)."""
    arena = Footprint()
    spec = segment_spec(example, exp.sampler.horizon, exp.sampler.envs)  # what a sampler's hello shows replay
    make_table(exp.replay, topology(exp).columns(), spec, round_items(exp), exp.run.seed, arena)
    return arena.sizes
