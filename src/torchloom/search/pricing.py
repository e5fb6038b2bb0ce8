"""The cost model applied to a search candidate: the candidate's method objects (what ``auto_accelerate``
would apply) handed to :func:`torchloom.cost.model.predict`. The search, ``loom plan`` and the benchmarks call
:func:`predict` here; :mod:`torchloom.cost` itself never imports the method registry (methods import it)."""
from __future__ import annotations

from typing import Any

from ..cost import model as _model
from ..cost.hardware import Hardware
from ..cost.model_info import ModelInfo
from ..cost.step import Prediction
from ..strategy.registry import resolve_name
from .candidate import Candidate


def predict(cand: Candidate, info: ModelInfo, hw: Hardware, *, memory_limit: float | None = None) -> Prediction:
    """:func:`torchloom.cost.model.predict` for ``cand`` with its method objects.

    Raises:
        StrategyError: a method name that is not registered.
        ValueError: hardware without the calibration a term needs.
    """
    return _model.predict(cand, info, hw, method_instances(cand), memory_limit=memory_limit)


def compose(cand: Candidate, info: ModelInfo, hw: Hardware) -> "_model.Composed":
    """:func:`torchloom.cost.model.compose` for ``cand`` with its method objects.

    Raises:
        StrategyError: a method name that is not registered.
    """
    return _model.compose(cand, info, hw, method_instances(cand))


# -- methods -------------------------------------------------------------------------------------------
_METHOD_CACHE: dict[str, Any] = {}


def method_instances(cand: Candidate) -> list:
    """The candidate's method objects in stage order, with what ``auto_accelerate`` adds: implied methods,
    and a data-parallel method for dp > 1 when none is given (ddp; under tensor parallelism a replicating
    fsdp, ``torchloom.strategy.data_parallel``). Memoised by the methods' names and configs."""
    try:
        key = (tuple((n, tuple(sorted(c.items()))) for n, c in cand.methods), cand.dims.dp > 1)
        hash(key)
    except TypeError:  # list-valued options (wrap_cls): a text key
        import json

        key = (json.dumps([[n, c] for n, c in cand.methods], sort_keys=True, default=str), cand.dims.dp > 1)
    out = _METHOD_CACHE.get(key)
    if out is None:
        out = _METHOD_CACHE[key] = _build_methods(cand)
    return out


def _build_methods(cand: Candidate) -> list:
    from ..strategy.data_parallel import REPLICATING_FSDP

    items = [(n, dict(c)) for n, c in cand.methods if n != "parallel_mode"]
    names = set()
    for n, _ in list(items):
        cls, _ = resolve_name(n)
        names.add(cls.name)
        for imp in cls.implies:
            if imp not in names and all(resolve_name(x)[0].name != imp for x, _ in items):
                items.append((imp, {}))
    if cand.dims.dp > 1 and not any(resolve_name(n)[0].data_parallel for n, _ in items):
        name, config = REPLICATING_FSDP if "tensor_parallel" in names else ("ddp", {})
        items.append((name, dict(config)))
    out = []
    for n, c in items:
        cls, overrides = resolve_name(n)
        out.append(cls(cls.Config(**{cls.key_aliases.get(k, k): v for k, v in {**overrides, **c}.items()})))
    return sorted(out, key=lambda m: type(m).stage)
