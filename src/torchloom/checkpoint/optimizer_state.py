"""Optimizer state in checkpoints: every parameter's state, keyed by parameter name, exactly as the
optimizer holds it.

``torch.distributed.checkpoint.state_dict`` (DSD) loses state in three ways this module avoids:

* on load it drops the saved state of parameters with ``requires_grad=False`` (a frozen layer's AdamW
  moments are gone when it is unfrozen);
* before loading into a fresh optimizer it creates state for *every* trainable parameter (a zero-lr step),
  so a parameter that never received a gradient (an unused branch, a layer frozen so far, a group with no
  state yet) makes a strict load fail (``Missing key in checkpoint state_dict``) and a non-strict one gets
  invented state (step 1, zero moments) that changes the next update;
* before saving it runs the same zero-lr step on an optimizer without state.

Layout (unchanged, so checkpoints written with DSD load here and vice versa): the entry ``optim`` of the
DCP state dict is ``{"state": {fqn: {name: value}}, "param_groups": [{hyperparameters..., "params":
[fqn, ...]}]}`` with the plain model's parameter names (first registered name of a tied parameter), or,
for pipelined models (each rank holds some parameters), DSD's flat form ``{"state.<fqn>.<name>": value,
"param_groups.<fqn>.<hyperparameter>": value}``. Parameter groups are matched by membership, not index.

Loading builds its target from the *checkpoint's* catalogue (which parameters have which state), creating
the optimizer's own state only for those parameters (a zero-lr step with zero gradients on exactly them,
frozen ones included), so the loaded optimizer holds exactly the saved state.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from torchloom.errors import CheckpointError

STATE, GROUPS, PARAMS = "state", "param_groups", "params"


def param_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` in the plain model's naming (wrappers stripped; the first registered name
    of a tied parameter), the names optimizer state is stored under."""
    from torchloom.checkpoint.state import canonical_key, wrapper_components

    comps = wrapper_components(model)
    out: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), canonical_key(name, comps))
    return out


def _name(names: dict[int, str], p: torch.Tensor) -> str:
    try:
        return names[id(p)]
    except KeyError:
        raise CheckpointError("the optimizer holds a parameter that is not in the model being checkpointed "
                              "(pass the model the optimizer was built on)") from None


# -------------------------------------------------------------------------------------------- encode
def encode(model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], *, flat: bool) -> dict[str, Any]:
    """The ``optim`` entry of a checkpoint from live optimizers (their ``state_dict()``, ids -> names).

    Every parameter with state keeps it (frozen ones too); parameters without state have none in the
    checkpoint; every group's hyperparameters are stored. No optimizer step runs. Tensors are the live
    ones (DTensors stay DTensors: DCP saves their shards).
    """
    names = param_names(model)
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for o in optimizers:
        sd = o.state_dict()
        params = [p for g in o.param_groups for p in g[PARAMS]]
        for idx, st in sd[STATE].items():
            if st:
                state[_name(names, params[idx])] = dict(st)
        for g, live in zip(sd[GROUPS], o.param_groups):
            g = {k: v for k, v in g.items() if k != PARAMS}
            g[PARAMS] = [_name(names, p) for p in live[PARAMS]]
            groups.append(g)
    if not flat:
        return {STATE: state, GROUPS: groups}
    out: dict[str, Any] = {}
    for fqn, st in state.items():
        _flatten_into(out, f"{STATE}.{fqn}", st)
    for g in groups:
        for fqn in g[PARAMS]:
            for k, v in g.items():
                if k != PARAMS:
                    out[f"{GROUPS}.{fqn}.{k}"] = v
    return out


def _flatten_into(out: dict, prefix: str, value: Any) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten_into(out, f"{prefix}.{k}", v)
    else:
        out[prefix] = value


