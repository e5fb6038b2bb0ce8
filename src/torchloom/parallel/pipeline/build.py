"""Cut ``ctx.model`` into this rank's stage modules and, once every method ran, build the schedule driver."""
from __future__ import annotations

import functools
import inspect
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...errors import StrategyError
from .families import Family, detect_family
from .model import PipelinedModel
from .placement import SCHEDULES, stage_ranks
from .schedule import PipelineDriver
from .split import StageSpec, Unit, split_by_cost, split_by_points
from .stage import direct_parameter_owners, prune
from .tied import TiedWeights, untie_across_stages


def build_pipeline(ctx, c, signature: inspect.Signature) -> None:
    """Replace ``ctx.model`` by a :class:`PipelinedModel`, put this rank's stage modules in ``ctx.parts`` and
    register the post-apply hook that builds the :class:`PipelineDriver` (``c``: the method's config).

    Raises:
        StrategyError: an unsupported model, bad split points, more stages than units, or ``balance='profile'``
            on a meta-device model.
    """
    root = ctx.model
    pp = ctx.mesh.dims.pp
    family, specs, how = plan_stages(root, c, pp)
    num_stages = len(specs)
    style = SCHEDULES[c.schedule][2]
    ranks = stage_ranks(pp, num_stages, style)
    me = ctx.mesh["pp"].get_local_rank()
    local = [s for s in specs if ranks[s.index] == me]

    # parameter name -> stage, to find the weights tied across stages
    stage_of_module = {m: s.index for s in specs for m in s.module_names}
    stage_of_param = {f"{m}.{n}": s for m, s in stage_of_module.items()
                      for n, _ in root.get_submodule(m).named_parameters(remove_duplicate=False)}
    tied = untie_across_stages(root, stage_of_param)

    modules = {}
    for spec in local:
        part = prune(root, [*spec.module_names, *family.always_kept])
        part.forward = functools.partial(family.forward, part, spec)  # the stage's forward; names unchanged
        modules[spec.index] = part
    merged = prune(root, [m for s in local for m in s.module_names] + list(family.always_kept))
    n_mb = c.num_microbatches or num_stages
    desc = (f"schedule={c.schedule}, stages {[s.index for s in local]} of {num_stages} on pp rank {me}/{pp}, "
            f"num_microbatches={n_mb}")
    container = PipelinedModel(merged, local, desc)
    ctx.model = container
    ctx.parts = [modules[s.index] for s in local]
    if pp > 1:
        ctx.grad_norm_groups.append(ctx.mesh.group("pp"))

    sizes = ", ".join(f"{s.index}={s.describe()} ({sum(_unit_params(root, u) for u in s.units) / 1e6:.3g}M)"
                      for s in specs)
    ctx.note(f"pipeline_parallel: {family.name} model cut into {num_stages} stages by {how} ({c.virtual}/rank, "
             f"{style} placement): {sizes}; schedule {c.schedule}, {n_mb} micro-batches per train_step call; "
             f"this rank holds stages {[s.index for s in local]}")
    routes = "; ".join(
        f"stage {s.index} <- {', '.join(([family.primary] if s.is_first else []) + list(family.inputs_for(s)))}"
        for s in specs)
    ctx.note(f"pipeline_parallel: keyword routing (each pipeline rank reads the same batch): {routes}; the loss on "
             f"stage {num_stages - 1} <- {', '.join(family.loss_inputs) or 'its output'} and the micro-batch's rows")
    if tied:
        ctx.note("pipeline_parallel: tied weights across stages " + "; ".join(
            f"{g.names} (stages {sorted(g.names_by_stage)})" for g in tied)
            + ": one copy per stage, kept identical (gradients summed over pp, counted once in the norm)")

    def finish(ctx) -> None:
        parts = dict(zip([s.index for s in local], ctx.parts))
        group = ctx.mesh.group("pp")
        ties = TiedWeights(tied, modules, group, ctx.device) if tied else None
        if ties is not None:
            ties.sync_values()
            ctx.pre_step_hooks.append(ties.sum_gradients)
        driver = PipelineDriver(family=family, specs=local, parts=parts, modules=modules, signature=signature,
                                schedule=c.schedule, num_microbatches=n_mb, pp_group=group, device=ctx.device,
                                ties=ties, mesh=ctx.mesh)
        container.parts = list(ctx.parts)
        container.pipeline = driver

    ctx.post_apply.append(finish)


