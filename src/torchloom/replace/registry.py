"""The registry of module replacements: (module type -> faster equivalent) pairs, and the function that
swaps matching submodules in place while keeping every Parameter object (weights, ties, meta tensors)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, Union

from torch import nn

from ..errors import StrategyError
from ..utils import did_you_mean

Source = Union[type, str]


@dataclass(frozen=True)
class Replacement:
    """One registered pair.

    Attributes:
        name: the pair's name in ``module_replace``'s ``pairs``/``exclude``.
        sources: module classes, or class names matched against every class in a module's MRO (so
            ``"PreTrainedModel"`` matches all Hugging Face models without importing transformers).
        factory: ``factory(module) -> module`` returning the replacement (or ``module`` itself, changed in
            place); it must reuse the module's Parameter objects under the same names.
        when: optional ``when(module) -> bool``; a matching module is replaced only when it returns True.
        builtin: True for the pairs torchloom ships.
    """

    name: str
    sources: tuple[Source, ...]
    factory: Callable[[nn.Module], nn.Module]
    when: Callable[[nn.Module], bool] | None = None
    builtin: bool = False

    def matches(self, module: nn.Module) -> bool:
        mro = type(module).__mro__
        hit = any(
            (isinstance(s, str) and any(c.__name__ == s or f"{c.__module__}.{c.__qualname__}" == s for c in mro))
            or (isinstance(s, type) and isinstance(module, s))
            for s in self.sources
        )
        return hit and (self.when is None or bool(self.when(module)))


_PAIRS: dict[str, Replacement] = {}


def register_module_replacement(
    source: Source | Sequence[Source],
    factory: Callable[[nn.Module], nn.Module],
    name: str | None = None,
    *,
    when: Callable[[nn.Module], bool] | None = None,
    override: bool = False,
) -> Replacement:
    """Register ``factory`` as the replacement of modules of type ``source`` for the ``module_replace`` method.

    Args:
        source: a module class (subclasses match too), a class name (``"LlamaRMSNorm"`` or the dotted
            ``"transformers.models.llama.modeling_llama.LlamaRMSNorm"``), or a list of them.
        factory: ``factory(module) -> new_module``. It must reuse the module's Parameter objects under the
            same attribute names (``new.weight = old.weight``), so weights, tied weights, the optimizer and
            checkpoint keys stay the same; this is checked at replacement. Build the new module on the old
            one's device (``old.weight.device``: meta models stay meta).
        name: the pair's name (default: the source's class name).
        when: optional filter ``when(module) -> bool``.
        override: replace a pair already registered under ``name``.

    Returns:
        the registered :class:`Replacement`.

    Raises:
        StrategyError: ``name`` is taken (pass ``override=True``), or ``source``/``factory`` are invalid.
    """
    _ensure_builtins()  # so a user pair cannot silently shadow a built-in name
    sources = tuple(source) if isinstance(source, (list, tuple)) else (source,)
    if not sources or not all(isinstance(s, (type, str)) and s for s in sources):
        raise StrategyError(
            f"register_module_replacement: source must be a module class or class name, got {source!r}.")
    if not callable(factory):
        raise StrategyError(
            f"register_module_replacement: factory must be callable(module) -> module, got {factory!r}.")
    name = name or (sources[0] if isinstance(sources[0], str) else sources[0].__name__).rpartition(".")[2]
    if name in _PAIRS and not override:
        raise StrategyError(
            f"a module replacement named '{name}' is already registered; pick another name or pass override=True."
        )
    pair = Replacement(name, sources, factory, when, builtin=False)
    _PAIRS[name] = pair
    return pair


def unregister_module_replacement(name: str) -> None:
    """Remove a registered pair (no error if absent)."""
    _PAIRS.pop(name, None)


def _register_builtin(pair: Replacement) -> None:
    _PAIRS.setdefault(pair.name, pair)


def replacement_names() -> list[str]:
    """Names of every registered pair, built-in ones first, each group in registration order."""
    _ensure_builtins()
    return [p.name for p in sorted(_PAIRS.values(), key=lambda p: not p.builtin)]


def select_pairs(pairs: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> list[Replacement]:
    """The pairs named in ``pairs`` (None: all registered) minus ``exclude``, in registry order.

    Raises:
        StrategyError: an unknown name (with the closest registered names).
    """
    known = replacement_names()
    for n in [*(pairs or []), *exclude]:
        if n not in _PAIRS:
            raise StrategyError(
                f"module_replace: unknown pair '{n}'.{did_you_mean(n, known)} Registered pairs: {', '.join(known)} "
                "(add your own with torchloom.register_module_replacement)."
            )
    chosen = known if pairs is None else [n for n in known if n in set(pairs)]
    return [_PAIRS[n] for n in chosen if n not in set(exclude)]


def replace_modules(model: nn.Module, pairs: Sequence[Replacement]) -> tuple[nn.Module, dict[str, list[str]]]:
    """Apply ``pairs`` in order to ``model`` and its submodules (in place; the root may be replaced too).

    Every occurrence of a shared submodule is replaced by the same new module. The replaced module's
    hooks are not carried over.

    Returns:
        ``(model, replaced)``: the (possibly new) root and, per pair name, the class names it replaced
        (one entry per module; pairs that matched nothing are absent).

    Raises:
        StrategyError: a factory returned something that is not an ``nn.Module``, or did not keep the
            module's Parameter objects under the same names.
    """
    replaced: dict[str, list[str]] = {}
    for pair in pairs:
        hits: list[str] = []
        for fqn, old in _outermost_matches(model, pair):
            new = pair.factory(old)
            _check_same_parameters(pair.name, fqn, old, new)
            if new is not old:
                if fqn == "":
                    model = new
                else:
                    _swap_everywhere(model, old, new)
            hits.append(type(old).__name__)
        if hits:
            replaced[pair.name] = hits
    return model, replaced


def _outermost_matches(model: nn.Module, pair: Replacement) -> list[tuple[str, nn.Module]]:
    """Matching modules, skipping those inside an earlier match (that one is replaced as a whole)."""
    out: list[tuple[str, nn.Module]] = []
    for fqn, m in model.named_modules():
        if any(fqn == p or fqn.startswith(p + ".") or p == "" for p, _ in out):
            continue
        if pair.matches(m):
            out.append((fqn, m))
    return out


def _swap_everywhere(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent in model.modules():
        for key, child in list(parent._modules.items()):
            if child is old:
                parent._modules[key] = new


def _check_same_parameters(pair: str, fqn: str, old: nn.Module, new: nn.Module) -> None:
    if not isinstance(new, nn.Module):
        raise StrategyError(
            f"module_replace: pair '{pair}' returned {type(new).__name__} for '{fqn}', not an nn.Module.")
    before = [(n, id(p)) for n, p in old.named_parameters(remove_duplicate=False)]
    after = [(n, id(p)) for n, p in new.named_parameters(remove_duplicate=False)]
    if sorted(before) != sorted(after):
        raise StrategyError(
            f"module_replace: pair '{pair}' replaced '{fqn}' ({type(old).__name__}) by {type(new).__name__} without "
            f"keeping its Parameter objects under the same names (before {[n for n, _ in before]}, after "
            f"{[n for n, _ in after]}); assign them in the factory (new.weight = old.weight) so weights, ties, "
            "the optimizer and checkpoint keys stay the same."
        )


def _ensure_builtins() -> None:
    from . import builtin  # noqa: F401  (registers the built-in pairs on first use)
