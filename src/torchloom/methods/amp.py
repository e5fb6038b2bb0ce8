"""`amp`: automatic mixed precision (bf16/fp16 autocast, dynamic loss scaling for fp16)."""
from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from ..errors import StrategyError
from ..cost.effects import Collective, Effects, blocks_per_rank, dtype_bytes, part_activations, rank_params
from ..parallel.loss_scaler import DynamicLossScaler
from ..parallel.precision import upcast_low_precision
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

    Master weights, gradients and optimizer state are fp32 on both paths: bf16/fp16 parameters
    (``model.to(torch.bfloat16)``) are upcast to fp32 first, with a ``UserWarning``, together with the
    bf16/fp16 buffers of BatchNorm-like layers, and all bf16/fp16 buffers when every floating parameter came
    in low precision (``torchloom.parallel.precision.upcast_low_precision``). Buffers are never cast to the
    low dtype, and a bf16/fp16 buffer of a model with fp32 parameters keeps its dtype.
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

    @classmethod
    def normalise_config(cls, raw):
        dtype = raw.get("dtype") if isinstance(raw, dict) else None
        if isinstance(dtype, str) and dtype.lower().replace("_", "") in ("float8", "fp8", "float8e4m3fn"):
            raise StrategyError("amp: FP8 training is the 'float8' method on top of bf16 amp (torchao Float8Linear "
                                "in the blocks): use [{amp: {dtype: bfloat16}}, float8] (or just float8).")
        return raw

    search_configs = ({"dtype": "bfloat16"},)

    def estimate(self, info, dims, hw, step):
        """The matmuls run in the low dtype (``StepShape.compute_dtype``, read by the cost model) on fp32
        master weights; the memory-bound traffic shrinks by the analysis' activation-bytes ratio (autocast
        vs fp32: the share of the tensors that become low precision). Without fsdp, autocast caches a low-precision copy of every weight for the forward
        (kept for backward), and casts each matmul's weight and input (two extra ops per GEMM); with fsdp the
        ``MixedPrecisionPolicy`` casts the shards before the all-gather (priced by fsdp). fp16 adds the loss
        scaler's found-inf all-reduce over the world."""
        e = Effects(self.name)
        # memory-bound traffic (traced in fp32) shrinks as the tensors the ops touch move to the low dtype:
        # the analysis' saved-activation bytes under autocast vs fp32 measure that share
        lo = sum(part_activations(p, step.activation_key) * p.count for p in info.parts)
        hi = sum(p.act_bytes.get("float32", 0.0) * p.count for p in info.parts)
        if lo and hi:
            e.other_scale = min(1.0, lo / hi)
        if "fsdp" not in step.methods:
            # the analysis measured the copies per part; without it every weight is assumed copied
            nb, per = max(info.num_blocks, 1), blocks_per_rank(info, dims)
            copies = (sum(p.autocast_weight_bytes * p.count for p in info.blocks) * per / nb
                      + (info.rest.autocast_weight_bytes if info.rest is not None else 0.0)) / max(dims.tp, 1)
            e.memory_add["temporary"] = copies or rank_params(info, dims) * dtype_bytes(step.compute_dtype)
            gemms = sum(g.count for p in info.blocks for g in p.fwd.matmuls) / max(info.num_blocks, 1)
            e.ops_add = 2.0 * gemms
        if step.compute_dtype == "float16" and dims.dp * dims.tp * dims.pp > 1:
            e.collectives.append(Collective("all_reduce", 4, "dp", calls=1, label="amp.found_inf"))
        return e

    def configure(self, ctx) -> None:
        ctx.autocast_dtype = self.dtype
        if self.dtype == torch.float16:
            c = self.config
            ctx.loss_scaler = DynamicLossScaler(
                init_scale=c.init_scale, growth_factor=c.growth_factor, backoff_factor=c.backoff_factor,
                growth_interval=c.growth_interval, min_scale=c.min_scale,
            )

    def apply(self, ctx) -> None:
        upcast, left = [], []
        for part in ctx.model_parts:
            u, k = upcast_low_precision(part)
            upcast, left = upcast + u, left + k
        if upcast:
            msg = (f"amp: the model came with {len(upcast)} bf16/fp16 parameters/buffers (e.g. {upcast[:3]}); they "
                   "were upcast to fp32, because amp keeps fp32 master weights, gradients and optimizer state and "
                   "computes in low precision only inside the forward. Build or load the model in fp32 to avoid "
                   "this (precision lost by the earlier cast is not recovered), or use 'half' to train in low "
                   "precision.")
            warnings.warn(msg, UserWarning, stacklevel=2)
            ctx.note(msg)
        if left:
            ctx.note(f"amp: {len(left)} bf16/fp16 buffers next to fp32 parameters keep their dtype "
                     f"(e.g. {left[:3]}): buffers are never cast")
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
    """Low-precision floating tensors in ``out`` to fp32, through dicts (in place: HF ``ModelOutput`` keeps its
    type), dataclasses, namedtuples, tuples and lists (as FSDP2's ``output_dtype`` does); others unchanged."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() and out.dtype != torch.float32 else out
    if isinstance(out, dict):
        for k, v in list(out.items()):
            out[k] = _to_float(v)
        return out
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return dataclasses.replace(out, **{f.name: _to_float(getattr(out, f.name))
                                           for f in dataclasses.fields(out) if f.init})
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # namedtuple
        return type(out)(*(_to_float(v) for v in out))
    if isinstance(out, (tuple, list)):
        items = [_to_float(v) for v in out]
        try:
            return type(out)(items)
        except TypeError:  # a subclass with another constructor
            return tuple(items) if isinstance(out, tuple) else items
    return out
