"""Lightning Fabric 2.6, its documented loop (``fabric.launch``, ``fabric.setup``, ``fabric.backward``), CPU
accelerator, ``devices=world``; the ranks come from torchrun's environment (Fabric does not spawn):

- ``fabric_ddp``: ``strategy="ddp"``, ``precision="32-true"``;
- ``fabric_fsdp``: ``FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, sharding_strategy="FULL_SHARD")``
  (FSDP1, what Fabric's ``"fsdp"`` means);
- ``fabric_fsdp2``: ``ModelParallelStrategy`` with a ``parallelize_fn`` applying ``fully_shard`` per decoder
  layer and the root (Fabric's FSDP2 path).
"""
from __future__ import annotations

import torch

from .common import OPTIM_ARGS, Contender, Prepared


def _fabric(kind: str):
    def setup(model, cfg) -> Prepared:
        from lightning.fabric import Fabric

        if kind == "ddp":
            strategy = "ddp"
        elif kind == "fsdp":
            from lightning.fabric.strategies import FSDPStrategy
            from transformers.models.llama.modeling_llama import LlamaDecoderLayer

            strategy = FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, sharding_strategy="FULL_SHARD")
        else:
            from lightning.fabric.strategies import ModelParallelStrategy
            from torch.distributed.fsdp import fully_shard

            def parallelize(m, device_mesh):
                mesh = device_mesh["data_parallel"]
                for layer in m.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(m, mesh=mesh)
                return m

            strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=cfg["world"],
                                             tensor_parallel_size=1)
        fabric = Fabric(accelerator="cpu", devices=cfg["world"], num_nodes=1, strategy=strategy,
                        precision="32-true")
        fabric.launch()
        if kind != "ddp":  # sharded: the optimizer must see the sharded parameters (Fabric's FSDP docs)
            model = fabric.setup_module(model)
            opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), **OPTIM_ARGS))
        else:
            opt = torch.optim.AdamW(model.parameters(), **OPTIM_ARGS)
            model, opt = fabric.setup(model, opt)

        def step(x):
            loss = model(input_ids=x, labels=x).loss
            fabric.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        inner = getattr(opt, "optimizer", opt)
        inner = getattr(inner, "_optimizer", inner)
        wrapped = getattr(model, "_forward_module", model)  # what the strategy built (DDP, FSDP) inside Fabric's shim
        units = sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP")
                    or type(m).__name__ == "FullyShardedDataParallel")
        notes = [f"strategy={type(fabric.strategy).__name__}, cluster env="
                 f"{type(fabric.strategy.cluster_environment).__name__}"]
        return Prepared(step, model, inner, fabric.world_size,
                        f"{type(model).__name__}[{type(wrapped).__name__}]" + (f" ({units} FSDP units)" if units else ""),
                        notes)
    return setup


CONTENDERS = {
    "fabric_ddp": Contender(_fabric("ddp"), "ddp", sharded=False, wrapper="DistributedDataParallel"),
    "fabric_fsdp": Contender(_fabric("fsdp"), "zero3", sharded=True, wrapper="FullyShardedDataParallel"),
    "fabric_fsdp2": Contender(_fabric("fsdp2"), "zero3", sharded=True, wrapper="FSDP"),
}
