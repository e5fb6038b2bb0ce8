"""Precision rules shared by ``half``, ``amp`` and ``fsdp``'s mixed precision.

* **Buffers keep their dtype.** Casting a model for compute changes its parameters only: fp32 state such as
  rotary ``inv_freq`` or BatchNorm running statistics would lose precision for good in bf16/fp16 (HF
  rotary positions drift; running variances round to 8 bits).
* **Normalisation layers with running statistics stay fp32 as a whole** (apex's ``keep_batchnorm_fp32``;
  FSDP1's ``MixedPrecision._module_classes_to_ignore``). PyTorch's batch-norm kernels take a low-precision
  input with fp32 weight and statistics, but not bf16/fp16 weights with fp32 statistics ("expected scalar
  type BFloat16 but found Float").
* **Master weights are fp32 under amp.** A model handed in already in bf16/fp16 is upcast (lossless), with
  a warning.
"""
from __future__ import annotations

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


def cast_for_half(model: nn.Module, dtype: torch.dtype, cast_buffers: bool = False) -> tuple[int, int]:
    """Cast floating-point parameters to ``dtype`` in place (``half``'s rule).

    Parameters of :func:`keeps_fp32` modules are left alone, as are all buffers, unless ``cast_buffers``: then
    this is ``model.to(dtype)`` (every floating parameter and buffer, normalisation layers included).
    Integer and bool tensors are never cast.

    Returns:
        (number of parameters cast, number of parameters kept in their dtype as part of a norm layer).
    """
    if cast_buffers:
        n = sum(1 for p in model.parameters() if p.is_floating_point() and p.dtype != dtype)
        model.to(dtype)
        return n, 0
    kept = {id(p) for _, m in fp32_norm_modules(model) for p in m.parameters()}
    params = [p for p in model.parameters() if p.is_floating_point() and id(p) not in kept and p.dtype != dtype]
    # _apply visits grads and buffers too; only the chosen parameters (and their gradients) are converted
    targets = {id(t) for p in params for t in (p, p.grad) if t is not None}
    _convert(model, lambda t: t.to(dtype) if id(t) in targets else t)
    return len(params), len(kept)


def upcast_low_precision(model: nn.Module) -> list[str]:
    """Bring every bf16/fp16 parameter and floating buffer of ``model`` to fp32 in place (undoes a user's
    ``model.to(torch.bfloat16)``: lossless, but precision lost by that earlier cast is not recovered).
    Returns the names converted (parameters first)."""
    names = [n for n, p in model.named_parameters() if p.dtype in LOW_PRECISION]
    names += [n for n, b in model.named_buffers() if b.dtype in LOW_PRECISION]
    if names:
        _convert(model, lambda t: t.float() if t.dtype in LOW_PRECISION else t)
    return names
