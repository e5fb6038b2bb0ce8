"""`pipeline_parallel`: split an unmodified model into pipeline stages run by ``torch.distributed.pipelining``."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal

from ..cost.effects import (Collective, Effects, PipelineShape, StageLoad, activation_bytes, block_params,
                            dtype_bytes, embed_params, hidden_bytes)
from ..cost.memo import memo_model_check
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

    search_configs = ({"schedule": "1f1b"}, {"schedule": "gpipe"}, {"schedule": "interleaved_1f1b"})

    def estimate(self, info, dims, hw, step):
        """The stages of :func:`~torchloom.parallel.pipeline.build.plan_stages` (by parameters; the same
        split ``apply`` makes) placed on ranks as the schedule places them; ``grad_accum`` = the pipeline's
        micro-batch count ``m``. Bubble per step in micro-batch times of the slowest rank: GPipe/1F1B
        ``(p-1)(t_f+t_b)`` (fraction ``(p-1)/(m+p-1)``); interleaved 1F1B ``(p-1)/v`` of that (Narayanan et al.
        SC 2021); interleaved zero bubble (ZB-H1 per virtual stage, Qi et al. ICLR 2024) ``(p-1)/v * t_f``
        (input and weight gradients split evenly, so ``T_F + T_B - T_W = T_F``); ZB-V ``(p-1)(t_f/2 - t_b/4)``
        (``T_F + T_B - 2 T_W`` per chunk), at least 0. Activations in flight on pipeline rank ``r``: GPipe
        ``m``, 1F1B and ZB-V ``min(m, p-r)``, interleaved ``min(mv, 2(p-r-1) + (v-1)p + 1) / v`` (Megatron's
        warm-up). The most loaded rank (parameters + 3 x for gradients and Adam state + activations) sets the
        memory; one send of the hidden state per micro-batch and chunk in each direction, in the residual
        stream's dtype (``StepShape.residual_dtype``: bf16 under fsdp's mixed precision, fp32 under plain autocast)."""
        p = dims.pp
        if p <= 1:
            return None
        c, m = self.config, step.grad_accum
        v = c.virtual
        loads = stage_loads(info, c, p)
        nb = max(info.num_blocks, 1)
        blocks_act, rest_act = activation_bytes(info, step)
        block_p = block_params(info)
        rest_p = info.rest.params if info.rest is not None else 0

        emb = embed_params(info)
        head = max(rest_p - emb, emb if info.tied else 0)
        pb = dtype_bytes(step.param_dtype)
        best = None
        for r, load in enumerate(loads):
            if c.schedule == "gpipe":
                fly = float(m)
            elif c.schedule in ("interleaved_1f1b", "zero_bubble"):
                fly = min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1) / v
            else:
                fly = float(min(m, p - r))
            params = load.blocks * block_p + (emb if load.first else 0) + (head if load.last else 0)
            act = fly * (blocks_act * load.blocks / nb + (rest_act if load.last else 0.0))
            total = params * pb * 4 + act
            if best is None or total > best[0]:
                best = (total, params, act, fly)
        _, params, act, fly = best
        if c.schedule in ("gpipe", "1f1b"):
            bf = bb = float(p - 1)
        elif c.schedule == "interleaved_1f1b":
            bf = bb = (p - 1) / v
        elif c.schedule == "zero_bubble":
            bf, bb = (p - 1) / v, 0.0
        else:  # zbv
            bf, bb = (p - 1) / 2, -(p - 1) / 4
        pshape = PipelineShape(c.schedule, p, v, m, loads, bf, bb, fly,
                               boundary_bytes=_boundary_bytes(info, dims, step))
        share = params / info.n_params if info.n_params else 1.0
        e = Effects(self.name, pipeline=pshape,
                    memory_scale={"params": share, "grads": share, "optimizer": share,
                                  "activations": act / (blocks_act + rest_act) if blocks_act + rest_act else 1.0})
        if pshape.boundary_bytes:
            e.collectives.append(Collective("send_recv", pshape.boundary_bytes, "pp", calls=2 * m * v,
                                            label="pp.send_recv"))
        return e

    def validate(self, info, dims) -> None:
        """``configure``'s micro-batch and schedule checks, then the stage plan ``apply`` makes
        (``plan_stages``: a supported model, enough units for ``pp x stages_per_rank`` stages, valid split
        points; ``balance='profile'`` is checked with the parameter split). With the whole strategy known
        (:func:`torchloom.search.validate.validate_strategy`) also the schedule against ddp/fsdp/compile.
        Without ``info.module``: only the stage count against the blocks plus embedding and head."""
        c = self.config
        _check_microbatches(c, dims.pp)
        strategy = getattr(self, "planning_strategy", None)
        if strategy is not None:
            _check_schedule_fits(c, strategy)
        if info.module is not None:
            from ..parallel.pipeline.build import plan_stages
            memo_model_check(info.module, ("pipeline_parallel", repr(c), dims.pp),
                             lambda: plan_stages(info.module, c, dims.pp, profile=False))
        elif dims.pp * c.virtual > info.num_blocks + 2:
            raise StrategyError(
                f"pipeline_parallel: {dims.pp * c.virtual} stages (pp={dims.pp} x stages_per_rank={c.virtual}) but "
                f"the model has only {info.num_blocks + 2} units; lower the pipeline size or stages_per_rank.")

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


def stage_loads(info, c: PipelineConfig, pp: int) -> list:
    """What each pipeline rank holds (:class:`~torchloom.cost.effects.StageLoad`): from ``plan_stages`` on
    ``info.module`` when the analysis kept the meta model (the split ``apply`` makes), else the same
    parameter balance over [embedding, blocks..., head]. Memoised on ``info`` per configuration."""
    from ..parallel.pipeline.placement import stage_ranks
    key = (pp, c.virtual, c.schedule, tuple(c.split_points or ()), c.balance)
    memo = info.__dict__.setdefault("_stage_loads", {})
    if key in memo:
        return memo[key]
    num = pp * c.virtual
    style = SCHEDULES[c.schedule][2]
    if info.module is not None:
        from ..parallel.pipeline.build import plan_stages

        _, specs, _ = plan_stages(info.module, c, pp, profile=False)
        kinds = [[u.kind for u in s.units] for s in specs]
    else:
        from ..parallel.pipeline.split import balance_by_cost

        rest = info.rest.params if info.rest is not None else 0
        emb = embed_params(info)
        units = ["embed", *["block"] * info.num_blocks, "head"]
        costs = [float(emb), *[block_params(info)] * info.num_blocks, float(max(rest - emb, 1))]
        bounds = [0, *balance_by_cost(costs, num), len(units)]
        kinds = [units[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    ranks = stage_ranks(pp, num, style)
    loads = [StageLoad(0) for _ in range(pp)]
    for s, ks in enumerate(kinds):
        load = loads[ranks[s]]
        load.blocks += ks.count("block")
        load.first |= "embed" in ks
        load.last |= "head" in ks
    memo[key] = loads
    return loads


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


def _boundary_bytes(info, dims, step) -> float:
    """Bytes of the hidden state one stage sends per micro-batch: in the residual stream's dtype, split over the
    context-parallel ranks (each holds 1/cp of the tokens) and, under sequence parallelism, over the tensor-
    parallel ranks (the stage output is sequence-sharded)."""
    split = dims.cp * (dims.tp if "sequence_parallel" in step.methods else 1)
    return hidden_bytes(info, step, step.residual_dtype) / split
