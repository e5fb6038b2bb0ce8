"""Is a strategy valid for a model and mesh degrees? The checks ``auto_accelerate`` makes, without a process
group or an allocated model: the strategy's own checks (conflicts, requirements, option values), what each
method's ``configure`` checks (degrees, micro-batches, schedules), the data-parallel method it adds for
``dp > 1``, the degrees every method uses, then every method's ``validate(info, dims)`` with the whole
strategy in view (``method.planning_strategy``), so checks of combinations (sequence parallel's plan,
tensor parallel under fsdp, a pipeline schedule under ddp) run as ``apply`` runs them.
"""
from __future__ import annotations

from ..errors import StrategyError
from ..parallel.mesh import ParallelDims
from ..strategy.strategy import Strategy, StrategyLike
from ..cost.model_info import ModelInfo


def validate_strategy(strategy: StrategyLike, info: ModelInfo, dims: ParallelDims) -> Strategy:
    """Raise what ``auto_accelerate(model, strategy)`` would raise on ``dims.pp x dims.dp x dims.tp``
    ranks (``ep`` is carved out of ``dp``) for the model ``info`` describes (``info.module``: its meta-device copy).

    Returns:
        the strategy as ``auto_accelerate`` would apply it (with the data-parallel method it adds).

    Raises:
        StrategyError: the message ``auto_accelerate`` would give; also when the strategy's degrees resolve
            to other degrees than ``dims``.
    """
    from ..api import plan_dims
    from ..strategy.data_parallel import replicating_data_parallel

    strategy = Strategy.parse(strategy)
    world = dims.world
    planned = plan_dims(strategy, world)
    if planned != dims:
        raise StrategyError(f"the strategy's degrees resolve to {planned.as_dict()} on {world} ranks, not "
                            f"{dims.as_dict()}; give the degrees in parallel_mode.")
    methods = strategy.ordered()
    if dims.dp > 1 and not any(type(m).data_parallel for m in methods):
        _, spec = replicating_data_parallel(tensor_parallel="tensor_parallel" in strategy)
        strategy = strategy.with_method(spec)
        methods = strategy.ordered()
    for m in methods:
        m.planning_strategy = strategy
        try:
            m.validate(info, dims)
        finally:
            del m.planning_strategy
    return strategy
