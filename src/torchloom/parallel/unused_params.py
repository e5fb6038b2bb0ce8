"""Parameters that get no gradient in a step: stop DDP before it steps on unreduced gradients, and keep
FSDP2's reduce-scatter the same on every rank.

Why. DDP (``find_unused_parameters=False``) launches a gradient bucket only when every parameter in it got
its gradient; a parameter the loss does not depend on keeps its bucket (and every later one) from being
all-reduced. ``backward()`` still returns, so the optimizer steps on the local, unreduced gradients and
the replicas differ; PyTorch reports it only at the next forward ("Expected to have finished reduction in
the prior iteration"). :func:`check_ddp_reduced` asks the reducer right after backward, before anything
steps, and names the parameters. DDP also fixes its parameter list at construction;
:func:`record_ddp_params` keeps a copy, so a ``requires_grad`` changed later is named as the cause (and the
reducer's indices map to the right names), and a DDP forward pre-hook (``methods.ddp.ReductionGuard``)
catches unreduced buckets left by a loop that runs backward again before stepping.

FSDP2 reduce-scatters, per unit, only the parameters that have a gradient on this rank. When a branch is
taken on some ranks and not on others, the ranks reduce different tensors: gloo aborts ("Received data
size doesn't match expected size"), NCCL may hang or mix gradients (pytorch/pytorch issue 158719).
:func:`install_fsdp_zero_fill` gives every trainable parameter of a unit that runs its post-backward a
zero gradient when it has none, so all ranks reduce the same tensors and a missing gradient counts as 0 in
the average (what DDP's ``find_unused_parameters`` and FSDP1's flat parameters do).
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import GradientSyncError

#: path components that wrapper modules insert anywhere (torch.compile, activation checkpointing, FSDP1);
#: DDP's ``module`` is dropped only before the first other component (a user's submodule may be called so)
_WRAPPER_PARTS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
_SHOW = 8  # parameter names listed in an error (then "... and N more")


def clean_name(name: str) -> str:
    """``name`` without the components wrapper modules insert (``module.``, ``_orig_mod.``, ...), i.e. the
    plain model's FQN."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    while len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def list_names(names: list[str], show: int = _SHOW) -> str:
    """``a, b, c ... and N more`` for an error message."""
    head = ", ".join(names[:show])
    return head + (f" ... and {len(names) - show} more" if len(names) > show else "")


def _current_reducer_params(ddp: DistributedDataParallel) -> list[tuple[str, nn.Parameter]]:
    """``(FQN, parameter)`` DDP's reducer would track if built now, in its index order (as
    ``DistributedDataParallel._build_params_for_reducer`` lists them: trainable, not ignored, deduplicated)."""
    ignored = getattr(ddp, "parameters_to_ignore", set()) or set()
    seen, out = set(), []
    for mod_name, mod in ddp.module.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            fqn = f"{mod_name}.{p_name}" if mod_name else p_name
            if not p.requires_grad or fqn in ignored or id(p) in seen:
                continue
            seen.add(id(p))
            out.append((clean_name(fqn), p))
    return out


def record_ddp_params(ddp: DistributedDataParallel) -> None:
    """Remember the parameters DDP's reducer was built with (right after ``DistributedDataParallel(...)``).

    DDP fixes that list at construction (torch keeps it only inside the C++ reducer): a parameter frozen
    later is still waited for, one unfrozen later is never all-reduced. :func:`check_ddp_reduced` compares
    the record with the parameters' ``requires_grad`` now, and maps the reducer's indices to names with it.
    """
    ddp._torchloom_reducer_params = _current_reducer_params(ddp)
    ignored = getattr(ddp, "parameters_to_ignore", set()) or set()
    # frozen at wrap time (parameters DDP was told to ignore are not DDP's to reduce)
    ddp._torchloom_not_reduced = [(clean_name(n), p) for n, p in ddp.module.named_parameters()
                                  if not p.requires_grad and n not in ignored]


def _reducer_params(ddp: DistributedDataParallel) -> list[tuple[str, nn.Parameter]]:
    recorded = getattr(ddp, "_torchloom_reducer_params", None)
    return recorded if recorded is not None else _current_reducer_params(ddp)


def ddp_reducer_names(ddp: DistributedDataParallel) -> list[str]:
    """FQNs of the parameters DDP's reducer tracks, in its index order: as recorded at wrap time
    (:func:`record_ddp_params`), else as ``_build_params_for_reducer`` would list them now."""
    return [n for n, _ in _reducer_params(ddp)]


