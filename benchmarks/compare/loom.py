"""torchloom ``auto_accelerate`` with the strategies of the hand-written contenders, plus ``strategy="auto"``:

- ``loom_ddp``: ``["ddp"]``; ``loom_zero1``: ``["zero1"]``; ``loom_zero2`` / ``loom_zero3``: ``["zero2"]`` / ``["zero3"]`` (FSDP2 underneath);
- ``loom_zero3_ac_bf16``: ``["zero3", "checkpoint", ("amp", {"dtype": "bfloat16"})]``;
- ``loom_zero3_ac_bf16_meta``: the same on a model built on the meta device (``auto_accelerate`` materialises
  each shard with the values of the plain build: no rank holds the whole model);
- ``loom_auto``: ``strategy="auto"`` (the strategy search picks, with the plan cache off so every launch
  searches; its time is setup, not step time).

The step is ``result.train_step({"input_ids": x, "labels": x})`` with the model output's loss (global batch
given to ``auto_accelerate``; micro-batch = global / world, no accumulation).
"""
from __future__ import annotations

import torch

from .common import OPTIM_ARGS, Contender, Prepared


def _loom(strategy, search_options=None):
    def setup(model, cfg) -> Prepared:
        search = dict(search_options or {})
        import torchloom

        if strategy == "auto":  # the search sizes the inputs from one batch of the same token stream
            from .common import global_batches

            x = global_batches(cfg["model"], cfg["global_batch"], 1)[0]
            search.setdefault("sample_batch", {"input_ids": x, "labels": x})
        res = torchloom.auto_accelerate(
            model, torch.optim.AdamW, None, None, strategy=strategy, optim_args=dict(OPTIM_ARGS),
            dataloader_args={"batch_size": cfg["global_batch"]}, model_input_format="unpack_dict",
            search=dict(search) if search else None)
        if res.grad_accum_steps != 1:
            raise RuntimeError(f"torchloom chose {res.grad_accum_steps} accumulation steps; the comparison needs 1")

        def step(x):
            return res.train_step({"input_ids": x, "labels": x})

        units = sum(1 for m in res.model.modules() if type(m).__name__.startswith("FSDP"))
        names = [m.name for m in res.strategy.methods] if hasattr(res.strategy, "methods") else str(res.strategy)
        wrapper = type(res.model).__name__ + (f" ({units} FSDP units)" if units else "")
        notes = [f"strategy: {names}", f"world (mesh): {res.mesh.dims}"] + list(res.notes)
        inner = getattr(res.optimizer, "optim", res.optimizer)  # zero1 keeps this rank's shard in .optim
        return Prepared(step, res.model, inner, int(torch.distributed.get_world_size()), wrapper, notes)
    return setup


CONTENDERS = {
    "loom_ddp": Contender(_loom(["ddp"]), "ddp", sharded=False, wrapper="DistributedDataParallel"),
    "loom_zero1": Contender(_loom(["zero1"]), "zero1", sharded=False, wrapper="DistributedDataParallel"),
    "loom_zero3": Contender(_loom(["zero3"]), "zero3", sharded=True, wrapper="FSDP"),
    "loom_zero2": Contender(_loom(["zero2"]), "zero2", sharded=True, wrapper="FSDP"),
    "loom_zero3_ac_bf16": Contender(_loom(["zero3", "checkpoint", ("amp", {"dtype": "bfloat16"})]), "zero3+ac+bf16",
                                    sharded=True, wrapper="FSDP", precision="bf16"),
    "loom_zero3_ac_bf16_meta": Contender(_loom(["zero3", "checkpoint", ("amp", {"dtype": "bfloat16"})]),
                                         "zero3+ac+bf16", sharded=True, wrapper="FSDP", precision="bf16", meta=True),
    "loom_auto": Contender(_loom("auto", {"time_limit_s": 60, "cache": False}), "auto", sharded=False, wrapper=""),
}
