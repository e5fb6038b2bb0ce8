"""Hand-written PyTorch, the way its docs and tutorials teach it (no torchloom import):

- ``torch_ddp``: ``DistributedDataParallel`` (DDP tutorial), fp32.
- ``torch_ddp_zero1``: DDP with ``ZeroRedundancyOptimizer(optimizer_class=AdamW)`` (the ZeRO-1 recipe), fp32.
- ``torch_fsdp2_zero3`` / ``torch_fsdp2_zero2``: FSDP2 ``fully_shard`` on every decoder layer, then the root
  (FSDP2 tutorial), ``reshard_after_forward=True`` (ZeRO-3) or ``False`` (ZeRO-2), fp32.
- ``torch_fsdp2_zero3_ac_bf16``: the same ZeRO-3 plus non-reentrant activation checkpointing of every decoder
  layer (``apply_activation_checkpointing``) and bf16 compute by ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` (the FSDP2 tutorial's mixed precision: what replaces autocast under FSDP2).
- ``torch_fsdp2_zero3_ac_bf16_meta``: the same on a model built on the meta device; rank 0 builds the real
  weights and broadcasts them into the shards (``set_model_state_dict(..., broadcast_from_rank0=True)``).

The step: ``loss = model(input_ids=x, labels=x).loss; loss.backward(); opt.step(); opt.zero_grad()``.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .common import BLOCK_CLASS, OPTIM_ARGS, Contender, Prepared


def _init() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def _step(model, opt):
    def step(x):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _ddp(model, cfg) -> Prepared:
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init()
    model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), **OPTIM_ARGS)
    return Prepared(_step(model, opt), model, opt, dist.get_world_size(), type(model).__name__)


def _ddp_zero1(model, cfg) -> Prepared:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init()
    model = DDP(model)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **OPTIM_ARGS)
    # the local optimizer (.optim) holds this rank's shard of the state
    return Prepared(_step(model, opt), model, opt.optim, dist.get_world_size(),
                    f"{type(model).__name__}+{type(opt).__name__}")


def _materialize_from_rank0(model, cfg) -> None:
    """The FSDP2 docs' recipe for a model built on the meta device: rank 0 builds the real model (same seed), the
    sharded meta model gets storage (``to_empty``) and ``set_model_state_dict(full_state_dict=True,
    broadcast_from_rank0=True)`` scatters rank 0's weights; non-persistent buffers (rotary ``inv_freq``) are in no
    state dict, so they are recomputed."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from .common import build_model

    full = build_model(cfg["model"], seed=0).state_dict() if dist.get_rank() == 0 else {}
    model.to_empty(device="cpu")
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RotaryEmbedding"):
                inv_freq, _ = m.compute_default_rope_parameters(m.config)
                m.inv_freq.copy_(inv_freq)
                m.original_inv_freq.copy_(inv_freq)


def _fsdp2(zero3: bool, ac: bool = False, bf16: bool = False, meta: bool = False):
    def setup(model, cfg) -> Prepared:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        _init()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        if ac:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

            apply_activation_checkpointing(
                model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                               checkpoint_impl=CheckpointImpl.NO_REENTRANT),
                check_fn=lambda m: type(m).__name__ == BLOCK_CLASS)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=zero3, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=zero3, mp_policy=mp)
        if meta:
            _materialize_from_rank0(model, cfg)
        opt = torch.optim.AdamW(model.parameters(), **OPTIM_ARGS)
        units = sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP"))
        return Prepared(_step(model, opt), model, opt, mesh.size(),
                        f"{type(model).__name__} ({units} FSDP units)")
    return setup


CONTENDERS = {
    "torch_ddp": Contender(_ddp, "ddp", sharded=False, wrapper="DistributedDataParallel"),
    "torch_ddp_zero1": Contender(_ddp_zero1, "zero1", sharded=False, wrapper="DistributedDataParallel"),
    "torch_fsdp2_zero3": Contender(_fsdp2(True), "zero3", sharded=True, wrapper="FSDP"),
    "torch_fsdp2_zero2": Contender(_fsdp2(False), "zero2", sharded=True, wrapper="FSDP"),
    "torch_fsdp2_zero3_ac_bf16": Contender(_fsdp2(True, ac=True, bf16=True), "zero3+ac+bf16", sharded=True,
                                           wrapper="FSDP", precision="bf16"),
    "torch_fsdp2_zero3_ac_bf16_meta": Contender(_fsdp2(True, ac=True, bf16=True, meta=True), "zero3+ac+bf16",
                                                sharded=True, wrapper="FSDP", precision="bf16", meta=True),
}
