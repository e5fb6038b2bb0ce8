"""ATorch's process-group helpers (``atorch.init_distributed``, ``reset_distributed``, ``rank``,
``local_rank``, ``world_size``) on ``torch.distributed``, with ATorch's return values."""
from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger("torchloom.compat.atorch")

_BACKENDS = ("nccl", "gloo", "accl", "hccl", "cpu:gloo,cuda:nccl")
_INITIALIZED_HERE = False
default_pg_timeout = datetime.timedelta(minutes=30)


def init_distributed(backend="nccl", coworker_num_per_node=0, elastic_or_fault_tolerant=False,
                     set_cuda_device_using_local_rank=False, timeout: datetime.timedelta = default_pg_timeout):
    """Initialise the default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT``); without it, one process (rank 0 of 1, an in-memory store).

    Returns:
        True when initialised (or already initialised), False for an invalid backend or ``nccl``
        without a GPU (ATorch's return values; the reason is logged).

    Raises:
        ValueError: ``coworker_num_per_node > 0`` (ATorch's coworker processes have no counterpart:
            run data preprocessing in the DataLoader's workers) or a backend ``accl``/``hccl`` whose
            library is missing.
    """
    global _INITIALIZED_HERE
    backend = backend.lower()
    if backend not in _BACKENDS:
        log.error("Invalid backend %s. Only support %s", backend, list(_BACKENDS))
        return False
    if backend in ("nccl", "accl") and not torch.cuda.is_available():
        log.error("torch.cuda.is_available() returns False: backend %s needs a GPU; use gloo on CPU.", backend)
        return False
    if coworker_num_per_node:
        raise ValueError(
            f"ATorch init_distributed(coworker_num_per_node={coworker_num_per_node}) is not supported by "
            "torchloom.compat.atorch (no coworker processes): use 0 and the DataLoader's num_workers."
        )
    if elastic_or_fault_tolerant:
        log.info("init_distributed: elastic_or_fault_tolerant is accepted; torchloom's elastic training is "
                 "started by `loom run` (docs/elastic.md)")
    if backend in ("accl", "hccl"):
        raise ValueError(f"backend {backend!r} is not available in torchloom.compat.atorch: use nccl or gloo.")
    if dist.is_initialized():
        return True
    timeout = timeout if timeout is not None else default_pg_timeout
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    if set_cuda_device_using_local_rank:
        gpus = torch.cuda.device_count()
        if gpus == 0:
            log.warning("No gpu found, set_cuda_device_using_local_rank ignored!")
        else:
            torch.cuda.set_device(local_rank() % gpus)
    _INITIALIZED_HERE = True
    log.info("Distributed context initialized: rank=%s, local_rank=%s, world_size=%s", rank(), local_rank(),
             world_size())
    return True


def reset_distributed():
    """Destroy the process group :func:`init_distributed` created (nothing otherwise, as ATorch)."""
    global _INITIALIZED_HERE
    if not _INITIALIZED_HERE:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    _INITIALIZED_HERE = False


def rank():
    """This process's global rank, or None without a process group."""
    return dist.get_rank() if dist.is_initialized() else None


def local_rank():
    """``LOCAL_RANK`` (0 without a process group; 0 in a one-process group without the variable)."""
    if not dist.is_initialized():
        return 0
    return int(os.getenv("LOCAL_RANK", "0" if dist.get_world_size() == 1 else "-1"))


def world_size():
    """The number of processes, or None without a process group."""
    return dist.get_world_size() if dist.is_initialized() else None


def is_distributed():
    """True with more than one process."""
    ws = world_size()
    return ws is not None and ws > 1


def coworker_size():
    """Always 0: no coworker processes."""
    return 0


from .parallel_groups import (  # noqa: E402,F401  (ATorch exports them from atorch.distributed.distributed)
    get_data_partition_rank_and_size,
    parallel_group,
    parallel_group_size,
    parallel_instance_index,
    parallel_instance_num,
    parallel_rank,
)
