"""The user's ``search={...}`` dict of ``strategy="auto"``, validated into :class:`SearchOptions`.

Search vocabulary (what ``include``/``exclude`` name): the data-parallel choices ``ddp``, ``zero1``, ``zero2``,
``zero3``, ``hsdp`` (``fsdp`` names zero2, zero3 and hsdp together), ``tensor_parallel``,
``sequence_parallel``, ``pipeline_parallel``, ``expert_parallel`` (``ep > 1``, Mixture-of-Experts models
only), ``checkpoint``, ``amp``, ``cpu_offload``, and any registered
method (a method with ``search_configs`` is tried with and without; another one named in ``include`` is added
to every candidate with its default config). Registry aliases are accepted (``pp``, ``ac``, ``amp_native``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import StrategyError
from ..utils import did_you_mean

#: data-parallel choices of the search and the method spec each one stands for
DP_CHOICES = ("ddp", "zero1", "zero2", "zero3", "hsdp")
#: built-in names the space enumerates by its own rules (their ``search_configs`` are not used)
BUILTIN_CHOICES = (*DP_CHOICES, "fsdp", "tensor_parallel", "sequence_parallel", "pipeline_parallel",
                   "expert_parallel", "checkpoint", "amp", "cpu_offload")
FIXED_KEYS = ("pp", "dp_replicate", "dp_shard", "tp", "dp", "ep", "cp", "micro_batch")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
KEYS = ("exclude", "include", "fixed", "time_limit_s", "top_k", "on_mismatch", "model_factory", "cache",
        "headroom", "trial_steps", "pipeline_schedules", "max_micro_batch", "seq_len", "sample_batch", "configs")


@dataclass
class SearchOptions:
    """Validated search options (see :meth:`parse` for each key's meaning and default)."""

    exclude: frozenset[str] = frozenset()
    include: frozenset[str] = frozenset()
    fixed: dict[str, int] = field(default_factory=dict)
    time_limit_s: float = 60.0
    top_k: int = 3
    on_mismatch: str = "error"
    model_factory: Callable[[], Any] | None = None
    cache: bool = True
    headroom: float = 0.05
    trial_steps: int = 3
    pipeline_schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b", "zero_bubble")
    max_micro_batch: int | None = None
    seq_len: int | None = None
    sample_batch: Any = None
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def parse(cls, search: "dict[str, Any] | SearchOptions | None") -> "SearchOptions":
        """Read a ``search={...}`` dict.

        Keys: ``exclude`` / ``include`` (lists of names, see the module docstring); ``fixed`` (degrees
        ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``, ``dp``, ``ep`` and ``micro_batch`` pinned to a positive int);
        ``time_limit_s`` (whole search incl. confirming runs, default 60); ``top_k`` (candidates confirmed by
        real runs, default 3; 0 = predictions only); ``on_mismatch`` (``"error"``, default, or
        ``"research"``: a saved plan from another machine/model/world size is searched again);
        ``model_factory`` (zero-argument callable building a fresh model per trial); ``cache`` (reuse and
        store plans in the plan cache, default True); ``headroom`` (fraction of device memory kept free,
        default 0.05); ``trial_steps`` (timed steps per trial, default 3); ``pipeline_schedules`` (default
        1f1b, interleaved_1f1b, zero_bubble); ``max_micro_batch``; ``seq_len`` (tokens per sample; default:
        dim 1 of the sample batch); ``sample_batch`` (one batch to analyse the model and, without a dataset,
        to train the trials on: ATorch's ``sample_batch``); ``configs`` (``{name: config}``: the config an
        included registered method is added to every candidate with, e.g. ``{"compile": {"components":
        ["model", "loss"]}}``; default: its default config).

        Raises:
            StrategyError: not a dict, an unknown key or name (closest suggested, valid ones listed), a bad
                value, or a name both included and excluded.
        """
        if search is None:
            return cls()
        if isinstance(search, SearchOptions):
            return search
        if not isinstance(search, dict):
            raise StrategyError(f"search must be a dict of options (e.g. {{'top_k': 3, 'exclude': "
                                f"['pipeline_parallel']}}), got {type(search).__name__} {search!r}.")
        unknown = [k for k in search if k not in KEYS]
        if unknown:
            hints = "".join(did_you_mean(str(k), KEYS) for k in unknown)
            raise StrategyError(f"unknown search option(s) {unknown}.{hints} Valid: {', '.join(KEYS)}.")
        o = cls()
        o.exclude = frozenset(_names(search.get("exclude", ()), "exclude"))
        o.include = frozenset(_names(search.get("include", ()), "include"))
        both = o.exclude & o.include
        if both:
            raise StrategyError(f"search: {sorted(both)} both included and excluded; keep one.")
        o.fixed = _fixed(search.get("fixed") or {})
        o.time_limit_s = _number(search, "time_limit_s", o.time_limit_s, lo=0.0, strict=True)
        o.top_k = int(_number(search, "top_k", o.top_k, lo=0, integer=True))
        o.trial_steps = int(_number(search, "trial_steps", o.trial_steps, lo=1, integer=True))
        o.headroom = _number(search, "headroom", o.headroom, lo=0.0)
        if o.headroom >= 1:
            raise StrategyError(f"search: headroom is the fraction of memory kept free, in [0, 1); got {o.headroom}.")
        if search.get("seq_len") is not None:
            o.seq_len = int(_number(search, "seq_len", 1, lo=1, integer=True))
        o.sample_batch = search.get("sample_batch")
        if search.get("max_micro_batch") is not None:
            o.max_micro_batch = int(_number(search, "max_micro_batch", 1, lo=1, integer=True))
        on_mismatch = search.get("on_mismatch", o.on_mismatch)
        if on_mismatch not in ("error", "research"):
            raise StrategyError(f"search: on_mismatch must be 'error' or 'research', got {on_mismatch!r}.")
        o.on_mismatch = on_mismatch
        factory = search.get("model_factory")
        if factory is not None and not callable(factory):
            raise StrategyError(f"search: model_factory must be a zero-argument callable returning the model, got "
                                f"{factory!r}.")
        o.model_factory = factory
        cache = search.get("cache", True)
        if not isinstance(cache, bool):
            raise StrategyError(f"search: cache must be True or False, got {cache!r}.")
        o.cache = cache
        schedules = search.get("pipeline_schedules", o.pipeline_schedules)
        if isinstance(schedules, str) or not schedules or any(s not in SCHEDULES for s in schedules):
            raise StrategyError(f"search: pipeline_schedules must be a non-empty list of {', '.join(SCHEDULES)}; got "
                                f"{schedules!r}.")
        o.pipeline_schedules = tuple(schedules)
        configs = search.get("configs") or {}
        if not isinstance(configs, dict) or not all(isinstance(v, dict) for v in configs.values()):
            raise StrategyError(f"search: configs maps an included method's name to its config dict, e.g. "
                                f"{{'compile': {{'components': ['model', 'loss']}}}}; got {configs!r}.")
        configs = {canonical_choice(str(k)): v for k, v in configs.items()}
        stray = sorted(set(configs) - o.include)
        if stray:
            raise StrategyError(f"search: configs for {stray}, which are not included; add them to include.")
        o.configs = {k: dict(v) for k, v in configs.items()}
        o._check_consistent()
        return o

    def _check_consistent(self) -> None:
        f = self.fixed
        if f.get("tp", 1) > 1 and "tensor_parallel" in self.exclude:
            raise StrategyError(f"search: fixed tp={f['tp']} but tensor_parallel is excluded; drop one.")
        if f.get("pp", 1) > 1 and "pipeline_parallel" in self.exclude:
            raise StrategyError(f"search: fixed pp={f['pp']} but pipeline_parallel is excluded; drop one.")
        if f.get("tp") == 1 and self.include & {"tensor_parallel", "sequence_parallel"}:
            raise StrategyError("search: fixed tp=1 but tensor/sequence parallel is included; drop one.")
        if f.get("pp") == 1 and "pipeline_parallel" in self.include:
            raise StrategyError("search: fixed pp=1 but pipeline_parallel is included; drop one.")
        if f.get("ep", 1) > 1 and "expert_parallel" in self.exclude:
            raise StrategyError(f"search: fixed ep={f['ep']} but expert_parallel is excluded; drop one.")
        if f.get("ep") == 1 and "expert_parallel" in self.include:
            raise StrategyError("search: fixed ep=1 but expert_parallel is included (ep > 1 needed); drop one.")
        if "dp" in f and ("dp_replicate" in f and "dp_shard" in f) and f["dp"] != f["dp_replicate"] * f["dp_shard"]:
            raise StrategyError(f"search: fixed dp={f['dp']} differs from dp_replicate x dp_shard = "
                                f"{f['dp_replicate'] * f['dp_shard']}.")
        dp_allowed = self.dp_choices()
        if not dp_allowed:
            raise StrategyError(f"search: every data-parallel method is excluded ({', '.join(DP_CHOICES)}); keep one "
                                "(or fix dp=1).")

    def dp_choices(self) -> tuple[str, ...]:
        """Data-parallel choices left after include/exclude (an included one restricts to the included)."""
        excluded = set(self.exclude)
        if "fsdp" in excluded:
            excluded |= {"zero2", "zero3", "hsdp"}
        included = {n for n in self.include if n in DP_CHOICES} | (
            {"zero2", "zero3", "hsdp"} if "fsdp" in self.include else set())
        pool = [c for c in DP_CHOICES if c not in excluded]
        return tuple(c for c in pool if c in included) if included else tuple(pool)

    def cache_dict(self) -> dict[str, Any]:
        """What changes the search's answer (the plan cache key part): not the callable, cache or
        on_mismatch flags."""
        return {"exclude": sorted(self.exclude), "include": sorted(self.include), "fixed": dict(sorted(self.fixed.items())),
                "top_k": self.top_k, "headroom": self.headroom, "trial_steps": self.trial_steps,
                "pipeline_schedules": list(self.pipeline_schedules), "max_micro_batch": self.max_micro_batch}


def canonical_choice(name: str) -> str:
    """A search-vocabulary name, or a registered method's canonical name.

    Raises:
        StrategyError: neither (closest names suggested, the vocabulary listed).
    """
    if name in BUILTIN_CHOICES:
        return name
    from ..strategy.registry import _ALIASES, _REGISTRY, _ensure_builtins, resolve_name

    _ensure_builtins()
    if name in ("parallel_mode",):
        raise StrategyError("search: 'parallel_mode' is not a method to include or exclude; pin degrees with "
                            "search={'fixed': {'tp': 2}}.")
    if name in _REGISTRY or name in _ALIASES:
        return resolve_name(name)[0].name
    known = sorted({*BUILTIN_CHOICES, *_REGISTRY, *_ALIASES} - {"parallel_mode"})
    raise StrategyError(f"search: unknown method {name!r}.{did_you_mean(name, known)} Valid: {', '.join(known)}.")


def _names(value: Any, key: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(v, str) for v in value):
        raise StrategyError(f"search: {key} must be a list of method names, got {value!r}.")
    return [canonical_choice(v) for v in value]


def _fixed(value: Any) -> dict[str, int]:
    if not isinstance(value, dict):
        raise StrategyError(f"search: fixed must be a dict such as {{'tp': 2}}, got {value!r}.")
    out = {}
    for k, v in value.items():
        if k not in FIXED_KEYS:
            raise StrategyError(f"search: unknown fixed key {k!r}.{did_you_mean(str(k), FIXED_KEYS)} Valid: "
                                f"{', '.join(FIXED_KEYS)}.")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise StrategyError(f"search: fixed {k} must be a positive integer, got {v!r}.")
        out[k] = v
    return out


def _number(d: dict, key: str, default: float, *, lo: float, integer: bool = False, strict: bool = False) -> float:
    v = d.get(key, default)
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    ok = ok and (v > lo if strict else v >= lo) and (not integer or float(v).is_integer())
    if not ok:
        kind = "an integer" if integer else "a number"
        raise StrategyError(f"search: {key} must be {kind} {'>' if strict else '>='} {lo:g}, got {v!r}.")
    return v
