"""`AccelContext`: the state that strategy methods read and transform while `auto_accelerate` runs."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .parallel.mesh import ParallelDims, ParallelMesh
from .strategy.strategy import Strategy

log = logging.getLogger("torchloom")


@dataclass
class AccelContext:
    """Everything one ``auto_accelerate`` call builds, passed through each method's hooks in order.

    Attributes set by methods (others read them):
        dims: requested mesh degrees (``parallel_mode`` sets them; -1 = the rest).
        mesh: the ParallelMesh, created after every ``configure`` hook ran.
        autocast_dtype: dtype for ``torch.autocast`` (amp), or None.
        param_dtype: dtype parameters were cast to (half), or None.
        loss_scaler: dynamic loss scaler for fp16 (amp), or None.
        data_parallel: name of the method that owns gradient sync ("ddp"/"fsdp"), or None.
        block_classes: names of the repeated block classes (auto-detected or configured).
    """

    model: nn.Module
    strategy: Strategy
    device: torch.device
    dims: ParallelDims = field(default_factory=ParallelDims)
    mesh: ParallelMesh | None = None
    optimizer: torch.optim.Optimizer | None = None
    autocast_dtype: torch.dtype | None = None
    param_dtype: torch.dtype | None = None
    loss_scaler: Any = None
    data_parallel: str | None = None
    block_classes: list[str] | None = None
    on_meta: bool = False
    #: callables run after the optimizer exists, e.g. to register hooks
    post_optimizer: list[Callable[["AccelContext"], None]] = field(default_factory=list)
    #: human-readable log of what each method did (printed by `loom plan`/`--verbose`)
    notes: list[str] = field(default_factory=list)

    def note(self, msg: str) -> None:
        self.notes.append(msg)
        log.info(msg)
