"""Ranks agree on when iterable data ends (join-style), and the data-parallel layout of a loader.

An ``IterableDataset`` shards itself, so its ranks may hold different numbers of batches. A rank that
stops while the others go on leaves them waiting in the next gradient all-reduce: a hang until the
collective timeout, or worse, a step some ranks never take. :func:`join_batches` reads one optimizer
step of micro-batches ahead, all-gathers how many it got (one int per rank and step) and lets every rank
yield the same number; when the counts differ, the surplus is dropped with a warning naming the ranks and
counts (or, with ``uneven="error"``, every rank raises the same :class:`DataError`). Map-style data through
:class:`ElasticDistributedSampler` is even by construction (every rank gets ``epoch_length / dp_size``
samples) and needs none of this.
"""
from __future__ import annotations

import itertools
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist

from torchloom.data.sampler import DataError

__all__ = ["UNEVEN_POLICIES", "dp_layout", "join_batches", "group_rank"]

UNEVEN_POLICIES = ("drop", "error")
_FAILED = -1  # a rank could not even restore its position: everyone raises


def group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group)


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of ``group`` (None: the default group); 1 without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def join_batches(batches: Iterator[Any], *, group: dist.ProcessGroup | None, per_step: int, uneven: str,
                 epoch: int, skip_error: DataError | None = None) -> Iterator[Any]:
    """Yield ``batches`` for as long as every rank of ``group`` has them (collective, once per step).

    Every ``per_step`` micro-batches (one optimizer step) each rank reads up to ``per_step`` batches and the
    group all-gathers the numbers. Equal numbers: yield them (a short equal chunk ends the pass on every
    rank, as without this check). Different numbers: every rank yields the smallest number, then ends;
    ``uneven="drop"`` warns (on group rank 0) with every rank's count, ``uneven="error"`` raises
    :class:`DataError` with them on every rank. ``skip_error`` (this rank failed to restore its position)
    is raised on every rank, naming this rank, instead of leaving the others waiting.
    """
    yielded = 0
    while True:
        chunk = [] if skip_error is not None else list(itertools.islice(batches, per_step))
        mine = torch.tensor([_FAILED if skip_error is not None else len(chunk)], dtype=torch.int64)
        counts = [torch.zeros_like(mine) for _ in range(group_size(group))]
        dist.all_gather(counts, mine, group=group)
        lens = [int(c) for c in counts]
        if _FAILED in lens:
            if skip_error is not None:
                raise skip_error
            bad = [r for r, n in enumerate(lens) if n == _FAILED]
            raise DataError(f"ranks {bad} could not restore their data position in epoch {epoch} (see their "
                            "error); every rank stops so none waits in a collective.")
        if len(set(lens)) == 1:
            yield from chunk
            if lens[0] < per_step:
                return
            yielded += per_step
            continue
        keep = min(lens)
        _uneven(lens, yielded, per_step, keep, uneven, epoch, group)
        yield from chunk[:keep]
        return


def _uneven(lens: list[int], yielded: int, per_step: int, keep: int, uneven: str, epoch: int, group) -> None:
    ended = [r for r, n in enumerate(lens) if n < per_step]
    have = {r: f"{yielded + n}{'+' if n == per_step else ''}" for r, n in enumerate(lens)}
    what = (f"iterable data ended unevenly in epoch {epoch}: rank(s) {ended} ran out of batches; batches per "
            f"rank (group order; '+' = had more): {have}")
    if uneven == "error":
        raise DataError(f"{what}. Give every rank the same number of batches (shard evenly, e.g. truncate each "
                        "shard to the shortest), or use uneven='drop' to stop every rank together.")
    if group_rank(group) == 0:
        warnings.warn(f"{what}. Every rank stopped after {yielded + keep} batches so none waits in a collective; "
                      "the other ranks' remaining batches of this pass are dropped. Shard the data evenly to train "
                      "on all of it (or pass uneven='error' to stop with an error).", stacklevel=3)


def dp_layout(*, mesh: Any = None, group: dist.ProcessGroup | None = None, dp_rank: int | None = None,
              dp_size: int | None = None) -> tuple[int, int, dist.ProcessGroup | None]:
    """``(dp_rank, dp_size, group)`` from a ``ParallelMesh`` (its ``dp`` view), a process group, explicit
    numbers, or the default group (one process without one).

    Raises:
        DataError: only one of ``dp_rank``/``dp_size``, or a rank outside ``[0, dp_size)``.
    """
    if mesh is not None:
        size = mesh.dp_size
        return mesh.dp_rank, size, (mesh.group("dp") if size > 1 else None)
    initialised = dist.is_available() and dist.is_initialized()
    if group is not None:
        return dist.get_rank(group), dist.get_world_size(group), group
    if (dp_rank is None) != (dp_size is None):
        raise DataError("give both dp_rank and dp_size (or a mesh/group), not one of them.")
    if dp_rank is None:
        return (dist.get_rank(), dist.get_world_size(), None) if initialised else (0, 1, None)
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank must be an int in [0, {dp_size}), got {dp_rank!r}.")
    return dp_rank, dp_size, None
