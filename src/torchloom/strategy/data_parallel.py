"""DDP's semantics under tensor parallelism: the one rule that ``auto_accelerate`` and ``loom train`` share.

``DistributedDataParallel`` cannot hold tensor-parallel DTensor parameters (it fails at wrap time). The
same semantics — every data-parallel rank keeps the whole (tensor-parallel-sharded) parameters and
gradients are averaged once per step — come from FSDP2 over a *replicate-only* data-parallel mesh
(``dp_shard = 1``) that does not reshard after forward: nothing is sharded, so gathering the parameters
again for backward would only copy them (and zero-bubble pipeline schedules, which compute weight
gradients after the input gradients, need them unsharded).

Who builds the replicate-only mesh: ``auto_accelerate`` puts the data-parallel degree on ``dp_replicate``
when no data-parallel method was given; ``loom train`` sets ``dp_shard: 1`` next to the swapped method.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

#: the method spec with DDP's semantics under tensor parallelism
REPLICATING_FSDP: tuple[str, dict[str, Any]] = ("fsdp", {"reshard_after_forward": False})


def replicating_data_parallel(tensor_parallel: bool) -> tuple[str, Any]:
    """``(method name, strategy item)`` of the data-parallel method with DDP's semantics: ``("ddp", "ddp")``,
    or with tensor parallelism ``("fsdp", ("fsdp", {"reshard_after_forward": False}))`` (to be run over a
    replicate-only mesh, see the module docstring)."""
    if tensor_parallel:
        name, config = REPLICATING_FSDP
        return name, (name, dict(config))
    return "ddp", "ddp"


def is_plain_ddp(item: Any) -> bool:
    """True for a ``ddp`` strategy item without options: ``"ddp"`` (or an alias of it), ``("ddp",)``,
    ``("ddp", {})``, ``{"ddp": None}``, ``{"name": "ddp"}``. A ``ddp`` with options is the user's explicit
    choice and is never swapped (the strategy check then explains the conflict with tensor parallelism)."""
    from .registry import resolve_name

    if isinstance(item, str):
        name, config = item, None
    elif isinstance(item, (tuple, list)) and len(item) in (1, 2) and isinstance(item[0], str):
        name, config = item[0], (item[1] if len(item) == 2 else None)
    elif isinstance(item, Mapping) and "name" in item and set(item) <= {"name", "config"}:
        name, config = item["name"], item.get("config")
    elif isinstance(item, Mapping) and len(item) == 1:
        (name, config), = item.items()
    else:
        return False
    if not isinstance(name, str) or config not in (None, {}):
        return False
    try:
        cls, overrides = resolve_name(name)
    except Exception:  # noqa: BLE001 - an unknown name is the strategy check's to report
        return False
    return cls.name == "ddp" and not overrides


def swap_ddp_for_fsdp(methods: Sequence[Any], tensor_parallel: bool) -> tuple[list[Any], bool]:
    """``(methods with a plain ddp replaced, whether one was)``. Only with ``tensor_parallel``; the
    replacement is :data:`REPLICATING_FSDP` as a one-key dict (``{"fsdp": {"reshard_after_forward": False}}``),
    the form strategy files use."""
    out = list(methods)
    if not tensor_parallel:
        return out, False
    for i, item in enumerate(out):
        if is_plain_ddp(item):
            name, config = REPLICATING_FSDP
            out[i] = {name: dict(config)}
            return out, True
    return out, False
