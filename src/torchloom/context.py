"""`AccelContext`: the state that strategy methods read and transform while `auto_accelerate` runs."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .parallel.mesh import ParallelDims, ParallelMesh
from .parallel.param_groups import ParamGroups
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
    #: set by the ``sequence_parallel`` / ``loss_parallel`` methods; read by ``tensor_parallel``
    sequence_parallel: bool = False
    loss_parallel: bool = False
    #: local pipeline stage modules (None without pipeline parallel); see :attr:`model_parts`
    parts: list[nn.Module] | None = None
    #: callables run after every method's ``apply`` and before the optimizer is built
    post_apply: list[Callable[["AccelContext"], None]] = field(default_factory=list)
    #: callables run after the optimizer exists, e.g. to register hooks
    post_optimizer: list[Callable[["AccelContext"], None]] = field(default_factory=list)
    #: context-manager factories TrainStep enters around forward + loss + backward (e.g. ``loss_parallel``)
    step_contexts: list[Callable[[], Any]] = field(default_factory=list)
    #: ``split(batch) -> batch``: this rank's tokens of every sample under a sequence split (context parallel /
    #: Ulysses: ``torchloom.parallel.context``), applied by TrainStep after ``prepare_input``; None: no split
    sequence_split: Callable[[Any], Any] | None = None
    #: reduce gradients on every micro-batch of an accumulation window instead of only the last (fsdp's
    #: ``accumulate_sharded``: gradients stay sharded between micro-batches); read by TrainStep
    sync_every_microbatch: bool = False
    #: extra process groups over which the global gradient norm is summed (disjoint parameters: pipeline stages)
    grad_norm_groups: list[Any] = field(default_factory=list)
    #: ``hook(params)`` run at each optimizer step before unscaling/clipping (e.g. tied weights across stages)
    pre_step_hooks: list[Callable[[list], None]] = field(default_factory=list)
    #: which mesh each parameter group is sharded/reduced over (dense -> dp; experts -> ep/edp); see
    #: ``torchloom.parallel.param_groups``. Written by ``expert_parallel``, read by fsdp/ddp/zero1/clipping.
    param_groups: ParamGroups = field(default_factory=ParamGroups)
    #: human-readable log of what each method did (printed by `loom plan`/`--verbose`)
    notes: list[str] = field(default_factory=list)

    @property
    def model_parts(self) -> list[nn.Module]:
        """The modules methods transform: ``[model]``, or this rank's pipeline stage modules."""
        return list(self.parts) if self.parts is not None else [self.model]

    def map_parts(self, fn: Callable[[nn.Module], nn.Module]) -> None:
        """Replace every part by ``fn(part)`` (for methods that wrap: DDP, compile of the whole module)."""
        if self.parts is None:
            self.model = fn(self.model)
        else:
            self.parts = [fn(p) for p in self.parts]

    def note(self, msg: str) -> None:
        self.notes.append(msg)
        log.info(msg)
