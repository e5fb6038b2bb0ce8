"""`half`: cast the whole model (parameters and buffers) to bf16 or fp16 (ATorch ``half``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..strategy.registry import Method, Stage, register_method
from .amp import DTYPES


@dataclass
class HalfConfig:
    dtype: Literal["bfloat16", "bf16", "float16", "fp16", "half"] = "bfloat16"


@register_method
class Half(Method):
    """Parameters, gradients and optimizer state all in the low dtype: half the memory of fp32, no master
    weights (so small updates can be lost to rounding; prefer ``amp`` for training from scratch)."""

    name = "half"
    Config = HalfConfig
    stage = Stage.CAST

    def configure(self, ctx) -> None:
        ctx.param_dtype = DTYPES[self.config.dtype]

    def apply(self, ctx) -> None:
        for part in ctx.model_parts:
            part.to(ctx.param_dtype)  # also fine on the meta device
        ctx.note(f"half: parameters cast to {ctx.param_dtype}")
