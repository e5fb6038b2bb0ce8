"""The search space: every candidate plan for a model on ``world_size`` ranks, pruned cheaply first.

Axes (docs/search.md, "The space"): mesh factorisations ``pp x dp_replicate x dp_shard x tp`` (degree 1
included), for a Mixture-of-Experts model each with an expert-parallel degree ``ep`` among the common divisors
of ``dp`` and the expert count (``ep > 1`` with the ``expert_parallel`` method; :func:`ep_degrees`), the data-parallel method (DDP, ZeRO-1, ZeRO-2, ZeRO-3, HSDP; DDP under tensor parallelism is FSDP
over a replicate-only mesh, ``strategy/data_parallel.py``), precision (fp32, bf16 amp), sequence parallel
under TP, the pipeline schedule and its micro-batch count, the micro-batch size and accumulation for the
global batch, optional registered methods with ``search_configs``, then activation checkpointing (chosen per
candidate after the memory prediction: :func:`ac_levels`) and FSDP CPU offload (only when nothing fits).

Cheap pruning before any prediction: degrees the user pinned or excluded, a global batch the data-parallel
degree does not divide, tensor-parallel groups that would cross nodes, and a lower bound on the
parameter + gradient bytes per rank above the device memory. Then :func:`check` runs what ``auto_accelerate``
would reject (the strategy's conflicts, its mesh checks, each method's ``validate`` hook).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..errors import StrategyError
from ..parallel.dims import divisors, factorisations, spans_nodes
from ..parallel.mesh import ParallelDims
from .candidate import Candidate
from ..cost.model_info import ModelInfo
from .options import BUILTIN_CHOICES, SearchOptions

#: registry methods the space enumerates by its own rules
_OWN_METHODS = ("parallel_mode", "ddp", "zero1", "fsdp", "amp", "checkpoint", "pipeline_parallel",
                "tensor_parallel", "sequence_parallel", "expert_parallel", "context_parallel", "ulysses", "float8")
#: the method item a ``cp > 1`` candidate carries
CP_ITEM = ("context_parallel", {})
#: the alternative sequence split a ``cp > 1`` candidate may carry when cp divides the heads per tp rank
ULYSSES_ITEM = ("ulysses", {})
#: the float8 precision item (searched where the hardware has FP8 tensor cores)
FP8_ITEM = ("float8", {})
#: context parallelism is searched from this many tokens per sample: it exists to split the activations of long
#: sequences (Llama 3 used it only in its 128k phase; torchtitan's CP runs start at 32k); below, a sample's
#: activations fit with checkpointing and TP, and the ring's per-layer exchanges only cost
CP_MIN_SEQ = 16384
#: the largest cp degree searched (Llama 3 405B at 128k tokens: cp=16)
CP_MAX = 16
#: the method item an ``ep > 1`` candidate carries (its layout is the mesh's: no options to search)
EP_ITEM = ("expert_parallel", {})
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


#: how the reasons of batch arithmetic begin (the global batch or a pinned micro-batch does not split): the
#: search's summary of refusals lists them first, as the user's batch is the usual cause and the easiest fix
BATCH_REASONS = ("global batch ", "micro-batch ")


@dataclass
class Pruned:
    """A candidate (or a whole group of them, ``label`` ending in ``*``) left out, and why (``memory``: by
    the memory lower bound, not because it is invalid); ``layout``: the mesh's label (``pp1 dpr2 dps1 tp1``)."""

    label: str
    reason: str
    memory: bool = False
    layout: str = ""


@dataclass
class Space:
    """The enumerated bases (no checkpointing yet) and what was pruned before any prediction.

    Attributes:
        meshes: layouts (mesh degrees) that produced candidates; ``layouts``: every layout looked at.
        batch_dps: the data-parallel degrees whose layouts the global batch could not be split over.
    """

    bases: list[Candidate]
    pruned: list[Pruned] = field(default_factory=list)
    meshes: int = 0
    layouts: int = 0
    batch_dps: set[int] = field(default_factory=set)


