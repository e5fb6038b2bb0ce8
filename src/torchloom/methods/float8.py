"""`float8`: the blocks' Linear layers run their matrix products in FP8 (torchao's float8 training).

What it does, as torchtitan's ``float8`` converter does: every ``nn.Linear`` inside the repeated blocks becomes
a torchao ``Float8Linear`` (dynamic scaling: an absolute-maximum reduction and a cast of the input, the weight
and, in backward, the output gradient, per call), the head and embeddings stay in bf16. It needs a GPU with FP8
tensor cores (compute capability 8.9+: H100, H200, B200, L40S; MI300X through ROCm) and ``torchao``; on
anything else it is refused before the model is touched. The planner prices it for every accelerator whose
table entry has an FP8 peak.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from ..cost.effects import Effects, analysed_samples, blocks_per_rank
from ..errors import StrategyError
from ..parallel.blocks import find_blocks
from ..strategy.registry import Method, Stage, register_method

#: bytes moved per element by dynamic scaling with eager kernels: the amax reduction reads the bf16 tensor
#: (2 B), the cast reads it again and writes FP8 (2 + 1 B). Per weight GEMM: the input and the weight in
#: forward; the output gradient, plus FP8 transposed copies of input and weight (read 1 B + write 1 B) for the
#: two backward products (torchao ``Float8Linear``, tensorwise and rowwise recipes).
CAST_BYTES_PER_ELEMENT = 5.0
TRANSPOSE_BYTES_PER_ELEMENT = 2.0


@dataclass
class Float8Config:
    """recipe: torchao's scaling recipe ("tensorwise": one scale per tensor; "rowwise": one per row, more
    accurate, slightly slower GEMMs). filter_fqns: module names (substrings) kept in bf16 besides the head.
    save_fp8_inputs: planning only: price the weight GEMMs as keeping their FP8-cast inputs for backward
    (1 byte per element) instead of the bf16 ones: Transformer Engine's ``Linear``/``LayerNormLinear``/
    ``LayerNormMLP`` do (``saved_inputmat``), which is what Megatron-LM/NeMo FP8 runs save; torchao's
    ``Float8Linear`` (what ``apply`` installs) keeps the high-precision input, so a run asking for it is refused.
    fsdp_float8_all_gather: FSDP2 all-gathers the blocks' Linear weights in FP8 (torchao's
    ``enable_fsdp_float8_all_gather``, torchtitan's ``float8.enable_fsdp_float8_all_gather``; Megatron's
    ``fp8_param_gather`` is the same bytes): half the all-gather traffic and the gathered weights' memory.
    Tensorwise scaling only (torchao's rule)."""

    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    filter_fqns: list[str] | None = None
    save_fp8_inputs: bool = False
    fsdp_float8_all_gather: bool = False


@register_method
class Float8(Method):
    """FP8 Linear layers in the blocks (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; torchao
    ``convert_to_float8_training``); the rest of the step stays in amp's bf16."""

    name = "float8"
    aliases = {"fp8": {}}
    Config = Float8Config
    stage = Stage.REPLACE + 1  # a module swap: before pipeline splitting, tensor parallel and fsdp
    implies = ("amp",)
    conflicts = {"half": "float8 keeps fp32 master weights under bf16 amp; 'half' casts the weights themselves.",
                 "tensor_parallel": "float8 with tensor parallel needs torchao's Float8 tensor-parallel styles, "
                                    "which torchloom does not install yet; use fsdp/HSDP (and pipeline parallel) "
                                    "with float8, or tensor parallel in bf16."}

    def estimate(self, info, dims, hw, step):
        """The blocks' weight GEMMs at the accelerator's FP8 rate (the cost model reads ``StepShape.fp8``);
        attention and the head stay bf16. Added: the scaling casts' memory traffic (:data:`CAST_BYTES_PER_ELEMENT`
        per element of each GEMM's input, weight and output gradient, :data:`TRANSPOSE_BYTES_PER_ELEMENT` for
        the transposed copies), per micro-batch and block of the rank.

        Raises:
            StrategyError: the hardware has no FP8 rate (names the accelerators that have one).
        """
        if "float8" not in hw.peak_flops:
            from ..cost.accelerators import ACCELERATORS

            have = sorted(a.name for a in ACCELERATORS.values() if "float8" in a.peak_flops)
            raise StrategyError(f"float8: {hw.name} has no FP8 tensor cores (no float8 rate in its hardware "
                                f"description); plan float8 on {', '.join(have)}, or drop float8.")
        mb = analysed_samples(info, step)
        per_block = 0.0
        for part in info.blocks:
            for g in part.fwd.matmuls:
                if g.attention:
                    continue
                inp, weight, out = g.m * g.k * mb, g.k * g.n, g.m * g.n * mb
                per_block += g.count * part.count * (
                    CAST_BYTES_PER_ELEMENT * (inp + weight + out) + TRANSPOSE_BYTES_PER_ELEMENT * (inp + weight))
        per_block /= max(info.num_blocks, 1)
        split = max(dims.tp, 1) * max(dims.cp, 1)  # the rank's share of the weights (tp) and tokens (cp)
        seconds = per_block * blocks_per_rank(info, dims) * step.grad_accum / split / hw.mem_bw if hw.mem_bw else 0.0
        notes = [f"{self.config.recipe} scaling; head and attention in bf16"]
        if self.config.save_fp8_inputs:
            notes.append("weight GEMM inputs saved in FP8 (Transformer Engine; planning only)")
        if self.config.fsdp_float8_all_gather:
            notes.append("FSDP all-gathers the blocks' weights in FP8" if "fsdp" in step.methods else
                         "fsdp_float8_all_gather has no effect without fsdp")
        return Effects(self.name, time_add={"casts": seconds}, notes=notes)

    @classmethod
    def normalise_config(cls, raw):
        if (isinstance(raw, dict) and raw.get("fsdp_float8_all_gather") and raw.get("recipe") == "rowwise"):
            raise StrategyError(f"float8: fsdp_float8_all_gather needs recipe 'tensorwise' (torchao all-gathers "
                                f"FP8 weights with one scale per tensor only), got {raw.get('recipe')!r}: use "
                                "recipe tensorwise or drop fsdp_float8_all_gather.")
        return raw

    def validate(self, info, dims) -> None:
        """Refuse a model whose blocks hold no ``nn.Linear`` (``apply`` converts only those: GPT-2's ``Conv1D``,
        fused expert weights stay bf16), so a plan is never priced at FP8 for layers that would not run in it."""
        if not info.blocks:
            raise StrategyError("float8: the model has no repeated blocks to convert (pass block classes).")
        if info.module is not None and info.block_classes:
            import torch

            block = next((m for m in info.module.modules() if type(m).__name__ in info.block_classes), None)
            if block is not None and not any(isinstance(m, torch.nn.Linear) for m in block.modules()):
                raise StrategyError(f"float8: the blocks ({type(block).__name__}) hold no nn.Linear layers (torchao "
                                    "converts only those; e.g. GPT-2's Conv1D stays bf16): drop float8 for this model.")

    def apply(self, ctx) -> None:
        import torch

        if self.config.save_fp8_inputs:
            raise StrategyError("float8: save_fp8_inputs prices Transformer Engine's FP8 Linear layers (they keep the "
                                "FP8-cast input for backward); torchao's Float8Linear, which torchloom installs, keeps "
                                "the bf16 input. It is a planning option (loom plan, published-run pricing): drop it "
                                "to train.")

        if ctx.device.type != "cuda" or torch.cuda.get_device_capability(ctx.device) < (8, 9):
            where = ctx.device.type if ctx.device.type != "cuda" else torch.cuda.get_device_name(ctx.device)
            raise StrategyError(f"float8 needs a GPU with FP8 tensor cores (compute capability 8.9+: H100, H200, "
                                f"B200, L40S); this run is on {where}. Drop float8 or run on such a GPU.")
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as e:
            raise StrategyError("float8 needs torchao (pip install torchao); it is not installed.") from e
        config = Float8LinearConfig.from_recipe_name(self.config.recipe)
        if self.config.fsdp_float8_all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        skip = tuple(self.config.filter_fqns or ())
        converted = 0
        for part in ctx.model_parts:
            for qual, block in find_blocks(part, None):
                def keep(mod, fqn, _q=qual):
                    return isinstance(mod, torch.nn.Linear) and not any(s in f"{_q}.{fqn}" for s in skip)

                convert_to_float8_training(block, config=config, module_filter_fn=keep)
                converted += 1
        ctx.note(f"float8: Linear layers of {converted} blocks run in FP8 ({self.config.recipe} scaling)")
