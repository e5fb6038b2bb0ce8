"""Apply a tensor-parallel plan to one module (the model or a pipeline stage) with ``parallelize_module``.

Steps: resolve the plan's patterns to module names (and, for a user plan, the head-count attributes of the
modules whose projections are column-wise sharded, :mod:`.heads`); check every split dimension and head count
divides tp (before any change, so a bad degree leaves the model untouched); shard module by module; divide
the per-rank head attributes; re-tie parameters that were shared before sharding (each owner got its own
DTensor).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from ...errors import StrategyError
from .conv1d import is_conv1d
from .heads import HeadAttr, divide_head_attrs, find_head_attrs
from .plans import TPPlan
from .styles import SHARDING_STYLES, Flags, check_applicable, split_sizes, style_for


@dataclass
class ResolvedPlan:
    """A plan bound to one module: ``targets`` maps module name -> style (plan order); ``matched`` holds the
    patterns that matched at least one module here; ``head_attrs`` the head counts a user plan divides by tp
    (:func:`.heads.find_head_attrs`; empty for built-in plans, whose families list their own)."""

    plan: TPPlan
    targets: dict[str, str]
    matched: set[str]
    head_attrs: list[HeadAttr] = field(default_factory=list)


def resolve_plan(part: nn.Module, plan: TPPlan) -> ResolvedPlan:
    """Match the plan's patterns against ``part``'s module names (see :func:`name_matches`).

    Raises:
        StrategyError: two patterns claim the same module, or a style cannot shard the matched module.
    """
    modules = dict(part.named_modules())
    targets: dict[str, str] = {}
    owner: dict[str, str] = {}
    matched: set[str] = set()
    for pattern, style in plan.styles.items():
        for name, module in modules.items():
            if not name or not name_matches(name, pattern):
                continue
            if name in owner:
                raise StrategyError(
                    f"tensor_parallel: module {name} matches both plan patterns '{owner[name]}' and '{pattern}'; "
                    "make the patterns specific enough that each module gets one style."
                )
            check_applicable(style, module, name)
            owner[name], targets[name] = pattern, style
            matched.add(pattern)
    heads: list[HeadAttr] = []
    if plan.family == "custom":
        known = {name: attrs for pattern, attrs in plan.local_attrs.items() for name in modules
                 if name and name_matches(name, pattern)}
        heads = find_head_attrs(part, targets, known)
    return ResolvedPlan(plan, targets, matched, heads)


def name_matches(name: str, pattern: str) -> bool:
    """``fnmatch`` per dotted component, as ``parallelize_module`` and transformers' tp plans match:
    ``layers.*.mlp`` matches ``layers.0.mlp`` but not ``layers.0.attn.mlp``."""
    atoms, pats = name.split("."), pattern.split(".")
    return len(atoms) == len(pats) and all(fnmatchcase(a, p) for a, p in zip(atoms, pats))


def check_divisible(part: nn.Module, resolved: ResolvedPlan, tp: int) -> None:
    """Every dimension the plan splits must be divisible by ``tp``.

    Raises:
        StrategyError: naming the module (or config field), the dimension, its size and the valid degrees.
    """
    model = type(part).__name__
    for what, size in resolved.plan.divisible.items():
        if size % tp:
            raise StrategyError(
                f"tensor_parallel: {model} {what} = {size} is not divisible by tp={tp}, so the ranks cannot hold "
                f"equal whole parts. Use a tp degree that divides it ({_divisors(size)}) or change the model."
            )
    modules = dict(part.named_modules())
    for name, style in resolved.targets.items():
        for label, size in split_sizes(style, modules[name]):
            if size % tp:
                raise StrategyError(
                    f"tensor_parallel: {name} ('{style}') splits its {label} = {size} over tp={tp}, which does not "
                    f"divide it. Use a tp degree that divides {size} ({_divisors(size)}) or leave the module out "
                    "of the plan."
                )
    for pattern, attrs in resolved.plan.local_attrs.items():
        for name, module in _sharded_parents(part, resolved, pattern):
            for attr in attrs:
                value = getattr(module, attr, None)
                if isinstance(value, int) and value % tp:
                    raise StrategyError(
                        f"tensor_parallel: {name}.{attr} = {value} is not divisible by tp={tp}. Use a tp degree "
                        f"that divides it ({_divisors(value)})."
                    )
    for h in resolved.head_attrs:
        if h.value % tp:
            raise StrategyError(
                f"tensor_parallel: {h.module}.{h.attr} = {h.value} ({type(modules[h.module]).__name__}) is not "
                f"divisible by tp={tp}: its column-wise sharded projections ({', '.join(h.children)}) cannot give "
                f"every rank whole heads. Use a tp degree that divides {h.value} ({_divisors(h.value)}) or change "
                "the model's head count."
            )


def check_fsdp_compatible(part: nn.Module, resolved: ResolvedPlan) -> None:
    """FSDP shards dim 0 of every parameter; on top of a strided tensor-parallel split of the same dim the
    2-D layout cannot be gathered back (checkpoints, full state dicts).

    Raises:
        StrategyError: a 'fused_qkv' nn.Linear (its fused output features are dim 0) with fsdp.
    """
    modules = dict(part.named_modules())
    for name, style in resolved.targets.items():
        if style == "fused_qkv" and not is_conv1d(modules[name]):
            raise StrategyError(
                f"tensor_parallel: {name} is an nn.Linear with 'fused_qkv' (q/k/v interleaved over tp ranks on dim 0), "
                "which fsdp would shard on dim 0 again; that layout cannot be gathered for checkpoints. Drop fsdp "
                "for this model (tensor parallelism alone), or split the projection into separate q/k/v Linears."
            )


def parallelize_part(part: nn.Module, mesh: DeviceMesh, resolved: ResolvedPlan, flags: Flags) -> Counter:
    """Shard ``part`` in place following ``resolved`` (call :func:`check_divisible` first).

    Returns:
        how many modules got each active style.

    Raises:
        StrategyError: parameters tied before sharding would end up with different layouts (e.g. a tied
            embedding split by columns and a head split by rows).
    """
    ties = _tied_slots(part)
    modules = dict(part.named_modules())
    applied: Counter = Counter()
    for name, style_name in resolved.targets.items():
        style = style_for(style_name, modules[name], name, flags)
        if style is not None:
            parallelize_module(modules[name], mesh, style)
            applied[style_name] += 1
    tp = mesh.size()
    for pattern, attrs in resolved.plan.local_attrs.items():
        for _, module in _sharded_parents(part, resolved, pattern):
            for attr in attrs:
                if isinstance(getattr(module, attr, None), int):
                    setattr(module, attr, getattr(module, attr) // tp)
    divide_head_attrs(part, resolved.head_attrs, tp)
    _retie(ties)
    return applied


def _sharded_parents(part: nn.Module, resolved: ResolvedPlan, pattern: str):
    """Modules matching ``pattern`` that contain a module whose parameters the plan shards."""
    sharded = [n for n, s in resolved.targets.items() if s in SHARDING_STYLES]
    for name, module in part.named_modules():
        if name and name_matches(name, pattern) and any(s.startswith(name + ".") for s in sharded):
            yield name, module


def _tied_slots(part: nn.Module) -> list[list[tuple[nn.Module, str, str]]]:
    """Groups of (module, parameter name, qualified name) that hold one parameter object."""
    slots: dict[int, list[tuple[nn.Module, str, str]]] = defaultdict(list)
    for qual, module in part.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is not None:
                slots[id(p)].append((module, pname, f"{qual}.{pname}" if qual else pname))
    return [v for v in slots.values() if len(v) > 1]


def _retie(groups) -> None:
    """Sharding gave each owner of a tied parameter its own DTensor: make them share one again."""
    for group in groups:
        current = [m._parameters[n] for m, n, _ in group]
        dtensors = list({id(p): p for p in current if isinstance(p, DTensor)}.values())
        if not dtensors or all(p is current[0] for p in current):
            continue
        layouts = {(p.device_mesh, p.placements) for p in dtensors}
        if len(layouts) > 1:
            names = [q for _, _, q in group]
            raise StrategyError(
                f"tensor_parallel: the tied parameters {names} would be sharded differently "
                f"({[p.placements for p in dtensors]}); give their modules styles that split the shared weight the "
                "same way (a tied embedding and output head: 'vocab_embedding' with 'lm_head')."
            )
        for module, pname, _ in group:
            module._parameters[pname] = dtensors[0]


def _divisors(n: int) -> str:
    found = [str(d) for d in range(2, min(n, 64) + 1) if n % d == 0]
    return "e.g. " + ", ".join(found[:8]) if found else "none above 1"