def plan_stages(root: nn.Module, c, pp: int, *, profile: bool = True) -> tuple[Family, list[StageSpec], str]:
    """The pipeline's stages for ``root`` at degree ``pp`` (``c``: the method's config): ``(family, stage
    specs, how they were chosen)``. Pure apart from ``balance='profile'``, which measures the units (a
    collective when a process group exists); ``profile=False`` splits by parameters instead, for checks
    before launching (the number of stages and the split points are checked the same way).

    Raises:
        StrategyError: an unsupported model, bad split points, or more stages than units.
    """
    family, units, param_costs = _units(root) if not profile else _units_uncached(root)
    num_stages = pp * c.virtual
    if num_stages > len(units):
        raise StrategyError(
            f"pipeline_parallel: {num_stages} stages (pp={pp} x stages_per_rank={c.virtual}) but the model has only "
            f"{len(units)} units ({', '.join(u.name for u in units)}); lower the pipeline size or stages_per_rank."
        )
    if c.split_points is not None:
        runs, how = split_by_points(units, list(c.split_points), num_stages), "split_points"
    else:
        costs = _profile_costs(root, family, units, c.profile_seq_len) if c.balance == "profile" and profile \
            else list(param_costs)
        runs, how = split_by_cost(units, costs, num_stages), f"balance={c.balance}"
    return family, [StageSpec(i, num_stages, tuple(r)) for i, r in enumerate(runs)], how


#: planning's memo of :func:`_units_uncached` per meta model (``profile=False``: a search plans the stages of one
#: model for every pipeline degree and schedule; walking 80 blocks' parameters each time took ~35 ms)
_PLANNED: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _units(root: nn.Module) -> tuple[Family, list[Unit], tuple[float, ...]]:
    got = _PLANNED.get(root)
    if got is None:
        got = _PLANNED[root] = _units_uncached(root)
    return got


def _units_uncached(root: nn.Module) -> tuple[Family, list[Unit], tuple[float, ...]]:
    """The model's pipeline family, its units (coverage checked) and each unit's parameter count."""
    family = detect_family(root)
    units = family.units(root)
    _check_coverage(root, family, units)
    return family, units, tuple(float(_unit_params(root, u)) for u in units)


def _check_coverage(root: nn.Module, family: Family, units: list[Unit]) -> None:
    """Every parameter and persistent buffer must belong to exactly one unit (else a stage would lack it or
    every stage would duplicate it); the always-kept modules must hold no parameters."""
    stray = direct_parameter_owners(root, [m for u in units for m in u.modules] + list(family.always_kept))
    if stray:
        raise StrategyError(
            f"pipeline_parallel: {stray[:5]} belong to no pipeline unit of the {family.name} runner (the model has "
            f"modules the runner does not know); this model layout is not supported for pipelining."
        )
    for m in family.always_kept:
        if any(True for _ in root.get_submodule(m).parameters()):
            raise StrategyError(f"pipeline_parallel: {m} (kept on every stage) has parameters; not supported.")


def _unit_params(root: nn.Module, unit: Unit) -> int:
    return sum(p.numel() for m in unit.modules for p in root.get_submodule(m).parameters())


def _profile_costs(root: nn.Module, family: Family, units: list[Unit], seq_len: int) -> list[float]:
    """Forward+backward seconds of each unit on a synthetic one-sequence batch, measured on global rank 0
    (best of 3) and broadcast, so every rank splits the same way. RNG state and gradients are left as found."""
    if any(p.is_meta for p in root.parameters()):
        raise StrategyError("pipeline_parallel: balance='profile' needs real weights; the model is on the meta "
                            "device. Use balance='params' or split_points.")
    costs: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        costs[0] = _measure(root, family, units, seq_len)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(costs, src=0)
    return costs[0]


def _measure(root, family, units, seq_len) -> list[float]:
    device = next(root.parameters()).device
    x = family.example_inputs(root, seq_len)[family.primary].to(device)
    out = [float("inf")] * len(units)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for _ in range(3):
            h = x
            for i, u in enumerate(units):
                inp = h.detach().requires_grad_(h.is_floating_point())
                t0 = time.perf_counter()
                y = family.forward(root, StageSpec(0, 1, (u,)), inp)
                y.float().sum().backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                out[i] = min(out[i], time.perf_counter() - t0)
                h = y.detach()
    for p in root.parameters():
        p.grad = None
    return out
