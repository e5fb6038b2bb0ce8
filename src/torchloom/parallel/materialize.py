"""Materialise a model built on the meta device: allocate real storage, then initialise parameters
*and buffers* (non-persistent buffers such as rotary ``inv_freq`` are not in any state dict, so they
must be recomputed, not loaded; huggingface/transformers 34234) exactly as a plain build would, also when
the model is already sharded (FSDP2, tensor parallel, pipeline stages)."""
from __future__ import annotations

import torch
from torch import nn

from .full_init import fork_rng, run_call
from .init_plan import InitCall, plan_init_calls


def materialize_meta_model(model: nn.Module, device: torch.device) -> None:
    """``to_empty`` on ``device``, then initialise in place; the values equal the plain build's.

    Works on a sharded model (FSDP2 and/or tensor-parallel DTensors, a pipeline stage): each rank ends up
    holding its shard of the tensors that ``torch.manual_seed(s); Model(config)`` would give after the same
    ``torch.manual_seed(s)`` (``auto_accelerate`` seeds before applying methods), on any layout: bitwise on
    CPU (tested); on an accelerator the draws come from the shard device's generator, as in a plain build
    on that device. Every module initialiser runs on plain full-size tensors and each rank keeps its shard
    (:mod:`~torchloom.parallel.full_init`; peak extra memory: the full tensors of one module), because DTensor
    random ops are not sharding-aware on CPU (every shard came out the same) and do not reproduce a plain
    build anywhere.

    The calls, in the plain build's order (:mod:`~torchloom.parallel.init_plan`):

    * each module's construction-time init (``reset_parameters()``; GPT-2's ``Conv1D`` normal draw), children
      first, and for a Hugging Face ``PreTrainedModel`` its ``post_init`` ``_init_weights`` pass (transformers
      5.x order, nested models first); this also recomputes rotary buffers;
    * then a non-Hugging-Face model's own ``init_weights()``, if it has one (so the result equals
      ``Model(); model.init_weights()``). It runs once on the full tensors of everything it touches (peak
      extra memory: up to the whole model, unlike the per-module calls);
    * then ``_init_buffers()`` on every module that defines it.

    Tied weights stay tied; the first name owns the value (the plain build ties later names to it), the
    others' draws are made and dropped. A pipeline stage of a Hugging Face model replays the absent stages'
    draws on a meta rebuild of its config and leaves the RNG as it found it, so every stage (and every
    virtual stage) matches the single-process model; other pipelined models (``nn.Sequential``) replay only
    their own modules: reproducible, distinct shards, but not the single-process values.

    Every parameter and buffer (this rank's shard) is filled with a sentinel (NaN, or the dtype's minimum
    for integers) before initialisation; one still holding it afterwards was never set, which is an error
    rather than silent garbage that differs from rank to rank. Non-persistent buffers matter most: they are
    in no state dict, so loading a checkpoint cannot fix them.

    Raises:
        RuntimeError: a parameter or buffer is still on the meta device afterwards, or was not initialised
            (names listed, with the fix); an initialiser touched a sharded tensor its dry run did not predict,
            or a layout whose shard cannot be cut from the full tensor (both name the call).
    """
    ties = _tied_parameter_slots(model)
    model.to_empty(device=device)
    _retie(ties)
    with torch.no_grad():
        for _, t in _local_tensors(model):
            _fill_sentinel(t)
        _replay_plain_build(model, ties, device)
        for m in model.modules():
            if hasattr(m, "_init_buffers"):
                m._init_buffers()
    _check_initialised(model)


def _replay_plain_build(model: nn.Module, ties: list[list[tuple[nn.Module, str]]], device: torch.device) -> None:
    calls, whole_model = plan_init_calls(model)
    scratch = {(id(mod), name) for group in ties for mod, name in group[1:]}
    written: set[int] = set()
    # a pipeline stage replays the whole model's draws: each stage starts from the same state
    with fork_rng(device, enabled=whole_model):
        for call in calls:
            run_call(call, scratch, written, device, _fill_sentinel)
        if not _is_hf(model) and callable(getattr(model, "init_weights", None)):
            # the model's own init after construction; ties are kept during it (it may write either name)
            run_call(InitCall("", model, model.init_weights), set(), written, device, _fill_sentinel)


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "initialize_weights") and hasattr(model, "_init_weights")


def _check_initialised(model: nn.Module) -> None:
    still = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still:
        raise RuntimeError(f"tensors still on the meta device after materialisation: {still[:5]}")
    non_persistent = {n for n, _ in _non_persistent_buffers(model)}
    unset = [n for n, t in _local_tensors(model) if _is_sentinel(t)]
    if any(n in non_persistent for n in unset):
        bufs = [n for n in unset if n in non_persistent]
        raise RuntimeError(
            f"non-persistent buffer(s) {bufs[:5]} were not initialised after meta-device materialisation; they are "
            "in no state dict, so loading a checkpoint cannot fill them. Define `_init_buffers(self)` on the owning "
            "module (or an `init_weights()` on the model) that recomputes them, or build the model on CPU."
        )
    if unset:
        raise RuntimeError(
            f"parameter(s)/buffer(s) {unset[:5]} were not initialised after meta-device materialisation (their module "
            "has no reset_parameters() and the model no init_weights()). Give the module a reset_parameters() or the "
            "model an init_weights(), or build the model on CPU."
        )


def _tied_parameter_slots(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) slots that hold the same Parameter (tied embedding/head). ``to_empty`` gives
    each slot its own new tensor, which silently unties them."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((mod, name))
    return [v for v in slots.values() if len(v) > 1]


def _retie(ties: list[list[tuple[nn.Module, str]]]) -> None:
    for group in ties:
        first = getattr(group[0][0], group[0][1])
        for mod, name in group[1:]:
            if getattr(mod, name) is not first:
                setattr(mod, name, first)


def _local_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer as this rank's local tensor (the shard of a DTensor)."""
    out = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        t = t.data if isinstance(t, nn.Parameter) else t
        out.append((name, t.to_local() if hasattr(t, "to_local") else t))
    return out


def _non_persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for qual, mod in model.named_modules():
        for name in sorted(getattr(mod, "_non_persistent_buffers_set", ())):
            buf = mod._buffers.get(name)
            if buf is not None:
                buf = buf.to_local() if hasattr(buf, "to_local") else buf  # a DTensor buffer: this rank's part
                out.append((f"{qual}.{name}" if qual else name, buf))
    return out


def _sentinel(t: torch.Tensor):
    if t.is_floating_point() or t.is_complex():
        return float("nan")
    if t.dtype != torch.bool:
        return torch.iinfo(t.dtype).min
    return None  # a bool buffer has no value that could not be intended


def _fill_sentinel(t: torch.Tensor) -> None:
    value = _sentinel(t)
    if value is not None and t.numel():
        try:
            t.fill_(value)
        except RuntimeError:  # an expanded view whose elements share memory cannot be filled: leave it
            pass


def _is_sentinel(t: torch.Tensor) -> bool:
    value = _sentinel(t)
    if value is None or not t.numel() or t.is_meta:
        return False
    return bool(torch.isnan(t).all()) if isinstance(value, float) else bool((t == value).all())
