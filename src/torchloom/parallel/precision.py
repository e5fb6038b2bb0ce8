"""Precision rules shared by ``half``, ``amp`` and ``fsdp``'s mixed precision.

* **Buffers keep their dtype.** Casting a model for compute changes its parameters only: fp32 state such as
  rotary ``inv_freq`` or BatchNorm running statistics would lose precision for good in bf16/fp16 (HF
  rotary positions drift; running variances round to 8 bits).
* **Normalisation layers with running statistics stay fp32 as a whole** (apex's ``keep_batchnorm_fp32``;
  FSDP1's ``MixedPrecision._module_classes_to_ignore``). PyTorch's batch-norm kernels take a low-precision
  input with fp32 weight and statistics, but not bf16/fp16 weights with fp32 statistics ("expected scalar
  type BFloat16 but found Float").
* **Master weights are fp32 under amp.** bf16/fp16 parameters are upcast (lossless), with a warning; so are
  bf16/fp16 buffers of BatchNorm-like layers, and every bf16/fp16 buffer when the whole model was handed
  in low precision. A low-precision buffer next to fp32 parameters was chosen so and keeps its dtype.
* **half sets, whatever the input dtype:** parameters -> the half dtype, BatchNorm-like layers
  (parameters and running statistics) -> fp32, other buffers untouched.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

LOW_PRECISION = (torch.bfloat16, torch.float16)


def keeps_fp32(module: nn.Module) -> bool:
    """True for a normalisation layer that tracks running statistics (BatchNorm*, SyncBatchNorm, tracked
    InstanceNorm*): its parameters and statistics stay in their own (fp32) dtype under ``half`` and FSDP
    mixed precision."""
    return isinstance(module, nn.modules.batchnorm._NormBase) and bool(module.track_running_stats)


def fp32_norm_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every :func:`keeps_fp32` module that has parameters."""
    return [(n, m) for n, m in model.named_modules() if keeps_fp32(m) and any(True for _ in m.parameters(False))]


def _convert(model: nn.Module, fn) -> None:
    """``Module._apply(fn)``: keeps ``Parameter`` objects (ties survive, DTensors are swapped in place)."""
    model._apply(fn)


class HalfCast(NamedTuple):
    """What :func:`cast_for_half` did. ``came_low``: names of the parameters that were already bf16/fp16
    before the cast (a model the user cast or loaded in low precision; a low-precision buffer alone is a
    deliberate choice and is not listed)."""

    cast: int
    kept: int
    came_low: list[str]
    norm_upcast: list[str]


def cast_for_half(model: nn.Module, dtype: torch.dtype, cast_buffers: bool = False) -> HalfCast:
    """Apply ``half``'s rule in place, whatever dtype the model comes in (fp32, bf16, fp16, fp64):

    * floating-point parameters -> ``dtype``;
    * :func:`keeps_fp32` modules (BatchNorm-like layers): parameters and floating buffers (running
      statistics) -> fp32, so a model the user already cast with ``model.to(torch.bfloat16)`` gets its
      normalisation layers back in fp32 (their kernels need weight and statistics in one dtype, and an
      8-bit running variance is useless);
    * every other buffer keeps its dtype; integer and bool tensors are never cast.

    With ``cast_buffers`` this is ``model.to(dtype)`` instead (every floating parameter and buffer,
    normalisation layers included). Ties survive (``Module._apply`` keeps the ``Parameter`` objects).

    Returns:
        :class:`HalfCast`: parameters cast to ``dtype``; parameters of norm layers set/kept fp32; the names
        of the parameters that came in bf16/fp16; the norm-layer tensors upcast from bf16/fp16 to fp32.
    """
    came_low = [n for n, p in model.named_parameters() if p.dtype in LOW_PRECISION]
    if cast_buffers:
        n = sum(1 for p in model.parameters() if p.is_floating_point() and p.dtype != dtype)
        model.to(dtype)
        return HalfCast(n, 0, came_low, [])
    norm: dict[int, tuple[str, torch.Tensor]] = {}  # id -> (name, tensor): norm-layer floating tensors
    for mod_name, mod in model.named_modules():
        if keeps_fp32(mod):
            for n, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
                if t is not None and t.is_floating_point():
                    norm.setdefault(id(t), (f"{mod_name}.{n}" if mod_name else n, t))
    kept = sum(1 for _, m in fp32_norm_modules(model) for _ in m.parameters())
    to_fp32 = [t for _, t in norm.values() if t.dtype != torch.float32]
    norm_upcast = [n for n, t in norm.values() if t.dtype in LOW_PRECISION]
    params = [p for p in model.parameters() if p.is_floating_point() and id(p) not in norm
              and p.dtype != dtype]
    # _apply visits grads and buffers too; only the chosen tensors (and their gradients) are converted
    low = {id(t) for p in params for t in (p, p.grad) if t is not None}
    high = {id(x) for t in to_fp32 for x in (t, t.grad) if x is not None}
    _convert(model, lambda t: t.to(dtype) if id(t) in low else t.float() if id(t) in high else t)
    return HalfCast(len(params), kept, came_low, norm_upcast)


def upcast_low_precision(model: nn.Module) -> tuple[list[str], list[str]]:
    """``amp``'s rule for a model that holds bf16/fp16 tensors, in place (lossless; precision lost by an
    earlier cast is not recovered; ties survive):

    * every bf16/fp16 **parameter** -> fp32 (master weights, gradients and optimizer state are fp32);
    * bf16/fp16 **buffers of BatchNorm-like layers** (:func:`keeps_fp32`) -> fp32: their kernels need the
      statistics in the weights' dtype;
    * every other bf16/fp16 **buffer** -> fp32 only when the whole model was handed in low precision (all its
      floating parameters bf16/fp16: a ``model.to(torch.bfloat16)`` that cast the buffers along); in a model
      with fp32 parameters such a buffer was made low precision on purpose and keeps its dtype.

    Returns:
        (names converted, parameters first; names of bf16/fp16 buffers left as they are).
    """
    floating = [p for p in model.parameters() if p.is_floating_point()]
    whole_low = bool(floating) and all(p.dtype in LOW_PRECISION for p in floating)
    names = [n for n, p in model.named_parameters() if p.dtype in LOW_PRECISION]
    targets = {id(p) for p in model.parameters() if p.dtype in LOW_PRECISION}
    left = []
    for mod_name, mod in model.named_modules():
        for n, b in mod.named_buffers(recurse=False):
            if b is None or b.dtype not in LOW_PRECISION or id(b) in targets:
                continue
            name = f"{mod_name}.{n}" if mod_name else n
            if whole_low or keeps_fp32(mod):
                targets.add(id(b))
                names.append(name)
            else:
                left.append(name)
    if targets:
        targets |= {id(p.grad) for p in model.parameters() if id(p) in targets and p.grad is not None}
        _convert(model, lambda t: t.float() if id(t) in targets else t)
    return names, left
