"""Mesh degrees reasoned about without a process group: every factorisation of a world size, the size of each
named view, and which views cross node boundaries (the planning side of :class:`~torchloom.parallel.mesh.
ParallelMesh`, which builds the live mesh only when a strategy is applied).

Views follow the mesh's layout (outermost first ``pp, dp_replicate, dp_shard, tp``; ranks are numbered
row-major, so ``tp`` peers are adjacent ranks): ``dp`` = dp_replicate x dp_shard (what ``mesh["dp"]`` gives),
``dp_shard``, ``dp_replicate``, ``tp``, ``pp``, and the expert views carved out of ``dp``: ``ep`` (the inner
``ep`` data-parallel ranks: stride ``tp``) and ``edp`` = dp / ep (stride ``ep x tp``).
"""
from __future__ import annotations

import math
from functools import lru_cache

from ..errors import StrategyError
from .mesh import ParallelDims

#: the planner's layout, outermost first (the live mesh's ``DIM_NAMES`` with ``cp`` between ``dp_shard`` and
#: ``tp``, torchtitan's order; a degree of 1 changes no stride)
PLAN_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

#: the named views of a mesh and the dimensions each one spans (``dp_shard_cp``: what FSDP shards over under
#: context parallelism; ``dp_cp``: what gradients are reduced over)
VIEWS: dict[str, tuple[str, ...]] = {
    "pp": ("pp",), "dp_replicate": ("dp_replicate",), "dp_shard": ("dp_shard",), "tp": ("tp",), "cp": ("cp",),
    "dp": ("dp_replicate", "dp_shard"), "ep": ("ep",), "edp": ("edp",),
    "dp_shard_cp": ("dp_shard", "cp"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    if n < 1:
        raise ValueError(f"divisors of {n}: need a positive integer.")
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]  # O(sqrt n): a global batch can be large
    return small + [n // d for d in reversed(small) if d * d != n]


@lru_cache(maxsize=64)
def _factorisations(world_size: int) -> tuple[tuple[int, int, int, int], ...]:
    out = []
    for pp in divisors(world_size):
        r1 = world_size // pp
        for dpr in divisors(r1):
            r2 = r1 // dpr
            for dps in divisors(r2):
                out.append((pp, dpr, dps, r2 // dps))
    return tuple(out)


def factorisations(world_size: int) -> list[ParallelDims]:
    """Every ``pp x dp_replicate x dp_shard x tp = world_size`` (``ep = 1``), degree-1 cases included, in a
    fixed order (pp, then dp_replicate, then dp_shard increasing). 1,024 ranks give 286.

    Raises:
        StrategyError: ``world_size`` is not a positive integer.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise StrategyError(f"world size must be a positive integer, got {world_size!r}.")
    return [ParallelDims(pp=pp, dp_replicate=r, dp_shard=s, tp=t) for pp, r, s, t in _factorisations(world_size)]


def view_size(dims: ParallelDims, view: str) -> int:
    """Ranks in one group of the named view (``"dp"`` = dp_replicate x dp_shard).

    Raises:
        StrategyError: an unknown view name (the valid ones listed).
    """
    if view not in VIEWS:
        raise StrategyError(f"unknown mesh view {view!r}; valid: {', '.join(VIEWS)}.")
    if view == "edp":
        return dims.edp
    size = 1  # (a flattened view spans consecutive dims: their degrees multiply)
    for d in VIEWS[view]:
        size *= getattr(dims, d)
    return size


def view_stride(dims: ParallelDims, view: str) -> int:
    """Distance in global rank between neighbouring members of the view's innermost dimension (``tp``: 1;
    ``ep``: ``tp``, the inner data-parallel ranks; ``edp``: ``ep x tp``)."""
    if view in ("ep", "edp"):
        return dims.tp * dims.cp * (dims.ep if view == "edp" else 1)
    inner = PLAN_DIMS.index(VIEWS[view][-1])
    stride = 1
    for d in PLAN_DIMS[inner + 1:]:
        stride *= getattr(dims, d)
    return stride


def spans_nodes(dims: ParallelDims, view: str, ranks_per_node: int) -> bool:
    """True when one group of ``view`` holds ranks of more than one node (nodes are consecutive blocks of
    ``ranks_per_node`` global ranks, as torchrun numbers them). A group's ranks run from its first rank over
    ``(size - 1) * stride`` for the innermost dimension (and further for a flattened view), so it stays on one
    node exactly when that whole extent fits in a node and starts node-aligned: with ``ranks_per_node`` a
    multiple of the extent, which the row-major layout guarantees for power-of-two shapes.

    Raises:
        StrategyError: ``ranks_per_node`` < 1, or an unknown view.
    """
    if ranks_per_node < 1:
        raise StrategyError(f"ranks_per_node must be >= 1, got {ranks_per_node}.")
    size = view_size(dims, view)
    if size <= 1:
        return False
    # extent of one group in global ranks: the outermost dimension's stride times its degree
    if view in ("ep", "edp"):
        extent = view_stride(dims, view) * size
    else:
        outer = VIEWS[view][0]
        extent = view_stride(dims, outer) * getattr(dims, outer)
    return extent > ranks_per_node or ranks_per_node % extent != 0


def describe(dims: ParallelDims, ranks_per_node: int | None = None) -> dict[str, dict[str, int | bool]]:
    """``{view: {"size": n, "spans_nodes": bool}}`` for every named view (``spans_nodes`` only when
    ``ranks_per_node`` is given)."""
    out: dict[str, dict[str, int | bool]] = {}
    for v in VIEWS:
        out[v] = {"size": view_size(dims, v)}
        if ranks_per_node is not None:
            out[v]["spans_nodes"] = spans_nodes(dims, v, ranks_per_node)
    return out
