"""`half`: the model's parameters in bf16 or fp16 (ATorch ``half``); buffers keep their dtype."""
from __future__ import annotations

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
        layers with running statistics stay fp32 (parameters and statistics).
    """

    dtype: Literal["bfloat16", "bf16", "float16", "fp16", "half"] = "bfloat16"
    cast_buffers: bool = False


@register_method
class Half(Method):
    """Parameters, gradients and optimizer state all in the low dtype: half the memory of fp32, no master
    weights (so small updates can be lost to rounding; prefer ``amp`` for training from scratch).

    Buffers keep their dtype and BatchNorm-like layers (running statistics) stay fp32 unless ``cast_buffers``
    (``torchloom.parallel.precision``). Inputs are not cast: floating-point tensors of the batch reach the
    model in the dtype ``prepare_input`` gives them.
    """

    name = "half"
    Config = HalfConfig
    stage = Stage.CAST

    def configure(self, ctx) -> None:
        ctx.param_dtype = DTYPES[self.config.dtype]

    def apply(self, ctx) -> None:
        cast = kept = 0
        for part in ctx.model_parts:  # also fine on the meta device
            c, k = cast_for_half(part, ctx.param_dtype, cast_buffers=self.config.cast_buffers)
            cast, kept = cast + c, kept + k
        if self.config.cast_buffers:
            ctx.note(f"half: parameters and floating-point buffers cast to {ctx.param_dtype} (cast_buffers)")
        else:
            ctx.note(f"half: {cast} parameters cast to {ctx.param_dtype}; buffers keep their dtype"
                     + (f"; {kept} parameters of BatchNorm-like layers kept in fp32 with their running statistics"
                        if kept else ""))
