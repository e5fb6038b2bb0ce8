"""``atorch.data.data_to_device``: ATorch's default ``prepare_input``."""
from __future__ import annotations

from typing import Any

import torch

from ...train_step import move_to_device


def data_to_device(data: Any, device: Any) -> Any:
    """Move the tensors of ``data`` (nested lists, tuples, dicts) to ``device`` (dtypes unchanged). ``auto_accelerate`` returns this function as
    ``result.prepare_input`` when none is given (as ATorch does)."""
    return move_to_device(data, torch.device(device) if isinstance(device, str) else device)
