"""Stage assignment: which contiguous run of a model's pipeline units each stage holds.

A *unit* is the smallest piece the pipeline may cut between (the embedding, one transformer block, the final
norm, the head); the model family lists them in execution order (``families.py``). A split is a list of
``num_stages`` non-empty, contiguous runs of units covering all of them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ...errors import StrategyError
from ...utils import did_you_mean


@dataclass(frozen=True)
class Unit:
    """One cuttable piece of the model, in execution order.

    name: the FQN a split point names to start a stage here (``"model.layers.2"``).
    modules: FQNs of the modules the unit owns (``("transformer.wte", "transformer.wpe", "transformer.drop")``).
    kind: ``"embed"``, ``"block"``, ``"norm"`` or ``"head"`` (the stage runner dispatches on it).
    index: the block's position in its ``ModuleList`` (blocks only), else -1.
    """

    name: str
    modules: tuple[str, ...]
    kind: str
    index: int = -1


@dataclass(frozen=True)
class StageSpec:
    """The units one pipeline stage holds. ``index``/``num_stages``: its place in the whole pipeline."""

    index: int
    num_stages: int
    units: tuple[Unit, ...] = field(default_factory=tuple)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def module_names(self) -> list[str]:
        return [m for u in self.units for m in u.modules]

    def describe(self) -> str:
        """``"model.embed_tokens..model.layers.1"`` (first and last unit)."""
        a, b = self.units[0].name, self.units[-1].name
        return a if a == b else f"{a}..{b}"


def split_by_points(units: list[Unit], split_points: list[str], num_stages: int) -> list[list[Unit]]:
    """Cut ``units`` before each split point (names of units that begin a new stage).

    Raises:
        StrategyError: a name that is not a unit (with the closest names), the first unit (a stage cannot
            start before it), a repeated or out-of-order name, or ``len(split_points) != num_stages - 1``.
    """
    names = [u.name for u in units]
    if len(split_points) != num_stages - 1:
        raise StrategyError(
            f"pipeline_parallel: {len(split_points)} split_points give {len(split_points) + 1} stages but the pipeline "
            f"has {num_stages} (pp size x stages_per_rank); give {num_stages - 1} split points or leave split_points "
            f"unset for an automatic split."
        )
    positions = []
    for p in split_points:
        if p not in names:
            raise StrategyError(
                f"pipeline_parallel: split point {p!r} is not a module the pipeline can cut before."
                f"{did_you_mean(p, names[1:])} Valid split points, in order: {', '.join(names[1:])}."
            )
        if p == names[0]:
            raise StrategyError(
                f"pipeline_parallel: split point {p!r} is the first unit; the first stage cannot be empty.")
        positions.append(names.index(p))
    if positions != sorted(set(positions)):
        raise StrategyError(
            f"pipeline_parallel: split_points {split_points} must be distinct and in model order ({', '.join(names)})."
        )
    bounds = [0, *positions, len(units)]
    return [units[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def balance_by_cost(costs: list[float], num_stages: int) -> list[int]:
    """Contiguous partition of ``costs`` into ``num_stages`` non-empty runs minimising the largest run's sum
    (the pipeline's slowest stage sets its pace). Returns the start index of every stage after the first.

    Exact dynamic programme, O(n^2 k); ties are broken towards earlier cuts, so the result is deterministic.
    Memoised on its arguments (a search asks for the same split for every candidate of a pipeline degree).

    Raises:
        StrategyError: fewer units than stages.
    """
    return list(_balance_by_cost(tuple(float(c) for c in costs), num_stages))


@functools.lru_cache(maxsize=256)
def _balance_by_cost(costs: tuple[float, ...], num_stages: int) -> tuple[int, ...]:
    """The uncached :func:`balance_by_cost`."""
    n = len(costs)
    if num_stages > n:
        raise StrategyError(
            f"pipeline_parallel: {num_stages} stages but the model has only {n} units to distribute; lower the pp "
            f"size or stages_per_rank."
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: minimal max-stage cost of the first i units in k stages; cut[k][i]: start of the k-th stage
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = v, j
    starts, i = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return tuple(sorted(starts)[1:])


def split_by_cost(units: list[Unit], costs: list[float], num_stages: int) -> list[list[Unit]]:
    """:func:`balance_by_cost` applied to ``units``."""
    if len(costs) != len(units):
        raise ValueError(f"{len(costs)} costs for {len(units)} units")
    bounds = [0, *balance_by_cost(costs, num_stages), len(units)]
    return [units[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