# ------------------------------------------------------------------------------------ saved catalogue
def _split_flat(key: str, names: set[str]) -> tuple[str, tuple[str, ...]] | None:
    """``"model.layers.0.w.exp_avg"`` -> ``("model.layers.0.w", ("exp_avg",))`` for a known name."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:i])
        if head in names:
            return head, tuple(parts[i:])
    return None


def classify(path: tuple, names: set[str]) -> tuple[str, Any, tuple] | None:
    """What a checkpoint entry under ``optim`` is: ``("state", fqn, keys)``, ``("group", index, keys)``
    (per-index layout) or ``("flat_group", fqn, keys)`` (flat layout); ``None`` if it names no live
    parameter. ``path`` is the DCP path without the leading ``"optim"``."""
    if len(path) >= 3 and path[0] == STATE:
        return "state", str(path[1]), tuple(path[2:])
    if len(path) >= 3 and path[0] == GROUPS and isinstance(path[1], int):
        return "group", path[1], tuple(path[2:])
    if len(path) == 1 and isinstance(path[0], str):
        head, _, rest = path[0].partition(".")
        if head in (STATE, GROUPS):
            split = _split_flat(rest, names)
            if split is not None:
                return ("state" if head == STATE else "flat_group"), split[0], split[1]
    return None


# ---------------------------------------------------------------------------------------------- load
def prime(optimizers: tuple[torch.optim.Optimizer, ...], wanted: list[torch.Tensor]) -> None:
    """Make the optimizers create their state for exactly ``wanted`` parameters that have none: one step
    with learning rate 0 and zero gradients on them only (other parameters' gradients are set aside, so
    they are skipped). Frozen parameters are primed too. Gradients and learning rates are restored."""
    need = {id(p) for p in wanted}
    todo = [o for o in optimizers if any(id(p) in need and not o.state.get(p) for g in o.param_groups
                                         for p in g[PARAMS])]
    if not todo:
        return
    grads = {}
    lrs = []
    try:
        for o in todo:
            for g in o.param_groups:
                lrs.append((g, g.get("lr")))
                if "lr" in g:
                    g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
                for p in g[PARAMS]:
                    grads.setdefault(id(p), (p, p.grad))
                    p.grad = torch.zeros_like(p) if id(p) in need and not o.state.get(p) else None
        with torch.no_grad():
            for o in todo:
                o.step()
    finally:
        for g, lr in lrs:
            if lr is not None:
                g["lr"] = lr
        for p, grad in grads.values():
            p.grad = grad


def target(model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...],
           catalogue: dict[str, tuple[tuple, bool]], *, where: str) -> dict[str, Any]:
    """The flat load target for the optimizer entries of a checkpoint: ``{checkpoint key: live tensor or
    None}`` (``None``: a non-tensor value DCP/the snapshot fills in).

    ``catalogue``: ``{checkpoint key: (path below "optim", is_tensor)}`` of the saved optimizer entries.
    The live optimizers first get state for exactly the parameters that have saved state (:func:`prime`).
    Entries for parameters this rank's optimizers do not hold are left out (pipeline stages hold some).
    """
    names = param_names(model)
    by_name = {}
    for o in optimizers:
        for g in o.param_groups:
            for p in g[PARAMS]:
                by_name[_name(names, p)] = (o, p)
    known = set(by_name)
    kinds = {k: classify(path, known) for k, (path, _t) in catalogue.items()}
    with_state = sorted({c[1] for c in kinds.values() if c is not None and c[0] == "state" and c[1] in by_name})
    prime(optimizers, [by_name[n][1] for n in with_state])
    # the live values through state_dict(), so its post-hooks run (tensor parallel attaches the DCP layout
    # of multi-block shards, e.g. fused q/k/v, to the tensors there); the tensors are the live ones
    live_state: dict[int, dict] = {}
    for o in optimizers:
        params = [p for g in o.param_groups for p in g[PARAMS]]
        for idx, st in o.state_dict()[STATE].items():
            live_state[id(params[idx])] = st
    out: dict[str, Any] = {}
    for key, (path, is_tensor) in catalogue.items():
        c = kinds[key]
        if c is None:
            continue
        kind, ref, rest = c
        if kind == "group":
            out[key] = None
            continue
        if ref not in by_name:
            continue
        if kind == "flat_group":
            out[key] = None
            continue
        o, p = by_name[ref]
        value: Any = live_state.get(id(p), {})
        for k in rest:
            value = value.get(k) if isinstance(value, dict) else None
        if is_tensor:
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"{where}: the optimizer state {key!r} is a tensor in the checkpoint but "
                                      f"{type(value).__name__} in the live {type(o).__name__} (another optimizer?)")
            out[key] = value
        else:
            out[key] = None
    return out


def decode(model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], filled: dict[str, Any],
           catalogue: dict[str, tuple[tuple, bool]], *, strict: bool, where: str) -> None:
    """Load the filled :func:`target` into the live optimizers (``load_state_dict``): each parameter gets
    exactly its saved state (none if it had none), each group the hyperparameters of the saved group
    holding its parameters.

    Raises:
        CheckpointError: ``strict`` and a live parameter is in no saved group, or one live group's
            parameters were in different saved groups.
    """
    names = param_names(model)
    known = {_name(names, p) for o in optimizers for g in o.param_groups for p in g[PARAMS]}
    state: dict[str, dict] = {}
    groups: dict[int, dict] = {}
    flat_groups: dict[str, dict] = {}
    for key, value in filled.items():
        kind, ref, rest = classify(catalogue[key][0], known)
        if kind == "state":
            d = state.setdefault(ref, {})
            for k in rest[:-1]:
                d = d.setdefault(k, {})
            d[rest[-1]] = value
        elif kind == "group":
            groups.setdefault(ref, {})[rest[0]] = value
        else:
            flat_groups.setdefault(ref, {})[rest[0]] = value
    member_of = {fqn: i for i, g in groups.items() for fqn in (g.get(PARAMS) or [])}
    for o in optimizers:
        sd: dict[str, Any] = {STATE: {}, GROUPS: []}
        live_groups = o.state_dict()[GROUPS]
        idx = 0
        for g, live_g in zip(o.param_groups, live_groups):
            members = [_name(names, p) for p in g[PARAMS]]
            saved = _saved_group(members, groups, member_of, flat_groups, strict=strict, where=where)
            live = {k: v for k, v in live_g.items() if k != PARAMS}
            hp = {**live, **{k: v for k, v in (saved or {}).items() if k != PARAMS}}
            hp[PARAMS] = list(range(idx, idx + len(members)))
            sd[GROUPS].append(hp)
            for j, fqn in enumerate(members):
                if fqn in state:
                    sd[STATE][idx + j] = state[fqn]
            idx += len(members)
        o.load_state_dict(sd)


_HINT = (" (strict=True). A weight tied to another one in the saving model (e.g. an output head that pipeline "
         "stages untie from the embedding) has its state under that other name. Pass strict=False to keep "
         "these parameters' live settings without state, or optimizer=None to load the model only")


def _saved_group(members: list[str], groups: dict[int, dict], member_of: dict[str, int],
                 flat_groups: dict[str, dict], *, strict: bool, where: str) -> dict | None:
    if not members:
        return None
    if flat_groups or not groups:
        found = [flat_groups.get(m) for m in members]
        if any(f is None for f in found):
            if strict:
                missing = [m for m, f in zip(members, found) if f is None]
                raise CheckpointError(f"{where}: the checkpoint's optimizer has no parameter group for "
                                      f"{missing[:3]}{_HINT}")
            return next((f for f in found if f is not None), None)
        return found[0]
    ids = {member_of.get(m) for m in members}
    if None in ids:
        if strict:
            missing = [m for m in members if m not in member_of]
            raise CheckpointError(f"{where}: the checkpoint's optimizer has no parameter group for "
                                  f"{missing[:3]}{_HINT}")
        ids.discard(None)
    if len(ids) > 1 and strict:
        raise CheckpointError(f"{where}: the parameters of one live optimizer group ({members[:3]}...) were in "
                              f"{len(ids)} different groups when saved (strict=True)")
    return groups[min(ids)] if ids else None


__all__ = ["classify", "decode", "encode", "param_names", "prime", "target"]
