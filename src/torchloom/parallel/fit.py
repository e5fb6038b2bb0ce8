"""Does a strategy's tensor/pipeline degree fit a model? Asked before any process group exists.

The same checks the methods run when they apply (``check_divisible`` over the tensor-parallel plan,
``plan_stages`` of the pipeline), on a model that may live on the meta device, so a launcher can refuse a
degree before starting N processes that would each fail the same way.
"""
from __future__ import annotations

from torch import nn

from ..errors import StrategyError
from ..strategy.strategy import Strategy, StrategyLike


def check_tensor_parallel_fits(model: nn.Module, strategy: StrategyLike, tp: int) -> None:
    """Every dimension the strategy's tensor-parallel plan splits (heads, kv heads, MLP width, vocabulary,
    each planned module's split dimension, head-count attributes) divides by ``tp``.

    Nothing to check when ``tp == 1`` or the strategy has no ``tensor_parallel``.

    Raises:
        StrategyError: the method's own message (the dimension, its size and the degrees that divide it),
            or no built-in plan for the model.
    """
    strategy = Strategy.parse(strategy)
    config = strategy.config("tensor_parallel")
    if tp == 1 or config is None:
        return
    from .tensor import auto_plan, check_divisible, custom_plan, resolve_plan

    plan = auto_plan(model) if config.plan == "auto" else custom_plan(model, config.plan)
    check_divisible(model, resolve_plan(model, plan), tp)


def check_pipeline_fits(model: nn.Module, strategy: StrategyLike, pp: int) -> None:
    """The model can be cut into the strategy's ``pp x stages_per_rank`` pipeline stages (enough units;
    valid split points). ``balance='profile'`` is checked with the parameter split (nothing is measured).

    Raises:
        StrategyError: the method's own message (stages vs units, a bad split point, an unsupported model).
    """
    strategy = Strategy.parse(strategy)
    config = strategy.config("pipeline_parallel")
    if pp == 1 or config is None:
        return
    from .pipeline.build import plan_stages

    plan_stages(model, config, pp, profile=False)


def check_model_fits(model: nn.Module, strategy: StrategyLike, *, tp: int = 1, pp: int = 1) -> None:
    """:func:`check_tensor_parallel_fits` and :func:`check_pipeline_fits` (the model may be on the meta
    device; no process group is needed).

    Raises:
        StrategyError: from either check.
    """
    check_tensor_parallel_fits(model, strategy, tp)
    check_pipeline_fits(model, strategy, pp)


def fitting_degrees(check, candidates) -> list[int]:
    """The candidates ``d`` for which ``check(d)`` raises no :class:`StrategyError` (to list valid values
    in an error message)."""
    out = []
    for d in candidates:
        try:
            check(d)
        except StrategyError:
            continue
        out.append(d)
    return out
