"""``torchloom.compat.atorch``: ATorch's API on torchloom, for ``import torchloom.compat.atorch as atorch``.

Mirrors the import paths ATorch's docs, tests and examples use: ``atorch.auto_accelerate``,
``atorch.auto.accelerate.{auto_accelerate, save_strategy, get_strategy}``, ``atorch.auto.strategy.Strategy``,
``atorch.optimizers.{AGD, WeightedSAM}``, ``atorch.init_distributed`` / ``reset_distributed`` / ``rank`` /
``local_rank`` / ``world_size``. What each name does here, and every deliberate difference from ATorch:
docs/compat_atorch.md.
"""
from . import auto, data, distributed, optimizers  # noqa: F401
from .auto.accelerate import auto_accelerate, get_strategy, save_strategy
from .auto.strategy import Strategy
from .distributed.distributed import (
    coworker_size,
    init_distributed,
    is_distributed,
    local_rank,
    rank,
    reset_distributed,
    world_size,
)
from .optimizers import AGD, WeightedSAM

__all__ = [
    "AGD", "Strategy", "WeightedSAM", "auto_accelerate", "coworker_size", "get_strategy", "init_distributed",
    "is_distributed", "local_rank", "rank", "reset_distributed", "save_strategy", "world_size",
]
