"""Materialise a model built on the meta device: allocate real storage, then initialise parameters
*and buffers* (non-persistent buffers such as rotary ``inv_freq`` are not in any state dict, so they
must be recomputed, not loaded; huggingface/transformers 34234)."""
from __future__ import annotations

import torch
from torch import nn


def materialize_meta_model(model: nn.Module, device: torch.device) -> None:
    """``to_empty`` then initialise in place. Works on FSDP-sharded models (each rank fills its shard).

    Initialisation order: Hugging Face ``PreTrainedModel.initialize_weights`` / ``init_weights`` (also
    recomputes rotary buffers), else the model's own ``init_weights()``, else ``reset_parameters()`` on
    every submodule that has it. Modules with non-persistent buffers may define ``_init_buffers()``.

    Every parameter and buffer (this rank's shard) is filled with a sentinel (NaN, or the dtype's minimum
    for integers) before initialisation; one still holding it afterwards was never set, which is an error
    rather than silent garbage that differs from rank to rank. Non-persistent buffers matter most: they are
    in no state dict, so loading a checkpoint cannot fix them.

    Raises:
        RuntimeError: a parameter or buffer is still on the meta device afterwards, or was not initialised
            (names listed, with the fix).
    """
    ties = _tied_parameter_slots(model)
    model.to_empty(device=device)
    _retie(ties)
    with torch.no_grad():
        for _, t in _local_tensors(model):
            _fill_sentinel(t)
        if hasattr(model, "initialize_weights") and hasattr(model, "_init_weights"):
            _hf_init(model)
        elif hasattr(model, "init_weights") and callable(model.init_weights):
            model.init_weights()
        else:
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        for m in model.modules():
            if hasattr(m, "_init_buffers"):
                m._init_buffers()
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


def _hf_init(model: nn.Module) -> None:
    # transformers skips modules flagged as initialised; after to_empty nothing is.
    for m in model.modules():
        if hasattr(m, "_is_hf_initialized"):
            m._is_hf_initialized = False
    model.initialize_weights()
