"""``atorch.optimizers.utils``: the BatchNorm helpers of ATorch's two-step WSAM loop (docs/README-WSAM.md).

``disable_running_stats(model)`` before WSAM's second forward keeps BatchNorm running statistics as the first
pass left them (momentum 0); ``enable_running_stats(model)`` restores the momentum. ATorch's versions act on
``nn.BatchNorm2d`` only; these act on every BatchNorm (1d/2d/3d, SyncBatchNorm, lazy variants).
"""
from __future__ import annotations

import contextlib

from torch import nn

__all__ = ["disable_running_stats", "enable_running_stats", "whether_to_sync"]


def disable_running_stats(model: nn.Module) -> None:
    """Set every BatchNorm's momentum to 0 (running statistics unchanged by the next forward passes),
    remembering it in ``module.backup_momentum`` (ATorch's attribute name)."""
    def _disable(module: nn.Module) -> None:
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.backup_momentum = module.momentum
            module.momentum = 0

    model.apply(_disable)


def enable_running_stats(model: nn.Module) -> None:
    """Restore the momentum saved by :func:`disable_running_stats` (modules never disabled are left alone)."""
    def _enable(module: nn.Module) -> None:
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and hasattr(module, "backup_momentum"):
            module.momentum = module.backup_momentum

    model.apply(_enable)


def whether_to_sync(model: nn.Module, sync: bool = False):
    """``model.no_sync()`` (a DDP model) when ``sync`` is False, else a context that does nothing."""
    if not sync:
        return model.no_sync()
    return contextlib.ExitStack()
