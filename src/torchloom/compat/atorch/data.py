"""``atorch.data.data_to_device`` (ATorch's default ``prepare_input``) and ATorch's DataLoader for
``drop_last=False`` (``DistributedSampler`` + ``DataLoader``: no samples repeated to fill the last batch)."""
from __future__ import annotations

from typing import Any

import torch

from ...train_step import move_to_device


def data_to_device(data: Any, device: Any) -> Any:
    """Move the tensors of ``data`` (nested lists, tuples, dicts) to ``device`` (dtypes unchanged). ``auto_accelerate`` returns this function as
    ``result.prepare_input`` when none is given (as ATorch does)."""
    return move_to_device(data, torch.device(device) if isinstance(device, str) else device)


def atorch_dataloader(dataset, *, dp_rank: int, dp_size: int, micro_batch_size: int, shuffle: bool, seed: int,
                      drop_last: bool = False, **dataloader_kwargs: Any) -> torch.utils.data.DataLoader:
    """ATorch's loader: ``DistributedSampler(dataset, dp_size, dp_rank, shuffle, seed)`` (strided shards, padded
    only to a multiple of ``dp_size``; the order changes per epoch only through ``loader.sampler.set_epoch``) and
    a ``DataLoader`` of ``micro_batch_size`` whose last batch may be short (10 samples, batch 3: 3, 3, 3, 1)."""
    sampler = None
    if dp_size > 1 or shuffle:
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle,
                                                      seed=seed)
    return torch.utils.data.DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, drop_last=drop_last,
                                       **dataloader_kwargs)
