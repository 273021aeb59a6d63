"""Separate networks per agent group (``env.groups``): an agent holds one identically built
member a group (an ``nn.ModuleList``) and routes each row of a batch to its group's member by
the observation's ``agent_group`` leaf, which no network reads as a feature.

``by_group`` runs each member on its own group's rows only: it gathers them (every leaf of the
inputs indexed alike), runs the member and puts its outputs back in row order, so each row goes
through its own member's networks alone, not all K, and a row's gradient reaches its group's
member only. That split has data-dependent shapes, so where the shapes must stay fixed (a trace
or an export: TorchScript, torch.export, ONNX) every member runs on all rows instead and
``routed`` keeps, for each row, its own group's output with ``torch.where``: K is small (the
kinds of agents in an env), the graph exports, and the gradient is routed alike. Tensors on an
accelerator take that path too (splitting reads the groups' row counts back, a device sync every
forward pass), and so do batches too small for the split to pay (``SPLIT_MIN_ROWS``). Both paths
give a row the same outputs, up to float rounding (a member's pass over fewer rows may round
otherwise). So the algorithm, its one optimizer, the parameter segment and checkpoints see one
module as ever.

A recurrent agent's state is routed the same way. The agent keeps one acting memory, and a
column's state in it is its own group's member's; each member steps its rows from it and each
row keeps its own member's new state, which is what goes into the agent info. A column is one
agent, so its group, and the member whose state it carries, never changes along a sequence: the
learner's sequences [T, B] are split by column, and each member runs its columns from their
stored state. (On the fixed-shape path every member runs every column from the stored state, and
the other members' outputs on a column, computed from a state not theirs, are dropped by the
routing.)
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Callable, Iterator

import gymnasium as gym
import numpy as np
import torch

from shared.data.namedarraytuple import leaves, map_leaves
from shared.envs.pettingzoo_backend import GROUP_KEY

def group_count(obs_space: gym.Space | None) -> int:
    """K, the agent groups of an observation space with an ``agent_group`` leaf (``Discrete(K)``), else 0."""
    if isinstance(obs_space, gym.spaces.Dict) and GROUP_KEY in obs_space.spaces:
        return int(obs_space.spaces[GROUP_KEY].n)
    return 0


def members(groups: int, make) -> torch.nn.ModuleList:
    """K members built by ``make()``."""
    return torch.nn.ModuleList(make() for _ in range(groups))


SPLIT_MIN_ROWS = 64
"""Rows below which ``by_group`` runs every member on every row even in eager mode: on a few rows
a member's pass costs the same whatever their number, and the split's own bookkeeping is not
repaid (docs/benchmarks.md, "Agent groups in the learner")."""

_split_min_rows: contextvars.ContextVar[float] = contextvars.ContextVar("split_min_rows", default=SPLIT_MIN_ROWS)


@contextlib.contextmanager
def split_min_rows(rows: float) -> Iterator[None]:
    """Within it (in this thread or task: a context variable), ``by_group`` splits from ``rows``
    rows instead of ``SPLIT_MIN_ROWS``: ``math.inf`` takes the fixed-shape path (every member on
    every row) as a trace or an export does, 0 splits every batch; for tests and benchmarks to
    compare the two paths in eager mode."""
    token = _split_min_rows.set(rows)
    try:
        yield
    finally:
        _split_min_rows.reset(token)


def by_group(members: torch.nn.ModuleList, run: Callable, group: torch.Tensor, *inputs,
             dim: int | tuple = 0, out_dim: int | tuple | None = None, row_cost: int = 1):
    """Each row's own group's member's outputs of ``run(member, *inputs)`` (a tensor or a tuple of
    tensors), each row run by its own member only where the shapes need not stay fixed and the
    split pays.

    ``group`` int [*L]: the rows' groups (a value that is no member's index is member 0's, as in
    ``routed``). ``inputs``: trees (namedarraytuples, tensors, None) whose rows [*L] start at dim
    ``dim``, one for all or one an input, None for an input every member gets whole. The outputs'
    rows start at ``out_dim`` (default ``dim``; one for all or one an output), with any trailing
    shape. E.g. [N] rows at 0; [T, B] at 0 (feed-forward: each step its own row); sequences [T, B, ...]
    split by column: ``group`` [B] at 1. The split pays from ``SPLIT_MIN_ROWS`` rows of the first
    split input's leading dims (T * B for sequences), each weighing ``row_cost``.
    """
    dims = dim if isinstance(dim, tuple) else (dim,) * len(inputs)
    outs_dim = dim if out_dim is None else out_dim
    split = _rows_by_group(group, len(members)) if _pays(group, inputs, dims, row_cost) else None
    if split is None:
        outs = [run(member, *inputs) for member in members]
        return _joined(outs, outs_dim, lambda parts, d: routed(parts, group.reshape(*(1,) * d, *group.shape)))
    order, counts, back = split
    last = group.dim() - 1  # rows [*L] are split as one flattened dim

    def rows_of(x, d, rows):
        return x if d is None else map_leaves(lambda leaf: leaf.flatten(d, d + last).index_select(d, rows), x)

    # A member whose group has no rows runs too, on none: its parameters get a zero gradient as on
    # the torch.where path, so Adam moves them alike and data-parallel ranks all-reduce the same tensors.
    outs = [run(member, *(rows_of(x, d, rows) for x, d in zip(inputs, dims)))
            for member, rows in zip(members, torch.split(order, counts))]
    return _joined(outs, outs_dim,
                   lambda parts, d: torch.cat(parts, d).index_select(d, back).unflatten(d, group.shape))


def _pays(group: torch.Tensor, inputs: tuple, dims: tuple, row_cost: int) -> bool:
    """Whether to split: in eager mode (a trace or an export keeps fixed shapes), on the CPU (splitting
    an accelerator's rows would read their counts back, a device sync every forward pass), from
    ``SPLIT_MIN_ROWS`` rows (``split_min_rows``'s within it) of the first input that is split."""
    if group.device.type != "cpu" or torch.jit.is_tracing() or torch.jit.is_scripting() or \
            torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export():
        return False
    x, d = next((x, d) for x, d in zip(inputs, dims) if d is not None)
    return math.prod(next(leaves(x))[1].shape[:d + group.dim()]) * row_cost >= _split_min_rows.get()


def _rows_by_group(group: torch.Tensor, k: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """The rows of ``group`` [*L] (on the CPU, flattened: R rows) in group order (int64 [R]), each
    group's count [K], and where each row is in that order (int64 [R]). In numpy: on a few hundred
    rows its calls cost a fraction of torch's."""
    g = group.numpy().reshape(-1)
    g = np.where((g > 0) & (g < k), g, 0)  # routed's rule: any other value is member 0's
    order = np.argsort(g, kind="stable")
    back = np.empty_like(order)
    back[order] = np.arange(len(order))
    return torch.from_numpy(order), np.bincount(g, minlength=k).tolist(), torch.from_numpy(back)


def _joined(outs: list, out_dim: int | tuple, join: Callable):
    """``join(parts, d)`` over the members' outputs ``outs`` (each a tensor or a tuple of them,
    joined position by position), output i's rows along ``out_dim`` (or ``out_dim[i]``)."""
    if not isinstance(outs[0], tuple):
        return join(outs, out_dim)
    dims = out_dim if isinstance(out_dim, tuple) else (out_dim,) * len(outs[0])
    return tuple(join(list(parts), d) for parts, d in zip(zip(*outs), dims))


def routed(outs: list[torch.Tensor], group: torch.Tensor) -> torch.Tensor:
    """Each row's own group's output: ``outs`` K tensors alike [*L, ...] (member k's on every row),
    ``group`` int [*L] (or broadcasting to it) -> [*L, ...], row r from ``outs[group[r]]`` (``outs[0]``
    where ``group[r]`` is no member's)."""
    group = group.reshape(*group.shape, *(1,) * (outs[0].dim() - group.dim()))
    out = outs[0]
    for k, other in enumerate(outs[1:], start=1):
        out = torch.where(group == k, other, out)
    return out
