"""`half`: the model's parameters in bf16 or fp16 (ATorch ``half``); buffers keep their dtype."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

from ..parallel.precision import cast_for_half
from ..strategy.registry import Method, Stage, register_method
from .amp import DTYPES


@dataclass
class HalfConfig:
    """dtype: the low dtype of the parameters (and so of gradients and optimizer state).

    cast_buffers: cast everything floating, buffers and BatchNorm-like layers included (``model.to(dtype)``,
        what ``half`` did before it kept buffers): rotary ``inv_freq``, running statistics and other fp32
        state then lose precision. Default False: buffers keep their dtype, and normalisation
        layers with running statistics are fp32 (parameters and statistics), also when the model came in
        bf16/fp16 (they are set back to fp32, with a warning).
    """

    dtype: Literal["bfloat16", "bf16", "float16", "fp16", "half"] = "bfloat16"
    cast_buffers: bool = False


@register_method
class Half(Method):
    """Parameters, gradients and optimizer state all in the low dtype: half the memory of fp32, no master
    weights (so small updates can be lost to rounding; prefer ``amp`` for training from scratch).

    Whatever dtype the model comes in: parameters end in the half dtype, BatchNorm-like layers (parameters and
    running statistics) in fp32, other buffers keep their dtype, unless ``cast_buffers``
    (``torchloom.parallel.precision.cast_for_half``). A model with bf16/fp16 parameters gets a ``UserWarning``. Inputs are not cast: floating-point tensors of the batch reach the
    model in the dtype ``prepare_input`` gives them.
    """

    name = "half"
    Config = HalfConfig
    stage = Stage.CAST

    def estimate(self, info, dims, hw, step):
        """Parameters, gradients, Adam state and compute in the low dtype: the cost model reads
        ``StepShape.param_dtype``/``compute_dtype`` for the baseline, so there is nothing to add."""
        return None

    def configure(self, ctx) -> None:
        ctx.param_dtype = DTYPES[self.config.dtype]

    def apply(self, ctx) -> None:
        dtype = ctx.param_dtype
        cast = kept = 0
        came_low, norm_upcast = [], []
        for part in ctx.model_parts:  # also fine on the meta device
            r = cast_for_half(part, dtype, cast_buffers=self.config.cast_buffers)
            cast, kept = cast + r.cast, kept + r.kept
            came_low, norm_upcast = came_low + r.came_low, norm_upcast + r.norm_upcast
        if self.config.cast_buffers:
            ctx.note(f"half: parameters and floating-point buffers cast to {dtype} (cast_buffers)")
        else:
            ctx.note(f"half: {cast} parameters cast to {dtype}; buffers keep their dtype"
                     + (f"; {kept} parameters of BatchNorm-like layers kept in fp32 with their running statistics"
                        if kept else ""))
        if came_low:
            msg = (f"half: the model came in already in low precision ({len(came_low)} bf16/fp16 parameters, "
                   f"e.g. {came_low[:3]}).")
            if norm_upcast:
                msg += (f" {len(norm_upcast)} tensors of BatchNorm-like layers (e.g. {norm_upcast[:3]}) were set back "
                        "to fp32, as half keeps them (values rounded by the earlier cast stay rounded).")
            if not self.config.cast_buffers:
                msg += f" Other parameters are now {dtype}; other buffers keep the dtype they came in."
            msg += " Hand the model in fp32 to avoid the double rounding."
            warnings.warn(msg, UserWarning, stacklevel=2)
            ctx.note(msg)
