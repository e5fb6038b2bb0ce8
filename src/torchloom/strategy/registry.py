"""The method registry: every strategy method declares its config schema, what it requires, implies and
conflicts with, and its stage in the application order. Users add their own with :func:`register_method`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import StrategyError
from ..utils import did_you_mean

if TYPE_CHECKING:
    from ..context import AccelContext
    from ..parallel.mesh import ParallelDims
    from ..cost.step import StepShape
    from ..cost.effects import Effects
    from ..cost.hardware import Hardware
    from ..cost.model_info import ModelInfo


@dataclass
class NoConfig:
    """A method without options."""


class Method:
    """Base class of a strategy method (Lightning-Fabric-style strategy object).

    Subclasses set the class attributes and implement the hooks they need. Hooks run in ``stage`` order
    (lower first); the stages used by the built-in methods are the ``Stage`` constants.

    Class attributes:
        name: canonical name used in strategies (``"fsdp"``).
        aliases: other names that select this method, each with the config overrides it implies
            (``{"zero2": {"reshard_after_forward": False}}``).
        Config: a dataclass of the method's options (its fields are the valid config keys).
        key_aliases: old config key -> new key (accepts ATorch spellings).
        stage: position in the application order.
        requires: methods that must also be present (error if missing).
        implies: methods added with default config when absent (e.g. ``zero1`` implies ``ddp``).
        conflicts: ``{other_method: why}``; either side may declare it.
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[dict[str, dict[str, Any]]] = {}
    Config: ClassVar[type] = NoConfig
    key_aliases: ClassVar[dict[str, str]] = {}
    stage: ClassVar[int] = 50
    requires: ClassVar[tuple[str, ...]] = ()
    implies: ClassVar[tuple[str, ...]] = ()
    conflicts: ClassVar[dict[str, str]] = {}
    #: True for methods that wrap the model for data parallelism (ddp, fsdp): they own gradient sync, and
    #: without one a dp degree > 1 gets ``ddp`` added.
    data_parallel: ClassVar[bool] = False
    #: mesh dimensions this method parallelises (a degree > 1 on a dimension no method claims is an error)
    mesh_dims: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any):
        self.config = config

    # Hooks, all optional. ``ctx`` is the AccelContext being built.
    def configure(self, ctx: "AccelContext") -> None:
        """Before any model change: record settings other methods read (e.g. amp's dtype, mesh dims)."""

    def apply(self, ctx: "AccelContext") -> None:
        """Transform ``ctx.model`` (wrap, shard, cast, checkpoint, compile)."""

    def wrap_optimizer(self, ctx: "AccelContext") -> None:
        """After the optimizer is built: wrap or replace ``ctx.optimizer``."""

    # Planning hooks (no process group, no allocated model): used by ``strategy="auto"`` and ``loom plan``.
    #: configs the search tries for this method (each a dict of options); empty = the search never adds it
    #: on its own (it still evaluates strategies that name it). See docs/search.md, "Your own method".
    search_configs: ClassVar[tuple[dict[str, Any], ...]] = ()

    def validate(self, info: "ModelInfo", dims: "ParallelDims") -> None:
        """The pure checks ``apply`` would make, on a model description (``info.module`` is the meta-device
        model) and resolved mesh degrees: TP divisibility, pipeline split points, degree conflicts.

        Raises:
            StrategyError: the same message ``apply`` would give.
        """

    def estimate(self, info: "ModelInfo", dims: "ParallelDims", hw: "Hardware",
                 step: "StepShape") -> "Effects | None":
        """What this method does per rank and per optimizer step: memory by category, compute, and the
        collectives it adds (kind, bytes, group, overlap); see :class:`torchloom.cost.effects.Effects`.
        None (the default): no effect the cost model needs to know about."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


class Stage:
    """Application order of the built-in methods (torchtitan order: TP, then AC, then compile, then FSDP)."""

    MESH = 0
    CAST = 10
    REPLACE = 12  # module_replace: after half's cast, before pipeline splitting and TP
    PIPELINE = 15
    TENSOR = 20
    PRECISION = 25
    ACTIVATION_CHECKPOINT = 30
    COMPILE = 40
    DATA_PARALLEL = 50
    OPTIMIZER = 60


_REGISTRY: dict[str, type[Method]] = {}
_ALIASES: dict[str, tuple[str, dict[str, Any]]] = {}


def register_method(cls: type[Method] | None = None, *, override: bool = False):
    """Register a :class:`Method` subclass (usable as a decorator).

    Raises:
        StrategyError: the name or an alias is already taken (pass ``override=True`` to replace it).
    """

    def _register(c: type[Method]) -> type[Method]:
        if not c.name:
            raise StrategyError(f"{c.__name__} must set a class attribute `name` to be registered.")
        names = [c.name, *c.aliases]
        if not override:
            for n in names:
                if n in _REGISTRY or n in _ALIASES:
                    raise StrategyError(
                        f"method name '{n}' is already registered; pick another name or pass override=True."
                    )
        _REGISTRY[c.name] = c
        for alias, overrides in c.aliases.items():
            _ALIASES[alias] = (c.name, dict(overrides))
        return c

    return _register(cls) if cls is not None else _register


def unregister_method(name: str) -> None:
    cls = _REGISTRY.pop(name, None)
    if cls is not None:
        for alias in cls.aliases:
            _ALIASES.pop(alias, None)


def all_names() -> list[str]:
    """Every accepted name: canonical names and aliases."""
    _ensure_builtins()
    return sorted([*_REGISTRY, *_ALIASES])


def resolve_name(name: str) -> tuple[type[Method], dict[str, Any]]:
    """Map a name or alias to (method class, config overrides the alias implies).

    Raises:
        StrategyError: unknown name; the message suggests the closest valid names.
    """
    _ensure_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name], {}
    if name in _ALIASES:
        canonical, overrides = _ALIASES[name]
        return _REGISTRY[canonical], dict(overrides)
    raise StrategyError(
        f"unknown strategy method '{name}'.{did_you_mean(name, all_names())} "
        f"Valid methods: {', '.join(sorted(_REGISTRY))} (aliases: {', '.join(sorted(_ALIASES))})."
    )


def get_method(name: str) -> type[Method]:
    return resolve_name(name)[0]


_BUILTINS_LOADED = False


def _ensure_builtins() -> None:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        from .. import methods  # noqa: F401  (registers the built-in methods)
