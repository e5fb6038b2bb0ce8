"""Hugging Face Accelerate 1.15, its documented loop (``accelerator.prepare``, ``accelerator.backward``):

- ``accel_ddp``: ``Accelerator(cpu=True)`` (multi-CPU DDP over gloo from torchrun's environment), fp32;
  ``accel_ddp_nocpu``: ``Accelerator()`` (not in the default list: on a CPU-only machine Accelerate then picks
  ``DistributedType.NO`` and every rank trains alone, which the checks flag);
- ``accel_fsdp2_zero3``: ``FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
  auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"])``, fp32;
- ``accel_fsdp2_zero3_ac_bf16``: the same plugin with ``activation_checkpointing=True`` and
  ``mixed_precision="bf16"``.

The wrapper Accelerate actually built is reported: with ``cpu=True`` (``DistributedType.MULTI_CPU``) Accelerate 1.15
applies an FSDP plugin only for accelerator devices and silently builds DDP instead; the silent-fallback checks
flag that (wrapper, unsharded per-rank parameter bytes).
"""
from __future__ import annotations

import torch

from .common import BLOCK_CLASS, OPTIM_ARGS, Contender, Prepared


def _accel(fsdp: bool, ac: bool = False, bf16: bool = False, cpu: bool = True):
    def setup(model, cfg) -> Prepared:
        from accelerate import Accelerator, FullyShardedDataParallelPlugin

        # cpu=True: without it a CPU machine gets DistributedType.NO, every rank training alone (probed)
        kw = {"mixed_precision": "bf16" if bf16 else "no", "cpu": cpu}
        if fsdp:
            kw["fsdp_plugin"] = FullyShardedDataParallelPlugin(
                fsdp_version=2, reshard_after_forward=True, auto_wrap_policy="transformer_based_wrap",
                transformer_cls_names_to_wrap=[BLOCK_CLASS], activation_checkpointing=ac,
                state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False)
        acc = Accelerator(**kw)
        opt = torch.optim.AdamW(model.parameters(), **OPTIM_ARGS)
        model, opt = acc.prepare(model, opt)

        def step(x):
            loss = model(input_ids=x, labels=x).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        units = sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP"))
        inner = getattr(opt, "optimizer", opt)
        notes = [f"distributed_type={acc.state.distributed_type}, mixed_precision={acc.mixed_precision}, "
                 f"device={acc.device}"]
        return Prepared(step, model, inner, acc.num_processes,
                        type(model).__name__ + (f" ({units} FSDP units)" if units else ""), notes)
    return setup


CONTENDERS = {
    "accel_ddp": Contender(_accel(False), "ddp", sharded=False, wrapper="DistributedDataParallel"),
    "accel_ddp_nocpu": Contender(_accel(False, cpu=False), "ddp", sharded=False, wrapper="DistributedDataParallel"),
    "accel_fsdp2_zero3": Contender(_accel(True), "zero3", sharded=True, wrapper="FSDP"),
    "accel_fsdp2_zero3_ac_bf16": Contender(_accel(True, ac=True, bf16=True), "zero3+ac+bf16", sharded=True,
                                           wrapper="FSDP", precision="bf16"),
}
