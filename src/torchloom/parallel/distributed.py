"""Process-group set-up: use torchrun's environment when present, else a 1-rank group so every code
path (DCP, FSDP, DeviceMesh) is the same in a single process."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..utils import default_backend, default_device


def init_distributed(timeout_s: float = 600.0) -> torch.device:
    """Initialise the default process group if needed and return this rank's device.

    Under ``torchrun``/``loom run`` (``RANK``/``WORLD_SIZE`` set) it joins the job with the device's
    backend (gloo on CPU, NCCL on CUDA). Without them it creates a single-rank gloo group backed by an
    in-memory store. Idempotent.
    """
    device = default_device()
    if device.type != "cpu":
        getattr(torch, device.type).set_device(device)
    if dist.is_initialized():
        return device
    backend = default_backend(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device