def dp_spec(choice: str | None, dims: ParallelDims, offload: bool = False) -> tuple[str, dict[str, Any]] | None:
    """The method item of a data-parallel choice on ``dims`` (None: no data-parallel method)."""
    if choice is None:
        return ("fsdp", {"cpu_offload": True}) if offload else None
    if choice == "ddp":
        spec = ("fsdp", {"reshard_after_forward": False}) if dims.tp > 1 else ("ddp", {})
    elif choice == "zero1":
        spec = ("zero1", {})
    elif choice == "zero2":
        spec = ("fsdp", {"reshard_after_forward": False})
    else:  # zero3, hsdp
        spec = ("fsdp", {})
    if offload and spec[0] == "fsdp":
        spec = ("fsdp", {**spec[1], "cpu_offload": True})
    return spec


def dp_choices_for(dims: ParallelDims, allowed: Iterable[str]) -> list[str | None]:
    """Which data-parallel choices fit the degrees: DDP/ZeRO-1 on a replicate-only mesh, ZeRO-2/3 on a
    shard-only one, HSDP when both are > 1 (so no plan is enumerated twice under two spellings)."""
    if dims.dp == 1:
        return [None]
    if dims.dp_shard == 1:
        shape = ("ddp",) if dims.tp > 1 else ("ddp", "zero1")  # zero1 needs DDP, which cannot hold TP DTensors
    elif dims.dp_replicate == 1:
        shape = ("zero2", "zero3")
    else:
        shape = ("hsdp",)
    return [c for c in shape if c in allowed]


def ac_levels(info: ModelInfo, options: SearchOptions) -> list[dict[str, Any] | None]:
    """Activation checkpointing levels from least to most recomputation: none, then every k-th block for k
    in the divisors of the block count, largest k first (``{}`` = every block). The search keeps, per
    candidate, the first level whose predicted memory fits (EPL's automatic GC)."""
    if not info.num_blocks or "checkpoint" in options.exclude:
        return [None]
    levels: list[dict[str, Any] | None] = [{"every_k": k} if k > 1 else {}
                                           for k in sorted(divisors(info.num_blocks), reverse=True)]
    return levels if "checkpoint" in options.include else [None, *levels]


def with_extra(cand: Candidate, item: tuple[str, dict[str, Any]] | None) -> Candidate:
    """``cand`` with one more method item (None: unchanged)."""
    if item is None:
        return cand
    return Candidate(cand.dims, (*cand.methods, item), cand.micro_batch, cand.grad_accum, cand.seq_len)


def ep_degrees(info: ModelInfo, dims: ParallelDims, options: SearchOptions) -> list[int]:
    """Expert-parallel degrees to try on a mesh (``dims.ep`` is 1 there): 1, then every common divisor > 1
    of ``dp`` and the model's expert count (``ep`` is carved out of the data-parallel ranks and splits the
    experts evenly). Only 1 for a dense model or with ``expert_parallel`` excluded; only ``ep > 1`` with
    it included; a fixed ``ep`` alone."""
    ex = info.experts
    if ex is None or "expert_parallel" in options.exclude:
        degrees = [1]
    else:
        degrees = [d for d in divisors(math.gcd(dims.dp, ex.num_experts))]
        if "expert_parallel" in options.include:
            degrees = [d for d in degrees if d > 1]
    fixed = options.fixed.get("ep")
    return [d for d in degrees if fixed is None or d == fixed]


def state_lower_bound(info: ModelInfo, dims: ParallelDims, choice: str | None) -> float:
    """Bytes per rank that parameters and gradients need at least (no optimizer state, activations or
    buffers; perfect TP/PP division; experts ``1/ep`` where the data-parallel choice does not shard them
    further): a bound that can only under-estimate, used to prune before predicting."""
    pbytes = info.n_params * _DTYPE_BYTES.get(info.param_dtype, 4)
    gbytes = info.n_trainable * _DTYPE_BYTES.get(info.param_dtype, 4)
    experts = info.experts is not None and dims.ep > 1
    if experts and choice not in ("zero3", "hsdp"):
        saved = info.experts.params * _DTYPE_BYTES.get(info.param_dtype, 4) * (1 - 1 / dims.ep)
        pbytes -= saved
        gbytes -= min(saved, gbytes)
    model_split = dims.tp * dims.pp
    if choice in ("zero3",):  # experts / (ep x edp_shard) >= experts / dp
        return (pbytes + gbytes) / (model_split * dims.dp)
    if choice == "hsdp":  # dense / dp_shard, experts / lcm(ep, dp_shard): the larger divisor bounds both
        shard = math.lcm(dims.ep, dims.dp_shard) if experts else dims.dp_shard
        return (pbytes + gbytes) / (model_split * shard)
    if choice == "zero2":
        return (pbytes + gbytes / dims.dp) / model_split
    return (pbytes + gbytes) / model_split


