"""Optimizer arguments for parameter lists that mix DTensors and plain tensors."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

import torch
from torch.distributed.tensor import DTensor


def parameter_layouts(params: Iterable[torch.Tensor]) -> set:
    """The distinct kinds in ``params``: None for plain tensors, the device mesh for DTensors."""
    return {p.device_mesh if isinstance(p, DTensor) else None for p in params}


def foreach_safe_args(optim_func: Callable, params: list[torch.Tensor],
                      optim_args: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """``optim_args`` plus ``foreach=False`` when the list mixes plain tensors and DTensors (or DTensors on
    different meshes), the optimizer takes ``foreach`` and the user did not choose it.

    Why: torch optimizers batch a parameter group into ``torch._foreach_*`` kernels, which reject lists
    mixing plain tensors and DTensors ("got mixed torch.Tensor and DTensor"). On CUDA, foreach is the
    default for such lists (DTensor counts as foreach-capable); tensor parallelism leaves norm weights plain.

    Returns:
        (arguments to pass, a note saying what was changed or None).
    """
    if "foreach" in optim_args or len(parameter_layouts(params)) <= 1:
        return optim_args, None
    try:
        accepts = "foreach" in inspect.signature(optim_func).parameters
    except (TypeError, ValueError):
        accepts = False
    if not accepts:
        return optim_args, None
    return {**optim_args, "foreach": False}, (
        "optimizer: foreach=False (the parameters mix DTensors and plain tensors, which the foreach kernels "
        "reject); pass optim_args={'foreach': ...} to choose")
