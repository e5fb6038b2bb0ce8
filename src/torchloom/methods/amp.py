"""`amp`: automatic mixed precision (bf16/fp16 autocast, dynamic loss scaling for fp16)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

from ..parallel.loss_scaler import DynamicLossScaler
from ..strategy.registry import Method, Stage, register_method

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16}


@dataclass
class AmpConfig:
    """Autocast dtype and the fp16 loss-scaler settings (scale in powers of two; a floor hit is an error)."""

    dtype: Literal["bfloat16", "bf16", "float16", "fp16", "half"] = "bfloat16"
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0 / 2**24


@register_method
class Amp(Method):
    """Mixed precision with fp32 master weights and optimizer state (Micikevicius et al., 2018).

    Unsharded models run their forward under ``torch.autocast``; with ``fsdp`` the FSDP2
    ``MixedPrecisionPolicy`` casts parameters to the low dtype for compute and reduces gradients in fp32.
    fp16 adds a dynamic loss scaler whose skip decision is all-reduced so every rank agrees.
    """

    name = "amp"
    aliases = {"amp_native": {}, "mixed_precision": {}}
    Config = AmpConfig
    stage = Stage.PRECISION
    conflicts = {"half": "half casts the parameters themselves to low precision, while amp keeps fp32 master "
                         "weights and autocasts the compute; choose one."}

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.config.dtype]

    def configure(self, ctx) -> None:
        ctx.autocast_dtype = self.dtype
        if self.dtype == torch.float16:
            c = self.config
            ctx.loss_scaler = DynamicLossScaler(
                init_scale=c.init_scale, growth_factor=c.growth_factor, backoff_factor=c.backoff_factor,
                growth_interval=c.growth_interval, min_scale=c.min_scale,
            )

    def apply(self, ctx) -> None:
        if "fsdp" in ctx.strategy:
            ctx.note(f"amp: FSDP MixedPrecisionPolicy computes in {self.dtype} (see fsdp's reduce_dtype)")
            return  # fsdp builds its MixedPrecisionPolicy from ctx.autocast_dtype
        for part in ctx.model_parts:
            enable_autocast(part, self.dtype, ctx.device.type)
        ctx.note(f"amp: forward runs under torch.autocast({ctx.device.type}, {self.dtype})")


def enable_autocast(model: torch.nn.Module, dtype: torch.dtype, device_type: str) -> None:
    """Run ``model.forward`` under autocast without changing the module tree or state-dict keys
    (an instance attribute shadows the class's forward; outputs are cast back to fp32)."""
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            out = inner(*args, **kwargs)
        return _to_float(out)

    model.forward = forward


def _to_float(out):
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() and out.dtype != torch.float32 else out
    if isinstance(out, dict):  # HF ModelOutput is an OrderedDict subclass: update in place keeps its type
        for k, v in list(out.items()):
            out[k] = _to_float(v)
        return out
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return tuple(_to_float(v) for v in out)
    if isinstance(out, list):
        return [_to_float(v) for v in out]
    return out