def requires_grad_changed(ddp: DistributedDataParallel) -> tuple[list[str], list[str]]:
    """``(frozen, unfrozen)``: names of parameters whose ``requires_grad`` changed since DDP was built
    (needs :func:`record_ddp_params`; both empty otherwise). ``unfrozen`` lists only those that have a
    gradient (so DDP's missing all-reduce matters)."""
    if getattr(ddp, "_torchloom_reducer_params", None) is None:
        return [], []
    frozen = [n for n, p in ddp._torchloom_reducer_params if not p.requires_grad]
    unfrozen = [n for n, p in ddp._torchloom_not_reduced if p.requires_grad and p.grad is not None]
    return frozen, unfrozen


def _unreduced_names(ddp: DistributedDataParallel, message: str) -> list[str]:
    """Names of the parameters the reducer is still waiting for: its error lists their indices."""
    names = ddp_reducer_names(ddp)
    idx = reducer_indices(message)
    if idx and all(i < len(names) for i in idx):
        return [names[i] for i in idx]
    # another message layout: the trainable parameters without a gradient (zero_grad(set_to_none=True));
    # parameters DDP ignores (expert parameters, reduced by torchloom.parallel.expert.reduce) are not DDP's
    ignored = getattr(ddp, "parameters_to_ignore", set()) or set()
    return [clean_name(n) for n, p in ddp.module.named_parameters()
            if p.requires_grad and p.grad is None and n not in ignored]


def reducer_indices(message: str) -> list[int]:
    """The parameter indices in DDP's "did not receive grad for rank N: i j ..." message ([] if absent)."""
    m = re.search(r"did not receive grad for rank \d+:\s*([\d ]+)", message)
    return [int(i) for i in m.group(1).split()] if m else []


def check_ddp_reduced(models: Iterable[nn.Module], optimizer_step: int, rank: int) -> None:
    """Raise :class:`GradientSyncError` if a DDP model's last backward did not all-reduce every bucket, or
    a parameter unfrozen after DDP was built got a gradient DDP never all-reduces.

    Call after the (last) backward of an optimizer step and before anything uses the gradients. Costs a flag
    read (``Reducer._check_reducer_finalized``) plus a ``requires_grad`` read per parameter that was frozen
    when DDP was built; models that are not DDP, and backward passes under ``no_sync()``, are skipped.

    Args:
        models: the modules to check (DDP ones are checked).
        optimizer_step: the number of optimizer steps already taken (0 = the first); shapes the advice.
        rank: this process's global rank, for the message.

    Raises:
        GradientSyncError: names the parameters that got no gradient on this rank (or whose
            ``requires_grad`` changed after DDP was built) and the fix. Raised before the optimizer step, so
            the parameters are still the same on every rank.
    """
    for m in models:
        if not isinstance(m, DistributedDataParallel):
            continue
        try:
            m._check_reducer_finalized()
        except RuntimeError as e:
            raise GradientSyncError(_ddp_message(m, str(e), optimizer_step, rank)) from None
        _, unfrozen = requires_grad_changed(m)
        if unfrozen:
            raise GradientSyncError(_changed_message(unfrozen, "False", "True", rank))


def _changed_message(names: list[str], was: str, now: str, rank: int) -> str:
    what = ("DDP waits for their gradients, which never come, so it did not all-reduce the gradient buckets "
            "that hold them" if was == "True" else "DDP never all-reduces their gradients, so each rank would "
            "step them on its own gradient and the replicas would differ")
    return (f"ddp: {len(names)} parameters had requires_grad={was} when DDP was built (auto_accelerate) and have "
            f"requires_grad={now} now on rank {rank} ({list_names(names)}). DDP fixes its parameter list at "
            f"construction: {what}. torchloom stopped before the optimizer step (the parameters are still "
            "the same on every rank). Fix one of: (1) set requires_grad before auto_accelerate (build a new "
            "result to change it later); (2) use 'fsdp', which reads requires_grad at every step; (3) for "
            "freezing only, ('ddp', {'find_unused_parameters': True}) lets DDP skip parameters without a gradient.")


