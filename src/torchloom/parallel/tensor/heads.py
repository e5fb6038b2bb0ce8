"""Head-count attributes of custom attention modules under a user plan.

A custom attention very often reshapes with a head count it keeps itself: ``q.reshape(B, T, self.n_heads,
-1)``. Once its q/k/v projections are column-wise sharded, each rank holds ``out_features / tp`` features,
and the unchanged count splits them into ``n_heads`` heads of ``1/tp`` of their width: no error, a different
model. The built-in plans know their families' attributes (GPT-2's ``split_size``/``num_heads``, BERT's
``num_attention_heads``); for a user plan torchloom divides the head-count attributes it recognises by tp:

* the names in :data:`HEAD_COUNT_ATTRS`,
* held as a plain ``int`` (not ``bool``) in the instance ``__dict__`` of a module that is the *direct parent*
  of a column-wise sharded projection (``colwise`` or ``fused_qkv``),
* unless the model's known family already lists the attribute (``TPPlan.local_attrs``).

Counts held elsewhere (a closure, a tuple, a shared config object, derived from the input width) are not
touched; the probe (:mod:`.probe`) catches the modules that still compute something else. Width attributes
(``head_dim``, ``hidden_size``) are per-head or full sizes and are never divided.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

#: instance attributes read as head counts (query and key/value) of an attention module
HEAD_COUNT_ATTRS = ("n_heads", "n_head", "num_heads", "num_head", "nheads", "num_attention_heads", "head_count",
                    "n_local_heads", "num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "kv_heads",
                    "n_local_kv_heads")
#: styles whose output stays sharded over the features and is consumed by the module's own code
COLUMN_STYLES = frozenset({"colwise", "fused_qkv"})


@dataclass(frozen=True)
class HeadAttr:
    """One head-count attribute to divide: ``module``'s ``attr`` (an int ``value``), read by the code that
    consumes the sharded outputs of ``children`` (the module's column-wise sharded projections)."""

    module: str
    attr: str
    value: int
    children: tuple[str, ...]

    @property
    def pattern(self) -> str:
        """``module.attr`` with numeric components as ``*`` (``blocks.*.attn.n_heads``), to group messages."""
        return ".".join("*" if a.isdigit() else a for a in f"{self.module}.{self.attr}".split("."))


def find_head_attrs(part: nn.Module, targets: dict[str, str],
                    known: dict[str, tuple[str, ...]] | None = None) -> list[HeadAttr]:
    """The head-count attributes a user plan must divide (see the module docstring for the rule).

    Args:
        part: the unsharded model or pipeline stage.
        targets: module name -> style (``ResolvedPlan.targets``).
        known: module name -> attributes the family plan already divides (skipped here).
    """
    modules = dict(part.named_modules())
    children: dict[str, list[str]] = {}
    for name, style in targets.items():
        if style in COLUMN_STYLES and "." in name:
            children.setdefault(name.rsplit(".", 1)[0], []).append(name)
    found = []
    for parent, kids in children.items():
        state = vars(modules[parent])
        for attr in HEAD_COUNT_ATTRS:
            value = state.get(attr)
            if isinstance(value, int) and not isinstance(value, bool) and attr not in (known or {}).get(parent, ()):
                found.append(HeadAttr(parent, attr, value, tuple(kids)))
    return found


def divide_head_attrs(part: nn.Module, attrs: list[HeadAttr], tp: int) -> None:
    """Set every attribute to ``value // tp`` (divisibility was checked before sharding)."""
    modules = dict(part.named_modules())
    for a in attrs:
        setattr(modules[a.module], a.attr, a.value // tp)


def describe(attrs: list[HeadAttr], tp: int) -> str:
    """``blocks.*.attn.n_heads 4 -> 2 (2 modules)``, one entry per pattern and value."""
    groups: dict[tuple[str, int], int] = {}
    for a in attrs:
        groups[(a.pattern, a.value)] = groups.get((a.pattern, a.value), 0) + 1
    return ", ".join(f"{p} {v} -> {v // tp}" + (f" ({n} modules)" if n > 1 else "") for (p, v), n in groups.items())
