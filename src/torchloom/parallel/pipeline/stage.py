"""Stage modules that keep the model's own names.

A stage module is a *pruned shallow copy* of the root model: every container on the path to a kept module is
copied (same class, same attributes, its own child/parameter/hook dictionaries), kept modules are the original
objects, and every other module is left out: an entry of a ``ModuleList``/``ModuleDict``/``Sequential`` is
removed (the list becomes sparse: ``layers`` of the second stage holds keys ``"2"``, ``"3"``), any other child
becomes ``None``. Fully qualified names therefore stay those of the unmodified model, so state-dict keys (DCP
checkpoints, resharding to another pipeline size) and name-matched plans (tensor parallel, FSDP wrap classes)
work unchanged, and name-matching tools see no stand-in modules (torchtitan deletes the layers of other stages
from a ``ModuleDict`` for the same reason).
"""
from __future__ import annotations

import copy
from typing import Iterable

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object of the same class sharing attribute values, with its own child, parameter, buffer
    and hook dictionaries (so wrapping or hooking the copy does not touch the original or other copies)."""
    new = copy.copy(module)
    for k, v in list(new.__dict__.items()):
        if isinstance(v, (dict, set)):  # _modules, _parameters, _buffers, hook dicts, _non_persistent_buffers_set
            new.__dict__[k] = copy.copy(v)
    return new


def prune(root: nn.Module, keep: Iterable[str]) -> nn.Module:
    """Copy of ``root`` holding only the modules named in ``keep`` (and their descendants); see the module
    docstring. Containers on the path to a kept module keep their own direct parameters (callers check that
    none exist where that would duplicate them)."""
    keep = set(keep)
    if "" in keep:
        return root

    def visit(module: nn.Module, prefix: str) -> nn.Module:
        new = shallow_copy(module)
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if fqn in keep:
                continue  # the original module object
            if any(k.startswith(fqn + ".") for k in keep):
                new._modules[name] = visit(child, fqn + ".")
            elif isinstance(module, _CONTAINERS):
                del new._modules[name]
            else:
                new._modules[name] = None
        return new

    return visit(root, "")


def child(container: nn.Module, name: str) -> nn.Module:
    """``container``'s child ``name`` (works on the sparse lists of a stage module, where ``layers[3]`` would
    count positions)."""
    return container._modules[name]

def direct_parameter_owners(root: nn.Module, units_modules: Iterable[str]) -> list[str]:
    """Parameters and buffers that no unit owns: they would be missing from, or duplicated in, every stage."""
    owned = set(units_modules)
    out = []
    for name, _ in [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]:
        # owned when one of its module prefixes is a unit ("layers.3" owns "layers.3.mlp.w"): one set lookup
        # per level instead of one prefix test per unit (an 80-block model has ~700 tensors x 80 units)
        parts = name.split(".")
        if not any(".".join(parts[:i]) in owned for i in range(1, len(parts))):
            out.append(name)
    return out