def _ddp_message(ddp: DistributedDataParallel, raw: str, step: int, rank: int) -> str:
    frozen, _ = requires_grad_changed(ddp)
    if frozen:
        return _changed_message(frozen, "True", "False", rank)
    names = _unreduced_names(ddp, raw)
    total = len(ddp_reducer_names(ddp))
    by_name = dict(_reducer_params(ddp))
    # a (nonzero) gradient from an earlier micro-batch of this optimizer step but none from the last backward:
    # the parameter trains, so "got no gradient" / "freeze it" would be wrong
    earlier = [n for n in names if n in by_name and by_name[n].grad is not None
               and bool(by_name[n].grad.detach().abs().sum() > 0)]
    if earlier:
        return (f"ddp: at optimizer step {step}, {len(earlier)} of {total} trainable parameters got a gradient from "
                f"an earlier micro-batch of this optimizer step but none from the last backward, on rank {rank} "
                f"({list_names(earlier)}). Every backward outside no_sync all-reduces and waits for every trainable "
                "parameter (with gradient accumulation in train_step only the last micro-batch's backward runs "
                "outside no_sync), so a parameter unused in that backward leaves its bucket unreduced although it "
                "trains on other micro-batches; stepping would make the replicas differ. torchloom stopped before "
                "the optimizer step (the parameters are still the same on every rank). Use ('ddp', "
                "{'find_unused_parameters': True}); do not freeze these parameters, they train.")
    head = (f"ddp: at optimizer step {step}, {len(names)} of {total} trainable parameters got no gradient on rank "
            f"{rank} ({list_names(names) or 'unknown'}), so DDP did not all-reduce the gradient buckets that hold "
            "them; stepping would make the replicas differ. torchloom stopped before the optimizer step (the "
            "parameters are still the same on every rank).")
    if getattr(ddp, "static_graph", False):
        fix = ("static_graph: true needs the same parameters used at every step, and on this torch it also fails "
               "for forward outputs the loss ignores (pytorch/pytorch issues 97030, 79171; it is only sound for "
               "modules skipped in forward at every step). Use ('ddp', {'find_unused_parameters': True}), or "
               "p.requires_grad_(False) for parameters that should not train.")
    elif step > 0:
        fix = ("They got gradients at earlier steps, so the set of used parameters changes from step to step: "
               "use ('ddp', {'find_unused_parameters': True}) (static_graph is not valid for such a model).")
    else:
        fix = ("Fix one of: (1) parameters that should not train: p.requires_grad_(False) before auto_accelerate, "
               "or make the loss use the output they produce; (2) ('ddp', {'find_unused_parameters': True}) (a "
               "graph search per step; also right when the set changes between steps or ranks). "
               "('ddp', {'static_graph': True}) costs nothing per step but is only sound for modules skipped in "
               "forward at every step, not for outputs the loss ignores (pytorch/pytorch issue 97030).")
    return f"{head} {fix}"


def explain_ddp_backward_error(err: RuntimeError) -> str | None:
    """A torchloom explanation for DDP errors raised inside ``backward()`` (static graph changed), or None."""
    msg = str(err)
    if "static_graph" in msg and "graph has changed" in msg:
        return ("[torchloom] static_graph: true needs the same parameters used at every step, but a parameter "
                "that got no gradient at the first step got one now. Use ('ddp', {'find_unused_parameters': "
                "True}). Nothing was stepped on unreduced gradients.")
    if "find_unused_parameters" in msg:
        return ("[torchloom] some parameters received no gradient; with torchloom enable it in the strategy: "
                "('ddp', {'find_unused_parameters': True}).")
    return None


# ------------------------------------------------------------------------------------------------ FSDP2
def install_fsdp_zero_fill(modules: Iterable[nn.Module]) -> int:
    """Make every FSDP2 unit in ``modules`` reduce the same parameters on every rank.

    A trainable parameter without a gradient on this rank (its loss did not use it) joins the
    reduce-scatter with a zero gradient, so the collective has the same shapes everywhere and the result is
    the correct average (this rank contributes 0), as DDP's ``find_unused_parameters`` gives. A parameter
    that no rank used gets a zero gradient instead of None, so weight decay and momentum still move it
    (FSDP1's behaviour); freeze it (``requires_grad_(False)``) to leave it alone. Frozen parameters are
    never reduced. Uses ``FSDPModule.set_reduce_scatter_unused_params`` (torch >= 2.10); on older torch
    each unit's ``post_backward`` fills the missing gradients first.

    Returns:
        The number of FSDP modules set (0 without FSDP2).
    """
    from torch.distributed.fsdp import FSDPModule

    count = 0
    for root in modules:
        for mod in root.modules():
            if not isinstance(mod, FSDPModule):
                continue
            count += 1
            if hasattr(mod, "set_reduce_scatter_unused_params"):
                mod.set_reduce_scatter_unused_params(True, recurse=False)
                continue
            state = mod._get_fsdp_state()
            for group in getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]:
                if group is not None and not getattr(group, "_torchloom_zero_fill", False):
                    group.post_backward = _zero_fill_first(group, group.post_backward)
                    group._torchloom_zero_fill = True
    return count


def _zero_fill_first(group, post_backward):
    """Older torch: give trainable parameters without a gradient a zero one before FSDP reduces."""
    def wrapped(*args, **kwargs):
        for fp in group.fsdp_params:
            if not hasattr(fp, "_unsharded_param") or not fp.sharded_param.requires_grad:
                continue
            if fp.unsharded_accumulated_grad is None and fp.unsharded_param.grad is None:
                fp.unsharded_param.grad = torch.zeros_like(fp.unsharded_param)
        return post_backward(*args, **kwargs)

    return wrapped
