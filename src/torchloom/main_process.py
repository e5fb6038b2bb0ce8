"""Main-process helpers of Accelerate's kind: who is the main process, print once, let rank 0 go first, wait,
and gather evaluation values without the sampler's padding.

"Main process" is global rank 0; "local main" is ``LOCAL_RANK`` 0 (one per node). Without an initialised process
group the rank comes from ``RANK`` (set by ``torchrun`` before ``init_process_group``), else the process is
alone and is both. Nothing here communicates except :func:`main_process_first`, :func:`wait_for_everyone`
(a barrier of the default group) and :func:`gather_for_metrics` (an all-gather).
"""
from __future__ import annotations

import builtins
import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch.distributed as dist

from torchloom.utils import distributed, local_rank

__all__ = ["is_main_process", "is_local_main_process", "print", "main_process_first", "wait_for_everyone",
           "gather_for_metrics"]


def is_main_process() -> bool:
    """True on global rank 0 (the process that writes logs and files); True in a single process."""
    if distributed():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def is_local_main_process() -> bool:
    """True on the first process of each node (``LOCAL_RANK`` 0, or no ``LOCAL_RANK``)."""
    return local_rank() == 0


def print(*args: Any, **kwargs: Any) -> None:  # noqa: A001 - exported as torchloom.print, like accelerator.print
    """``builtins.print(*args, **kwargs)`` on the main process only; nothing elsewhere."""
    if is_main_process():
        builtins.print(*args, **kwargs)


def wait_for_everyone() -> None:
    """Barrier over the default process group (every rank must call it); nothing in a single process."""
    if distributed():
        dist.barrier()


@contextmanager
def main_process_first(local: bool = False) -> Iterator[None]:
    """Run the ``with`` body on the main process first, then on the others (e.g. ``datasets.map`` with a cache:
    rank 0 builds it, the others load it).

    The others wait in a barrier of the default group before their body; the main process enters that barrier
    after its body, also when its body raises (then it re-raises), so the others never wait for a rank that
    already failed: they run their own body and go on. ``local=True``: the first process of each node
    (``LOCAL_RANK`` 0) goes first (a per-node cache on node-local disk); the barrier is still global, so every
    node's local main finishes before any other process starts its body.

    Every rank of the default group must enter the block once. The wait is bounded by the process group's
    timeout (default 30 minutes): a longer first body needs ``init_process_group(timeout=...)``; a main
    process that dies inside its body (killed, not an exception) leaves the others waiting until that timeout.
    """
    first = is_local_main_process() if local else is_main_process()
    if not distributed():
        yield
        return
    if not first:
        dist.barrier()
    try:
        yield
    finally:
        if first:
            dist.barrier()


def gather_for_metrics(values: Any, loader: Any = None, pad_value: float | int | bool | None = None) -> Any:
    """All-gather per-row evaluation values over the data-parallel ranks, each sample exactly once.

    Collective (every rank calls it for the same batch). ``values``: a tensor or a nested dict/list/tuple of
    tensors with the batch's rows in dim 0. ``pad_value``: pads trailing dims that differ between ranks (see
    :meth:`EvalLoader.gather_for_metrics`).

    ``loader`` decides which rows are padding:

    * a torchloom :class:`~torchloom.data.eval.EvalLoader` (``torchloom.data.eval_loader``): its
      :meth:`~torchloom.data.eval.EvalLoader.gather_for_metrics` (filler rows dropped; dataset order).
    * None: the one ``EvalLoader`` this process is iterating now (inside its loop; a loop left by ``break`` is over).
      None in a single process: ``values`` unchanged. Distributed without one, or with several being iterated
      (nested loops): a ``DataError``; pass ``loader=``. Values of *another* loader iterated inside an
      ``eval_loader`` loop need ``loader=`` too (they would be cut by the EvalLoader's counts).
    * a ``DataLoader`` over a ``torch.utils.data.DistributedSampler``: that sampler pads the epoch to
      ``total_size`` by repeating its first samples; the repeats are dropped using ``len(dataset)``. Pass either
      one batch per call, **one call per batch, in order, for every batch of the epoch** (gather several
      values in one call as a tuple or dict; a loop left early leaves the count mid-epoch), or the whole epoch
      of this rank at once (``sampler.num_samples`` rows, e.g. the concatenated predictions; stateless).
      Returns the rows in the sampler's order: the dataset order with ``shuffle=False``.

    Returns:
        the structure of ``values``, each tensor ``(real rows over all ranks, ...)``; the same on every rank.

    Raises:
        DataError: see above, and rows that do not fit the loader's next batch or epoch, ranks that disagree,
            a sampler whose replicas are not the world or the current torchloom mesh's data-parallel group, or
            whose ``rank`` is not the process's rank in that group. Raised on every rank (exchanged first).
    """
    from torchloom.data.eval import EvalLoader, last_eval_loader
    from torchloom.data.sampler import DataError

    if loader is None:
        loader = last_eval_loader()
        if loader is None:
            if not distributed():
                return values
            raise DataError("gather_for_metrics(values) without loader= needs a torchloom EvalLoader being iterated "
                            "on this process (torchloom.data.eval_loader); none is. Pass loader=<your DataLoader> "
                            "(e.g. one over a DistributedSampler) or iterate an eval_loader.")
    if isinstance(loader, EvalLoader):
        return loader.gather_for_metrics(values, pad_value=pad_value)
    from torchloom.data.padded_gather import gather_distributed_sampler

    return gather_distributed_sampler(values, loader, pad_value=pad_value)
