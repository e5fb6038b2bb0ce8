"""`parallel_mode`: the degrees of the device mesh (ATorch's ``parallel_mode``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import StrategyError
from ..strategy.registry import Method, Stage, register_method

# ATorch / EPL dimension names -> ours
_DIM_ALIASES = {
    "data": "dp",
    "dp": "dp",
    "zero": "dp_shard",
    "fsdp": "dp_shard",
    "shard": "dp_shard",
    "replicate": "dp_replicate",
    "tensor": "tp",
    "model": "tp",
    "pipeline": "pp",
    "pipe": "pp",
    "expert": "ep",
    "sequence": "cp",
    "context": "cp",
}


@dataclass
class ParallelModeConfig:
    """Mesh degrees; None = decided by the other methods (data parallel takes the rest of the world).

    ``dp`` is the total data-parallel degree; it goes to ``dp_shard`` when a sharding method (fsdp) is in
    the strategy, else to ``dp_replicate``.
    """

    dp: int | None = None
    dp_replicate: int | None = None
    dp_shard: int | None = None
    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    cp: int | None = None

    def __post_init__(self):
        if self.dp is not None and (self.dp_replicate is not None or self.dp_shard is not None):
            raise StrategyError(
                "parallel_mode: give either 'dp' (total data parallel) or 'dp_replicate'/'dp_shard', not both."
            )


@register_method
class ParallelMode(Method):
    """Sets the mesh degrees. Accepts a dict (``{"dp_shard": 2, "tp": 2}``) or ATorch's tuple form
    ``([("data", 2), ("tensor", 2)], None)``."""

    name = "parallel_mode"
    Config = ParallelModeConfig
    stage = Stage.MESH

    @classmethod
    def normalise_config(cls, raw: Any) -> Any:
        if isinstance(raw, (tuple, list)) and raw and isinstance(raw[0], (tuple, list)):
            dims = raw[0]
            if dims and isinstance(dims[0], (tuple, list)):  # ATorch: ([(name, size), ...], rank_order)
                out: dict[str, int] = {}
                for name, size in dims:
                    if name not in _DIM_ALIASES:
                        from ..utils import did_you_mean

                        raise StrategyError(
                            f"parallel_mode: unknown dimension '{name}'.{did_you_mean(name, _DIM_ALIASES)} "
                            f"Valid: {', '.join(sorted(_DIM_ALIASES))}."
                        )
                    out[_DIM_ALIASES[name]] = size
                return out
        if isinstance(raw, dict):
            return {_DIM_ALIASES.get(k, k): v for k, v in raw.items()}
        return raw

    def configure(self, ctx) -> None:
        c = self.config
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "ep", "cp"):
            v = getattr(c, name)
            if v is not None:
                setattr(ctx.dims, name, v)
        if c.dp is not None:
            target = "dp_shard" if "fsdp" in ctx.strategy else "dp_replicate"
            setattr(ctx.dims, target, c.dp)