def user_method_options(options: SearchOptions) -> list[list[tuple[str, dict[str, Any]] | None]]:
    """Per registered method outside the built-in axes: the items to try (None = absent). A method with
    ``search_configs`` is tried without it and with each config (only with them when included); an included
    method without them is added with its default config."""
    from ..strategy.registry import _REGISTRY, _ensure_builtins

    _ensure_builtins()
    out = []
    for name in sorted(_REGISTRY):
        if name in _OWN_METHODS or name in options.exclude:
            continue
        cls = _REGISTRY[name]
        configs = [(name, dict(c)) for c in (cls.search_configs or ())]
        if name in options.include:
            given = options.configs.get(name)
            out.append([(name, dict(given))] if given is not None else configs or [(name, {})])
        elif configs:
            out.append([None, *configs])
    return out


def enumerate_space(info: ModelInfo, world_size: int, global_batch: int, options: SearchOptions, *,
                    memory_bytes: float | None = None, ranks_per_node: int | None = None,
                    offload: bool = False, fp8: bool = False, context_parallel: bool = False) -> Space:
    """Every base candidate (without activation checkpointing) for ``world_size`` ranks and ``global_batch``
    samples per optimizer step at ``info.seq_len`` tokens, in a deterministic order.

    Args:
        memory_bytes: device memory per rank: candidates whose parameter + gradient bytes alone exceed
            ``(1 - headroom)`` of it are pruned before prediction. None: no such pruning.
        ranks_per_node: prune tensor-parallel groups that cross nodes (TP's collectives sit on the critical
            path of every block; torchtitan and Megatron keep TP inside a node). None: one node.
        offload: enumerate FSDP CPU-offload variants instead of the plain ones (the search does when no plain
            candidate fits).
        fp8: the hardware has FP8 tensor cores: ``float8`` (on bf16 amp) is a precision choice too.
        context_parallel: search ``cp > 1`` (the search does, for long sequences).

    Context parallelism (``cp > 1`` with ``context_parallel``, FSDP over ``dp_shard x cp``) is searched for
    sequences of :data:`CP_MIN_SEQ` tokens and more, degrees up to :data:`CP_MAX` that split the sequence into
    ``2 cp`` load-balanced chunks.

    Raises:
        StrategyError: a non-positive ``global_batch``.
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise StrategyError(f"search: the global batch must be a positive number of samples, got {global_batch!r}.")
    f = options.fixed
    allowed_dp = options.dp_choices()
    usable = None if memory_bytes is None else memory_bytes * (1 - options.headroom)
    precisions = [None] if "amp" in options.exclude else ([("amp", {"dtype": "bfloat16"})] if "amp" in options.include
                                                           else [None, ("amp", {"dtype": "bfloat16"})])
    if fp8 and "float8" not in options.exclude and "amp" not in options.exclude:
        precisions = [FP8_ITEM] if "float8" in options.include else [*precisions, FP8_ITEM]
    extras = user_method_options(options)
    space = Space(bases=[])
    for dims in _meshes(world_size, info, options, context_parallel):
        space.layouts += 1
        layout = mesh_label(dims)
        why = _mesh_pruned(dims, f, options, info, global_batch, ranks_per_node)
        if why:
            if why.startswith("global batch "):
                space.batch_dps.add(dims.dp)
            space.pruned.append(Pruned(layout + " *", why, layout=layout))
            continue
        local, mb = global_batch // dims.dp, f.get("micro_batch")
        if mb is not None and local % mb:
            space.pruned.append(Pruned(layout + " *", f"micro-batch {mb} (pinned) does not divide the {local} samples "
                                       f"per data-parallel rank (global batch {global_batch} / dp {dims.dp})",
                                       layout=layout))
            continue
        space.meshes += 1
        choices = dp_choices_for(dims, allowed_dp)
        if dims.cp > 1:  # FSDP shards over dp_shard x cp (context_parallel requires fsdp)
            choices = [c for c in (["zero3", "zero2"] if dims.dp == 1 else choices) if c in ("zero2", "zero3", "hsdp")
                       and c in allowed_dp]
            if not choices:
                space.pruned.append(Pruned(layout + " *", "context parallelism needs fsdp (zero2/zero3/hsdp), not "
                                           "allowed here", layout=layout))
                continue
        if dims.dp > 1 and not choices:
            space.pruned.append(Pruned(layout + " *", "no allowed data-parallel method fits this mesh "
                                       f"shape (allowed: {', '.join(allowed_dp)})", layout=layout))
            continue
        for choice in choices:
            if offload and choice in ("ddp", "zero1") and not (choice == "ddp" and dims.tp > 1):
                continue  # only FSDP offloads
            if usable is not None and not offload:
                need = state_lower_bound(info, dims, choice)
                if need > usable:
                    space.pruned.append(Pruned(f"{layout} {choice or 'none'} *",
                                               f"parameters + gradients alone need {_gib(need)} per rank > "
                                               f"{_gib(usable)} usable", memory=True, layout=layout))
                    continue
            dp_item = dp_spec(choice, dims, offload)
            if offload and dp_item is None:
                continue
            space.bases.extend(_bases_for(dims, dp_item, precisions, extras, global_batch, info.seq_len, options,
                                          _sequence_splits(info, dims, options)))
    return space


def _meshes(world_size: int, info: ModelInfo, options: SearchOptions,
            context_parallel: bool = False) -> list[ParallelDims]:
    """The factorisations of the world (``ep = 1``, :func:`torchloom.parallel.dims.factorisations`), each
    multiplied out by its expert-parallel degrees (:func:`ep_degrees`)."""
    out = []
    for dims in factorisations(world_size):
        out += [dataclasses.replace(dims, ep=ep) for ep in ep_degrees(info, dims, options)] or [dims]
    for cp in cp_degrees(info, world_size, options) if context_parallel else ():
        out += [dataclasses.replace(dims, cp=cp) for dims in factorisations(world_size // cp)]
    return out


def cp_degrees(info: ModelInfo, world_size: int, options: SearchOptions) -> list[int]:
    """Context-parallel degrees > 1 to search: for sequences of :data:`CP_MIN_SEQ` tokens or more (or when
    ``context_parallel`` is included, or ``cp`` pinned), up to :data:`CP_MAX`, dividing the world and splitting
    the sequence into ``2 cp`` chunks; none for a model with experts (not combined yet) or excluded."""
    pinned = options.fixed.get("cp")
    if "context_parallel" in options.exclude or info.experts is not None or not info.sequence:
        return []
    if pinned is not None:
        return [pinned] if pinned > 1 and world_size % pinned == 0 else []
    if info.seq_len < CP_MIN_SEQ and "context_parallel" not in options.include:
        return []
    return [c for c in divisors(world_size) if 1 < c <= CP_MAX and info.seq_len % (2 * c) == 0]


def _sequence_splits(info: ModelInfo, dims: ParallelDims, options: SearchOptions) -> list[tuple | None]:
    """The sequence-split items of a ``cp > 1`` mesh: ring attention, and Ulysses where cp divides the query
    heads per tensor-parallel rank (and neither is excluded); ``[None]`` for ``cp = 1``."""
    if dims.cp == 1:
        return [None]
    out = [CP_ITEM] if "context_parallel" not in options.exclude else []
    d = info.dims
    heads = d.get("num_heads")
    if "ulysses" not in options.exclude and heads and not heads % dims.tp and not (heads // dims.tp) % dims.cp:
        out.append(ULYSSES_ITEM)
    return out or [CP_ITEM]


def _bases_for(dims, dp_item, precisions, extras, global_batch, seq_len, options,
               splits=(None,)) -> list[Candidate]:
    local = global_batch // dims.dp
    mbs = [m for m in divisors(local) if (options.max_micro_batch is None or m <= options.max_micro_batch)
           and m == options.fixed.get("micro_batch", m)]
    tp_items: list[list[tuple[str, dict]]] = [[]]
    if dims.tp > 1:
        sp = [False] if "sequence_parallel" in options.exclude else (
            [True] if "sequence_parallel" in options.include else [False, True])
        tp_items = [[("tensor_parallel", {}), *([("sequence_parallel", {})] if s else [])] for s in sp]
    schedules = options.pipeline_schedules if dims.pp > 1 else (None,)
    out = []
    for prec, tp, sched, extra, mb, split in itertools.product(precisions, tp_items, schedules,
                                                               itertools.product(*extras), mbs, splits):
        accum = local // mb
        if sched is not None and not _schedule_may_fit(sched, dims.pp, accum, dp_item):
            continue
        items = ([i for i in (dp_item, prec) if i is not None] + list(tp) + ([EP_ITEM] if dims.ep > 1 else [])
                 + ([split] if split is not None else []))
        if sched is not None:
            items.append(("pipeline_parallel", {"schedule": sched, "num_microbatches": accum}))
        items += [e for e in extra if e is not None]
        if _conflicting(tuple(n for n, _ in items)):
            continue
        out.append(Candidate(dims, tuple(items), mb, accum, seq_len))
        if accum > 1 and sched is None and dp_item is not None and dp_item[0] == "fsdp" and dims.dp_shard * dims.cp > 1 \
                and "accumulate_sharded" not in dp_item[1]:
            # FSDP under accumulation: unsharded gradients between micro-batches (one reduce-scatter per step),
            # or a reduce-scatter per micro-batch keeping them sharded (torchtitan's): memory against traffic
            sharded = ("fsdp", {**dp_item[1], "accumulate_sharded": True})
            out.append(Candidate(dims, tuple(sharded if i is dp_item else i for i in items), mb, accum, seq_len))
    return out


@lru_cache(maxsize=4096)
def _conflicting(names: tuple[str, ...]) -> bool:
    """Two methods that declare a conflict (``zero1`` with ``pipeline_parallel``, ...; the implied ``ddp`` of
    ``zero1`` included): never enumerated, as ``Strategy`` would reject them."""
    from ..strategy.registry import resolve_name
    from ..strategy.strategy import _conflict_reason

    full = set(names)
    for n in names:
        full |= {resolve_name(d)[0].name for d in resolve_name(n)[0].implies}
    full = sorted(full)
    return any(_conflict_reason(a, b) for i, a in enumerate(full) for b in full[i + 1:])


def _schedule_may_fit(schedule: str, pp: int, n: int, dp_item) -> bool:
    """The pipeline schedules' cheapest rules, to skip hopeless candidates before :func:`check` (which stays
    the authority: ``pipeline_parallel``'s configure checks): 1F1B needs ``n >= pp`` micro-batches, the
    interleaved schedules a multiple of ``n // pp``, and the zero-bubble ones a data-parallel method that keeps
    parameters unsharded between forward and backward (no DDP, no ZeRO-3)."""
    if schedule == "1f1b" and n < pp:
        return False
    if schedule in ("interleaved_1f1b", "zero_bubble") and n % max(1, n // pp):
        return False
    if schedule in ("zero_bubble", "zbv") and dp_item is not None:
        name, cfg = dp_item
        if name != "fsdp" or cfg.get("reshard_after_forward", True):
            return False
    return True


def _mesh_pruned(dims, fixed, options, info, global_batch, ranks_per_node) -> str | None:
    for k, v in fixed.items():
        if k in ("pp", "dp_replicate", "dp_shard", "tp", "cp") and getattr(dims, k) != v:
            return f"search fixed {k}={v}"
        if k == "dp" and dims.dp != v:
            return f"search fixed dp={v}"
    if "ep" in fixed and dims.ep != fixed["ep"]:
        if info.experts is None:
            return f"search fixed ep={fixed['ep']}, but the model has no experts modules"
        e = info.experts.num_experts
        if e % fixed["ep"]:
            return f"search fixed ep={fixed['ep']}, which does not divide num_experts={e}"
        return f"search fixed ep={fixed['ep']}, which does not divide dp={dims.dp}"
    if dims.ep == 1 and "expert_parallel" in options.include:
        return ("expert_parallel included (ep > 1 needed)" if info.experts is not None else
                "expert_parallel included, but the model has no experts modules")
    if dims.tp > 1 and "tensor_parallel" in options.exclude:
        return "tensor_parallel excluded"
    if dims.pp > 1 and "pipeline_parallel" in options.exclude:
        return "pipeline_parallel excluded"
    if dims.cp == 1 and "context_parallel" in options.include:
        return "context_parallel included (cp > 1 needed)"
    if dims.tp == 1 and options.include & {"tensor_parallel", "sequence_parallel"}:
        return "tensor_parallel included (tp > 1 needed)"
    if dims.pp == 1 and "pipeline_parallel" in options.include:
        return "pipeline_parallel included (pp > 1 needed)"
    if dims.dp == 1 and options.include & {"ddp", "zero1", "zero2", "zero3", "hsdp", "fsdp"}:
        return "a data-parallel method is included (dp > 1 needed)"
    if global_batch % dims.dp:
        return f"global batch {global_batch} is not divisible by dp={dims.dp}"
    if info.num_blocks and dims.pp > info.num_blocks:
        return f"pp={dims.pp} > {info.num_blocks} blocks"
    if ranks_per_node and dims.tp > 1 and spans_nodes(dims, "tp", ranks_per_node):
        return f"tp={dims.tp} groups would cross nodes of {ranks_per_node} ranks"
    return None


_CHECKED: dict[str, str | None] = {}


def check(cand: Candidate, info: ModelInfo) -> str | None:
    """Why ``auto_accelerate`` would reject ``cand`` (:func:`torchloom.search.validate.validate_strategy`: the
    strategy's conflicts and requirements, the mesh and schedule checks its methods' ``configure`` makes, then
    each method's ``validate(info, dims)`` with the whole strategy in view), or None when it passes.

    Memoised per model, degrees and methods without the batch split: the pipeline's micro-batch count is
    checked on its own with ``pipeline_parallel``'s rule (the only check that reads it), the rest once per
    group. ``info.module=None`` runs the hooks' architecture-size checks only (fast); with the meta-device
    module they run the model-structure checks ``apply`` makes (TP plan resolution, pipeline stage plan)."""
    pp_cfg = cand.config("pipeline_parallel")
    if pp_cfg and pp_cfg.get("num_microbatches") is not None:
        from ..methods.pipeline_parallel import PipelineConfig, _check_microbatches

        try:
            _check_microbatches(PipelineConfig(**pp_cfg), cand.dims.pp)
        except StrategyError as e:
            return str(e)
    methods = [[n, {k: v for k, v in c.items() if not (n == "pipeline_parallel" and k == "num_microbatches")}]
               for n, c in cand.methods]
    model = info.signature or [info.name, info.n_params, info.num_blocks, info.block_classes, info.dims]
    key = json.dumps([model, info.module is not None, id(info.module) if not info.signature else 0,
                      repr(cand.dims), methods], sort_keys=True, default=str)  # repr: every degree, no deep copy
    if key in _CHECKED:
        return _CHECKED[key]
    rep = Candidate(cand.dims, tuple((n, dict(c)) for n, c in methods), cand.micro_batch, cand.grad_accum,
                    cand.seq_len)
    reason = _check(rep, info)
    if len(_CHECKED) > 200_000:
        _CHECKED.clear()
    _CHECKED[key] = reason
    return reason


def _check(cand: Candidate, info: ModelInfo) -> str | None:
    from .validate import validate_strategy

    try:
        validate_strategy(cand.strategy(), info, cand.dims)
    except StrategyError as e:
        return str(e)
    return None


def mesh_label(d: ParallelDims) -> str:
    """A layout's degrees in words: ``pp1 dpr2 dps1 tp1`` (``ep4`` added when > 1)."""
    return (f"pp{d.pp} dpr{d.dp_replicate} dps{d.dp_shard}{f' ep{d.ep}' if d.ep > 1 else ''}"
            f"{f' cp{d.cp}' if d.cp > 1 else ''} tp{d.tp}")


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


__all__ = ["Space", "Pruned", "enumerate_space", "ac_levels", "check", "with_extra", "dp_spec", "dp_choices_for",
           "state_lower_bound", "ep_degrees", "mesh_label", "BATCH_REASONS", "BUILTIN_CHOICES"]
