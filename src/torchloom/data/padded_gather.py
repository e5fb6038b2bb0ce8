"""``gather_for_metrics`` for a plain ``DataLoader`` over ``torch.utils.data.DistributedSampler``.

That sampler (``drop_last=False``) pads its index list to ``total_size = num_samples * num_replicas`` by
repeating its first indices, and gives rank ``r`` the positions ``r, r + R, r + 2R, ...`` (``R`` replicas). So
rank ``r``'s local row ``i`` is position ``i * R + r`` of the padded list, and the positions ``>= len(dataset)``
are the repeats (fewer than ``R``, each the last row of a rank). Interleaving the ranks' rows of a step
(row-major, rank-minor) lists positions in increasing order; cutting at ``len(dataset)`` drops exactly the
repeats. This is Accelerate's ``gradient_state.remainder`` for this sampler's layout.

Which rows a call holds is counted per loader on this process (rows gathered so far in the epoch, reset when
the epoch is complete), unless a call passes the whole epoch of this rank at once.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DistributedSampler

from torchloom.data.eval import _flatten, _unflatten, gather_rows
from torchloom.data.sampler import DataError
from torchloom.parallel.mesh import current_mesh

__all__ = ["gather_distributed_sampler"]

_OFFSETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loader -> rows of its epoch gathered so far


def gather_distributed_sampler(values: Any, loader: Any, pad_value: float | int | bool | None = None) -> Any:
    """See :func:`torchloom.main_process.gather_for_metrics` (the ``DistributedSampler`` case)."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or not isinstance(getattr(loader, "batch_sampler", None),
                                                                      BatchSampler):
        raise DataError(f"gather_for_metrics cannot tell which rows of a {type(loader).__name__} with sampler "
                        f"{type(sampler).__name__} are padding: pass a torchloom EvalLoader "
                        "(torchloom.data.eval_loader: every sample once, no padding) or a DataLoader(batch_size=..., "
                        "sampler=DistributedSampler(...)).")
    n, reps = len(sampler.dataset), sampler.num_replicas
    group = _sampler_group(sampler)
    epoch_rows = sampler.num_samples
    if loader.drop_last:
        epoch_rows -= epoch_rows % loader.batch_size
    offset = _OFFSETS.get(loader, 0)

    def mine() -> tuple[list[torch.Tensor], Any, int, tuple[int, int]]:
        leaves, spec = _flatten(values)
        rows = _rows(leaves)
        if offset == 0 and rows == epoch_rows:
            start = 0  # the whole epoch of this rank in one call
        elif rows == min(loader.batch_size, epoch_rows - offset):
            start = offset
        else:
            raise DataError(f"gather_for_metrics: got {rows} rows, but this rank's next batch of the loader has "
                            f"{min(loader.batch_size, epoch_rows - offset)} ({offset} of its {epoch_rows} rows this "
                            "epoch were gathered already) and its whole epoch has "
                            f"{epoch_rows}. Call it once per batch, in order, for every batch (several values in one "
                            "call as a tuple/dict), or once with the whole epoch.")
        return leaves, spec, rows, (start, sampler.rank)

    spec, metas, parts = gather_rows(mine, reps, group, pad_value, check=_check_positions)
    rows, start = metas[0][2], metas[0][3][0]
    _OFFSETS[loader] = (start + rows) % max(epoch_rows, 1)  # 0 again after the epoch's last batch, or all of it
    keep = min(rows * reps, max(0, n - start * reps))  # positions start*R .. ; those >= len(dataset) are repeats
    # rank-minor interleave: local row i of rank r is position (start + i) * R + r of the padded epoch
    return _unflatten(spec, [torch.stack(ps, dim=1).reshape(rows * reps, *ps[0].shape[1:])[:keep] for ps in parts])


def _check_positions(metas: list[Any]) -> None:
    """Every rank at the same rows of the epoch, and the sampler's ``rank`` of each its rank in the group (else
    the interleave puts rows at the wrong positions)."""
    ranks = [m[3][1] for m in metas]
    if ranks != list(range(len(metas))):
        raise DataError(f"gather_for_metrics: the DistributedSamplers' rank per process (in group order) is {ranks}, "
                        f"not {list(range(len(metas)))}: build them with rank= the data-parallel rank "
                        "(res.mesh.dp_rank, or the default: the global rank).")
    if len({(m[2], m[3][0]) for m in metas}) != 1:
        raise DataError(f"gather_for_metrics: the ranks are at different rows of the epoch: "
                        f"{ {r: f'rows {m[3][0]}..{m[3][0] + m[2]}' for r, m in enumerate(metas)} }; every rank must "
                        "gather the same batches.")


def _rows(leaves: list[torch.Tensor]) -> int:
    rows = {v.shape[0] if v.dim() > 0 else None for v in leaves}
    if len(rows) != 1 or None in rows:
        raise DataError(f"gather_for_metrics: every tensor needs the batch's rows in dim 0, got shapes "
                        f"{[tuple(v.shape) for v in leaves]}.")
    return rows.pop()


def _sampler_group(sampler: DistributedSampler) -> dist.ProcessGroup | None:
    """The group whose ranks are the sampler's replicas: the default group, or the current mesh's dp group.
    Decided by what every rank shares (world size, the mesh), so a failure here raises on every rank."""
    reps = sampler.num_replicas
    if reps == 1:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise DataError(f"a DistributedSampler with num_replicas={reps} needs an initialised process group.")
    if reps == dist.get_world_size():
        return None
    cur = current_mesh()
    if cur is not None and cur.dp_size == reps:  # the same on every rank; sampler.rank is checked in the exchange
        return cur.group("dp")
    raise DataError(f"DistributedSampler(num_replicas={reps}) matches neither the world ({dist.get_world_size()} "
                    "ranks) nor the current torchloom mesh's data-parallel group; build it with "
                    "num_replicas=res.mesh.dp_size, rank=res.mesh.dp_rank.")
