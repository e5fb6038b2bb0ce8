"""DeepSpeed 0.19 ZeRO stages 1, 2, 3 on its CPU accelerator (``DS_ACCELERATOR=cpu``) over gloo, fp32, the
client optimizer ``torch.optim.AdamW`` (the same as everyone's; ``zero_allow_untested_optimizer``), the
documented loop ``loss = engine(...); engine.backward(loss); engine.step()``.

ZeRO-3 leaves parameters under ``stage3_param_persistence_threshold`` elements (default 1e5) unsharded; it is set
to 0 here so every parameter is sharded like FSDP's (recorded in the notes).
"""
from __future__ import annotations

import torch

from .common import OPTIM_ARGS, Contender, Prepared


def _ds(stage: int):
    def setup(model, cfg) -> Prepared:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        world = torch.distributed.get_world_size()
        zero = {"stage": stage}
        if stage == 3:
            zero.update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=1e9,
                        stage3_prefetch_bucket_size=5e7)
        config = {"train_batch_size": cfg["global_batch"],
                  "train_micro_batch_size_per_gpu": cfg["global_batch"] // world,
                  "gradient_accumulation_steps": 1, "zero_optimization": zero,
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
        opt = torch.optim.AdamW(model.parameters(), **OPTIM_ARGS)
        engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

        def step(x):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            return loss.detach()

        inner = getattr(ds_opt, "optimizer", ds_opt)
        pbytes = None
        if stage == 3:
            pbytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in engine.module.parameters())
        notes = [f"zero_optimization={zero}", f"optimizer wrapper: {type(ds_opt).__name__}",
                 f"accelerator: {deepspeed.get_accelerator().device_name()}"]
        return Prepared(step, engine, inner, engine.world_size,
                        f"{type(engine).__name__}+{type(ds_opt).__name__}", notes, pbytes)
    return setup


CONTENDERS = {
    "ds_zero1": Contender(_ds(1), "zero1", sharded=False, wrapper="DeepSpeedEngine"),
    "ds_zero2": Contender(_ds(2), "zero2", sharded=False, wrapper="DeepSpeedEngine"),
    "ds_zero3": Contender(_ds(3), "zero3", sharded=True, wrapper="DeepSpeedEngine"),
}
