"""`pipeline_parallel`: split an unmodified model into pipeline stages run by ``torch.distributed.pipelining``."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal

from ..errors import StrategyError
from ..parallel.pipeline.placement import SCHEDULES, SPLIT_BACKWARD
from ..strategy.registry import Method, Stage, register_method


@dataclass
class PipelineConfig:
    """Pipeline-parallel options.

    size: pipeline degree (the mesh's ``pp``) when ``parallel_mode`` does not set it; both set and different is
        an error.
    split_points: FQNs of the modules that begin a new stage, in model order (``["model.layers.2"]``); exactly
        ``size x stages_per_rank - 1`` of them. None: automatic split by ``balance``.
    balance: automatic split. ``"params"``: contiguous partition of the units (embedding, blocks, final norm,
        head) minimising the largest stage's parameter count. ``"profile"``: the same over forward+backward time
        measured on global rank 0 with a synthetic batch of ``profile_seq_len`` tokens (then broadcast).
    schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` (virtual stages), ``"zero_bubble"``
        (``ScheduleInterleavedZeroBubble``) or ``"zbv"`` (``ScheduleZBVZeroBubble``, V placement, 2 stages/rank).
    num_microbatches: pipeline micro-batches per ``train_step`` call (the per-call batch must divide into them);
        default: the number of stages.
    stages_per_rank: virtual stages per rank; default 1 for gpipe/1f1b, 2 for the others.
    profile_seq_len: sequence length of the profiling batch.
    """

    size: int | None = None
    split_points: list[str] | None = None
    balance: Literal["params", "profile"] = "params"
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"] = "1f1b"
    num_microbatches: int | None = None
    stages_per_rank: int | None = None
    profile_seq_len: int = 128

    def __post_init__(self):
        for key in ("size", "num_microbatches", "stages_per_rank", "profile_seq_len"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise StrategyError(f"pipeline_parallel: {key} must be >= 1, got {v}.")
        kind = SCHEDULES[self.schedule][1]
        if kind == "single" and self.stages_per_rank not in (None, 1):
            raise StrategyError(
                f"pipeline_parallel: schedule {self.schedule!r} runs one stage per rank, got stages_per_rank="
                f"{self.stages_per_rank}; use 'interleaved_1f1b' or 'zero_bubble' for virtual stages."
            )
        if self.schedule == "zbv" and self.stages_per_rank not in (None, 2):
            raise StrategyError(
                f"pipeline_parallel: 'zbv' needs exactly 2 stages per rank, got {self.stages_per_rank}.")

    @property
    def virtual(self) -> int:
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 1 if SCHEDULES[self.schedule][1] == "single" else 2


@register_method
class PipelineParallel(Method):
    """Pipeline parallelism (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. "PipeDream", 2019; interleaved
    1F1B, Narayanan et al., SC 2021; zero bubble, Qi et al., ICLR 2024) on ``torch.distributed.pipelining``
    with manually built stages, so any micro-batch shape runs.

    Applied first (``Stage.PIPELINE``): the model is cut into stage modules that keep the original names;
    every later method (tensor parallel, checkpointing, compile, FSDP/DDP) transforms each stage module
    (``ctx.parts``). ``train_step`` drives the schedule, so the training loop does not change. See
    ``docs/methods/pipeline_parallel.md``.
    """

    name = "pipeline_parallel"
    aliases = {"pipeline": {}, "pp": {}}
    Config = PipelineConfig
    stage = Stage.PIPELINE
    mesh_dims = ("pp",)

    def configure(self, ctx) -> None:
        c = self.config
        pm = ctx.strategy.config("parallel_mode")
        given = getattr(pm, "pp", None) if pm is not None else None
        if c.size is not None and given is not None and c.size != given:
            raise StrategyError(
                f"pipeline_parallel: size={c.size} but parallel_mode sets pp={given}; give the degree once."
            )
        size = c.size if c.size is not None else given
        if size is None:
            raise StrategyError(
                "pipeline_parallel needs its degree: set ('pipeline_parallel', {'size': 2}) or parallel_mode's pp."
            )
        ctx.dims.pp = size
        _check_microbatches(c, size)
        _check_schedule_fits(c, ctx.strategy)

    def apply(self, ctx) -> None:
        if ctx.data_parallel == "ddp" and ctx.mesh.dp_size > 1:  # ddp added for dp > 1 without a dp method
            _check_schedule_fits(self.config, ctx.strategy, ddp=True)
        from ..parallel.pipeline.build import build_pipeline  # imports torch.distributed.pipelining (~1 s)

        build_pipeline(ctx, self.config, signature=inspect.signature(ctx.model.forward))


def _check_schedule_fits(c: PipelineConfig, strategy, ddp: bool | None = None) -> None:
    """Combinations that would train wrong or not at all, as StrategyErrors (all measured on torch 2.13)."""
    if c.schedule in SPLIT_BACKWARD and (ddp if ddp is not None else "ddp" in strategy):
        raise StrategyError(
            f"pipeline_parallel: schedule {c.schedule!r} computes weight gradients outside autograd's backward "
            "(autograd.grad, then .grad +=), so DDP's gradient hooks never fire and the data-parallel replicas drift "
            "apart. Use ('fsdp', {'reshard_after_forward': False}) for data parallelism with zero-bubble "
            "schedules, or schedule '1f1b'/'interleaved_1f1b' with ddp."
        )
    fsdp = strategy.config("fsdp")
    if c.schedule in SPLIT_BACKWARD and fsdp is not None and fsdp.reshard_after_forward:
        raise StrategyError(
            f"pipeline_parallel: schedule {c.schedule!r} computes weight gradients after the input gradients, when "
            "FSDP has already resharded the parameters (reshard_after_forward=True): the weight gradients are "
            "misapplied. Use ('fsdp', {'reshard_after_forward': False}) (alias 'zero2'; also what torchtitan does "
            "under pipelining: no re-gather per micro-batch) or schedule '1f1b'/'interleaved_1f1b'."
        )
    if c.schedule == "zbv" and "compile" in strategy:
        raise StrategyError("pipeline_parallel: 'zbv' does not support torch.compile (a pytorch limitation); drop "
                            "compile or use 'interleaved_1f1b'.")


def _check_microbatches(c: PipelineConfig, pp: int) -> None:
    """The schedules' own constraints, as StrategyErrors before anything runs."""
    stages = pp * c.virtual
    n = c.num_microbatches or stages
    if c.schedule == "1f1b" and n < stages:
        raise StrategyError(f"pipeline_parallel: '1f1b' needs num_microbatches >= the number of stages ({stages}), "
                            f"got {n}.")
    if c.schedule in ("interleaved_1f1b", "zero_bubble"):
        rounds = max(1, n // pp)
        if n % rounds:
            raise StrategyError(
                f"pipeline_parallel: {c.schedule!r} needs num_microbatches to be a multiple of num_microbatches // pp "
                f"= {rounds} (e.g. a multiple of pp={pp}), got {n}."
            )
