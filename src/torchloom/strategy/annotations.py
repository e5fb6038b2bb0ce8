"""EPL-style parallelism annotations: ``replicate`` and ``split`` scopes written into a model's ``__init__``
(or applied to existing submodules) and translated into an ordinary :class:`Strategy`.

Follows Alibaba EPL (Jia et al., "Whale: Efficient Giant Model Training over Heterogeneous GPUs",
USENIX ATC 2022; https://github.com/alibaba/EasyParallelLibrary, docs/en/api/strategy.md). Mapping rules
(docs/annotations.md):

* each ``replicate`` scope is one pipeline stage; a new stage begins at the first module of every
  ``replicate`` scope after the first, in module order (``model.named_modules()``);
* scopes of one kind with the same ``name`` are one scope (reopening ``replicate(name="A")`` continues stage A);
* a ``split`` scope is tensor parallel: modules of a Hugging Face family with a built-in ``tensor_parallel``
  plan get that plan's entries, others a shape rule (gate/up -> down become ``colwise``/``rowwise``, other
  Linears ``colwise_gather``, Embeddings ``vocab_embedding``); see :mod:`.split_rule`. A top-level ``split``
  is colocated with the stage it falls in (EPL's ``cluster.colocate_split_and_replicate``);
* every stage gets the same ``tp`` devices (tp = the split degree): modules outside ``split`` scopes are
  replicated over them, so one model replica uses ``pp x tp`` devices and data parallelism takes the rest
  of the world;
* a ``split`` scope around an experts module (:mod:`torchloom.moe.protocol`), or around a block holding one,
  is expert parallel, as EPL configures M6: ``ep`` = the scope's device count, carved out of the
  data-parallel ranks (it must divide ``dp`` and every ``num_experts``); the MoE block's router and shared
  experts stay replicated (data parallel); see :mod:`.split_experts`.

An annotation is a plain attribute (:data:`ATTR`) on the modules: forward, parameters and state-dict keys
are untouched, and it survives ``copy.deepcopy`` and pickling.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.nn.modules import module as _module_hooks

from ..errors import StrategyError
from .config import config_to_dict
from .registry import resolve_name
from .split_experts import expert_split
from .split_rule import split_plan
from .strategy import Strategy, StrategyLike

#: attribute holding a module's annotation: ``{"replicate": Scope, "split": Scope}`` (either key optional)
ATTR = "_torchloom_annotation"
_uids = itertools.count()
_local = threading.local()  # .stack: the scopes open in this thread, outermost first


@dataclass(frozen=True, eq=False)
class Scope:
    """One ``replicate`` or ``split`` annotation. Use it as a context manager around submodule construction,
    or call it on existing modules.

    Attributes:
        kind: ``"replicate"`` (a pipeline stage, replicated for data parallelism) or ``"split"`` (tensor
            parallel).
        device_count: devices of one model replica this scope runs on (see :func:`replicate`, :func:`split`).
        name: a label shown in plans and errors (default ``"replicate#<n>"``/``"split#<n>"``).
        uid: identity of an unnamed scope (kept by deepcopy and pickling).

    Scopes are equal when kind and ``name`` are equal (unnamed ones: kind and ``uid``), so reopening
    ``replicate(1, name="A")`` continues scope A.
    """

    kind: str
    device_count: int
    name: str | None = None
    uid: int = field(default_factory=lambda: next(_uids))

    @property
    def label(self) -> str:
        return self.name or f"{self.kind}#{self.uid}"

    @property
    def key(self) -> tuple:
        return (self.kind, self.name) if self.name else (self.kind, self.uid)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Scope) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __enter__(self) -> "Scope":
        stack = _stack()
        for outer in stack:
            if outer.kind == "split" or self.kind == outer.kind:
                raise StrategyError(
                    f"{self.kind} scope '{self.label}' is opened inside {outer.kind} scope '{outer.label}'; "
                    "scopes nest only as a split inside a replicate (a tensor-parallel part of a pipeline stage). "
                    "Close the outer scope first."
                )
        if not stack:
            _local.handles = [
                _module_hooks.register_module_module_registration_hook(lambda parent, name, sub: _record(sub)),
                _module_hooks.register_module_parameter_registration_hook(lambda mod, name, p: _record(mod)),
                _module_hooks.register_module_buffer_registration_hook(lambda mod, name, b: _record(mod)),
            ]
        stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        stack = _stack()
        stack.remove(self)
        if not stack:
            for h in _local.handles:
                h.remove()
            _local.handles = []

    def __call__(self, *modules: nn.Module) -> Any:
        """Annotate existing modules and all their submodules; returns the module (or the tuple of modules).

        Raises:
            TypeError: an argument is not an ``nn.Module``.
            StrategyError: a module already belongs to another scope of the same kind.
        """
        if not modules:
            raise TypeError(f"{self.kind}(...)(module): pass at least one nn.Module to annotate.")
        for m in modules:
            if not isinstance(m, nn.Module):
                raise TypeError(f"{self.kind} annotates nn.Module objects, got {type(m).__name__}.")
        subs = [sub for m in modules for sub in m.modules()]
        for sub in subs:  # check all before changing any
            _check_free(sub, self)
        for sub in subs:
            _mark(sub, self)
        return modules[0] if len(modules) == 1 else modules


def replicate(*modules: Any, device_count: int | None = None, name: str | None = None) -> Any:
    """A pipeline stage whose modules are replicated (data parallel over the model replicas).

    Forms::

        with torchloom.replicate(device_count=1):       # in __init__: modules registered here form the stage
            self.layers = nn.ModuleList(...)
        with torchloom.replicate(1, name="stage0"):     # EPL style: the device count positionally
            ...
        torchloom.replicate(model.model.layers[2:])      # existing modules and their submodules
        torchloom.replicate(1)(layer2, layer3)           # the same: a scope object called on modules

    Args:
        modules: modules to annotate now (then the annotated module, or the tuple of them, is returned), or
            a single int: the device count (EPL's ``replicate(1)``).
        device_count: devices one model replica of this stage uses (default 1): 1, or the model's
            ``split`` degree (the stage is then colocated with the tensor-parallel group and replicated over
            it). More replicas (data parallelism) are derived from the world size.
        name: label for plans and errors.

    Returns:
        a :class:`Scope` (context manager, callable on modules), or the annotated module(s).

    Raises:
        StrategyError: ``device_count`` not a positive int, or given twice.
        TypeError: arguments that are neither modules nor one device count.
    """
    targets, count = _targets("replicate", modules, device_count)
    scope = Scope("replicate", _check_count("replicate", 1 if count is None else count, minimum=1), name)
    return scope(*targets) if targets else scope


def split(*modules: Any, device_count: int | None = None, name: str | None = None) -> Any:
    """A tensor-parallel scope: its Linear and Embedding modules are split over ``device_count`` devices; its
    experts modules (MoE, :mod:`torchloom.moe.protocol`) are spread over ``device_count`` expert-parallel ranks
    instead (EPL's ``split`` around M6's experts), with the rest of their MoE block replicated.

    Forms::

        with torchloom.split(device_count=2):        # in __init__
            self.head = nn.Linear(512, 1000)
        torchloom.split(model.head, device_count=2)   # an existing module; returns it
        torchloom.split(2)(model.head)                # the same, EPL style

    Args:
        modules: modules to annotate now, or a single int: the device count.
        device_count: the tensor-parallel degree, or for experts the expert-parallel degree (an int >= 2);
            required.
        name: label for plans and errors.

    Returns:
        a :class:`Scope`, or the annotated module(s).

    Raises:
        StrategyError: no, invalid or twice-given ``device_count``.
        TypeError: arguments that are neither modules nor one device count.
    """
    targets, count = _targets("split", modules, device_count)
    if count is None:
        raise StrategyError("split needs device_count, the tensor-parallel degree (for experts: the expert-parallel "
                            "degree): split(device_count=2).")
    scope = Scope("split", _check_count("split", count, minimum=2), name)
    return scope(*targets) if targets else scope


def _targets(kind: str, args: tuple, device_count: Any) -> tuple[tuple[nn.Module, ...], Any]:
    """Split ``replicate``/``split``'s positional arguments into modules to annotate and a device count."""
    if len(args) == 1 and not isinstance(args[0], nn.Module):
        if device_count is not None:
            raise StrategyError(f"{kind}: device_count given twice (positionally and by keyword); give it once.")
        return (), args[0]
    bad = [a for a in args if not isinstance(a, nn.Module)]
    if bad:
        raise TypeError(f"{kind} takes modules to annotate or one device count, got {bad[0]!r}.")
    return args, device_count


def has_annotations(model: nn.Module) -> bool:
    """True when any submodule of ``model`` carries a ``replicate``/``split`` annotation."""
    return any(getattr(m, ATTR, None) for m in model.modules())


def clear_annotations(model: nn.Module) -> None:
    """Remove every annotation from ``model`` and its submodules (to annotate it afresh)."""
    for m in model.modules():
        m.__dict__.pop(ATTR, None)


@dataclass
class AnnotationPlan:
    """What a model's annotations mean, independent of the world size.

    Attributes:
        stages: labels of the ``replicate`` scopes in stage order (empty: no replicate scope, one stage).
        split_points: FQN of the first module of every stage after the first (pipeline ``split_points``).
        tp: tensor-parallel degree (1 without ``split`` scopes that give tensor-parallel entries).
        tp_plan: ``{module FQN: style}`` for the dense modules inside ``split`` scopes (:mod:`.split_rule`);
            empty when not derived.
        ep: expert-parallel degree: the ``device_count`` of the split scopes around experts modules (1: none);
            ``ep`` is carved out of the data-parallel ranks, so it does not change ``devices_per_replica``.
        experts: FQNs of the experts modules in split scopes (:mod:`.split_experts`).
        experts_cls: their class names (``expert_parallel``'s ``experts_cls``).
        mixed: True when a split scope holds experts and also gives tensor-parallel entries.
    """

    stages: list[str]
    split_points: list[str]
    tp: int
    tp_plan: dict[str, str]
    ep: int = 1
    experts: list[str] = field(default_factory=list)
    experts_cls: list[str] = field(default_factory=list)
    mixed: bool = False

    @property
    def pp(self) -> int:
        return max(len(self.stages), 1)

    @property
    def devices_per_replica(self) -> int:
        return self.pp * self.tp


def plan_from_annotations(model: nn.Module, derive_tp_plan: bool = True) -> AnnotationPlan:
    """Read ``model``'s annotations into an :class:`AnnotationPlan`.

    Args:
        derive_tp_plan: derive ``tp_plan`` from the split scopes (False: an explicit plan will replace it).

    Raises:
        StrategyError: tensor-parallel split scopes with different device counts, a replicate device count
            that is neither 1 nor the split degree, replicate scopes interleaved in module order (A, B, A), two
            scopes of one name with different device counts, split scopes the tensor-parallel rule cannot
            classify (:func:`.split_rule.split_plan`), or invalid split scopes around experts
            (:func:`.split_experts.expert_split`).
    """
    _check_same_name_counts(model)
    eff = _effective(model)
    split_of = {n: a.get("split") for n, a in eff.items()}
    experts = expert_split(model, split_of)
    dense_of = {n: (None if n in experts.replicated else s) for n, s in split_of.items()}
    # scopes without experts are tensor parallel; one with experts is too if its other modules get entries
    tp_scopes = [s for s in _distinct(dense_of.values()) if s not in experts.scopes]
    _check_tp_counts(tp_scopes)
    tp_plan: dict[str, str] = {}
    if derive_tp_plan and any(dense_of.values()):
        tp_plan = split_plan(model, dense_of, expert_scopes=experts.scopes)
        tp_scopes += [s for s in _distinct(dense_of[n] for n in tp_plan) if s not in tp_scopes]
    elif not derive_tp_plan:
        tp_scopes += [s for s in _distinct(dense_of.values()) if s not in tp_scopes]
    _check_tp_counts(tp_scopes)
    tp = tp_scopes[0].device_count if tp_scopes else 1
    stages, split_points = _stages(model, eff)
    allowed = sorted({1, tp, experts.ep})  # EPL's replicate(N) + split(N) colocates the stage with the split
    for s in stages:
        if s.device_count not in allowed:
            hint = ("1 (no split scope in the model)" if len(allowed) == 1 else
                    f"1 or {allowed[1]} (the split degree)" if len(allowed) == 2 else
                    f"1, {allowed[1]} or {allowed[2]} (the split degrees)")
            raise StrategyError(
                f"replicate scope '{s.label}' has device_count={s.device_count}, but every pipeline stage runs on the "
                f"same tensor-parallel group here, so a replicate stage uses {hint}; data parallelism over the other "
                f"devices is derived from the world size. Use replicate(device_count=1)."
            )
    return AnnotationPlan([s.label for s in stages], split_points, tp, tp_plan, experts.ep, list(experts.experts),
                          experts.classes, mixed=any(s in tp_scopes for s in experts.scopes))


def _check_tp_counts(scopes: list[Scope]) -> None:
    if len({s.device_count for s in scopes}) > 1:
        raise StrategyError(
            "split scopes have different device counts ("
            + ", ".join(f"'{s.label}': {s.device_count}" for s in scopes)
            + "); tensor parallelism is one mesh dimension, so give every split the same device_count."
        )


def strategy_from_annotations(model: nn.Module, world_size: int, base: StrategyLike = None) -> Strategy:
    """The :class:`Strategy` equivalent to ``model``'s annotations on ``world_size`` processes.

    The derived methods are ``parallel_mode`` (``dp`` = world size / (pp x tp), and ``ep`` with split scopes
    around experts), ``pipeline_parallel`` (``size``, ``split_points``) when there are several stages,
    ``tensor_parallel`` (``size``, ``plan``) when split scopes give tensor-parallel entries, and
    ``expert_parallel`` (``experts_cls``) when split scopes hold experts modules. ``base`` (any strategy form)
    is merged in: its other methods are appended, and for a method both have, every config key ``base`` sets
    explicitly overrides the derived value (so ``("tensor_parallel", {"plan": {...}})`` replaces the derived
    plan, whose rule is then not consulted, and ``("pipeline_parallel", {"schedule": "1f1b"})`` keeps the
    derived split points); a data-parallel degree in ``base``'s ``parallel_mode`` (``dp``/``dp_replicate``/
    ``dp_shard``) replaces the derived ``dp``. With tensor-parallel split scopes and more than one model
    replica, ``fsdp`` is added unless ``base`` names a data-parallel method (DDP cannot hold tensor-parallel
    parameters): the replicas then shard their parameters (ZeRO-3), which computes the same as replication.

    Raises:
        StrategyError: the annotations are invalid (see :func:`plan_from_annotations`), ``world_size`` is not
            a multiple of the devices one model replica needs, or the expert-parallel degree does not divide
            the data-parallel degree.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise StrategyError(f"world_size must be a positive int, got {world_size!r}.")
    base = Strategy.parse(base)
    given = {e.name: config_to_dict(e.config) for e in base.entries if not e.implied}
    plan = plan_from_annotations(model, derive_tp_plan="plan" not in given.get("tensor_parallel", {}))
    per_replica = plan.devices_per_replica
    if world_size % per_replica:
        raise StrategyError(
            f"the annotations need {per_replica} devices per model replica ({plan.pp} pipeline stage(s) x "
            f"tensor-parallel degree {plan.tp}), which does not divide the world size {world_size}; run on a "
            f"multiple of {per_replica} processes or change the replicate/split scopes."
        )
    dp = world_size // per_replica
    derived: dict[str, dict[str, Any]] = {"parallel_mode": {"dp": dp}}
    if plan.pp > 1:
        derived["pipeline_parallel"] = {"size": plan.pp, "split_points": plan.split_points}
    if plan.tp > 1:
        derived["tensor_parallel"] = {"size": plan.tp, **({"plan": plan.tp_plan} if plan.tp_plan else {})}
    pm = given.get("parallel_mode", {})
    if plan.ep > 1:
        _check_ep_divides_dp(plan, world_size, dp, pm)
        derived["parallel_mode"]["ep"] = plan.ep
        derived["expert_parallel"] = {"experts_cls": plan.experts_cls}
    if any(k in pm for k in ("dp", "dp_replicate", "dp_shard")):
        derived["parallel_mode"].pop("dp")
    dp_method = any(resolve_name(n)[0].data_parallel for n in given)
    if plan.tp > 1 and world_size > per_replica and not dp_method:
        derived["fsdp"] = {}  # DDP cannot hold tensor-parallel DTensor parameters; FSDP2 can (2-D, as torchtitan)
    items: list[Any] = [(n, {**cfg, **given.get(n, {})}) for n, cfg in derived.items()]
    items += [(n, cfg) for n, cfg in given.items() if n not in derived]
    return Strategy(items)


def _check_ep_divides_dp(plan: AnnotationPlan, world_size: int, dp: int, pm: dict[str, Any]) -> None:
    """ep is carved out of the data-parallel ranks (``parallel/mesh.py``), so it must divide the derived dp
    (a dp or ep given in ``base`` is checked by the mesh instead)."""
    if dp % plan.ep == 0 or any(k in pm for k in ("dp", "dp_replicate", "dp_shard", "ep")):
        return
    need = plan.devices_per_replica * plan.ep
    tp_part = (f" The tensor-parallel entries of the split scopes (degree {plan.tp}) use other devices than the "
               f"expert-parallel ranks; to spread only the experts, put the split scopes around the experts modules "
               f"alone (e.g. torchloom.split({plan.experts[0]}, device_count={plan.ep}))." if plan.mixed else "")
    raise StrategyError(
        f"the split scopes around experts ask for expert parallel degree ep={plan.ep}, but on {world_size} "
        f"processes the data-parallel degree is {dp} ({world_size} / ({plan.pp} pipeline stage(s) x tensor-parallel "
        f"degree {plan.tp})), and ep must divide it: expert-parallel ranks are data-parallel ranks that hold "
        f"different experts. Run on a multiple of {need} processes or lower the split's device_count.{tp_part}"
    )


# -- recording ---------------------------------------------------------------------------------------
def _stack() -> list[Scope]:
    if not hasattr(_local, "stack"):
        _local.stack, _local.handles = [], []
    return _local.stack


def _record(module: nn.Module | None) -> None:
    """Registration hook: a module registered while scopes are open belongs to them; the first record
    wins (a module built in one scope and attached to its parent later keeps the scope it was built in)."""
    stack = _stack()
    if module is None or not stack or getattr(module, ATTR, None):
        return
    for scope in stack:
        _mark(module, scope)


def _check_free(module: nn.Module, scope: Scope) -> None:
    old = (getattr(module, ATTR, None) or {}).get(scope.kind)
    if old is not None and old != scope:
        raise StrategyError(
            f"{type(module).__name__} is already in {scope.kind} scope '{old.label}', so it cannot join "
            f"'{scope.label}'; a module belongs to at most one replicate and one split scope "
            "(torchloom.strategy.annotations.clear_annotations(module) removes the old ones)."
        )


def _mark(module: nn.Module, scope: Scope) -> None:
    ann = dict(getattr(module, ATTR, None) or {})  # a new dict: modules never share one
    ann[scope.kind] = scope
    module.__dict__[ATTR] = ann  # a plain attribute: not a parameter, buffer or submodule


def _check_same_name_counts(model: nn.Module) -> None:
    """Scopes with one name are one scope, so they must agree on the device count."""
    seen: dict[tuple, Scope] = {}
    for m in model.modules():
        for scope in (getattr(m, ATTR, None) or {}).values():
            first = seen.setdefault(scope.key, scope)
            if first.device_count != scope.device_count:
                raise StrategyError(
                    f"two {scope.kind} scopes are named '{scope.label}' but have device_count {first.device_count} "
                    f"and {scope.device_count}; scopes with one name are one scope. Give them one device_count or "
                    "different names."
                )


def _check_count(kind: str, n: Any, minimum: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < minimum:
        extra = " (split(1) splits nothing: use replicate(1))" if kind == "split" and n == 1 else ""
        raise StrategyError(f"{kind}: device_count must be an int >= {minimum}, got {n!r}{extra}.")
    return n


# -- resolution --------------------------------------------------------------------------------------
def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _rep(ann: dict[str, Scope]) -> Scope | None:
    return ann.get("replicate")


def _distinct(scopes) -> list[Scope]:
    out: list[Scope] = []
    for s in scopes:
        if s is not None and s not in out:
            out.append(s)
    return out


def _effective(model: nn.Module) -> dict[str, dict[str, Scope]]:
    """Scopes of every module (FQN, in module order): its own, else those shared by all its children (a
    container built in a scope but attached to its parent outside it), merged over its parent's (inherited)."""
    mods = dict(model.named_modules())
    own: dict[str, dict[str, Scope]] = {}
    for fqn in reversed(list(mods)):  # children before parents
        ann = dict(getattr(mods[fqn], ATTR, None) or {})
        kids = [own[k] for k in (f"{fqn}.{n}" if fqn else n for n, _ in mods[fqn].named_children()) if k in own]
        if not ann and fqn and kids and kids[0] and all(k == kids[0] for k in kids):
            ann = dict(kids[0])
        own[fqn] = ann
    eff: dict[str, dict[str, Scope]] = {}
    for fqn in mods:
        eff[fqn] = {**(eff[_parent(fqn)] if fqn else {}), **own[fqn]}
    return eff


def _stages(model: nn.Module, eff: dict[str, dict[str, Scope]]) -> tuple[list[Scope], list[str]]:
    """Replicate scopes in the order their parameters appear, and the split points: for each stage after
    the first, its outermost module that comes first after the previous stage's last parameter.

    Raises:
        StrategyError: a stage's parameters interleave with another's (A, B, A).
    """
    order: list[Scope] = []
    points: list[str] = []
    first_root: dict[Scope, str] = {}
    for n, m in model.named_modules():
        s = _rep(eff[n])
        if s is None:
            continue
        if n and _rep(eff[_parent(n)]) != s:
            first_root.setdefault(s, n)
        if next(m.parameters(recurse=False), None) is None:
            continue
        if s in order and order[-1] != s:
            raise StrategyError(
                f"replicate scope '{s.label}' continues at '{n}' after scope '{order[-1].label}' began: a pipeline "
                "stage must be contiguous in module order (replicate scopes with the same name are one stage). "
                "Give each stage consecutive modules, or different names."
            )
        if s not in order:
            order.append(s)
            if len(order) > 1:
                points.append(first_root.get(s, n))
        first_root.clear()  # later stages begin after this parameter
    return order, points
