"""torchloom ``auto_accelerate`` with the strategies of the hand-written contenders, plus ``strategy="auto"``:

- ``loom_ddp``: ``["ddp"]``; ``loom_zero1``: ``["zero1"]``; ``loom_zero2`` / ``loom_zero3``: ``["zero2"]`` / ``["zero3"]`` (FSDP2 underneath);
- ``loom_zero3_ac_bf16``: ``["zero3", "checkpoint", ("amp", {"dtype": "bfloat16"})]``;
- ``loom_zero3_ac_bf16_meta``: the same on a model built on the meta device (``auto_accelerate`` materialises
  each shard with the values of the plain build: no rank holds the whole model);
- ``loom_auto``: ``strategy="auto"`` (the strategy search picks, with the plan cache off so every launch
  searches; its time is setup, not step time).

The step is ``result.train_step({"input_ids": x, "labels": x})`` with the model output's loss (global batch
given to ``auto_accelerate``; micro-batch = global / world, no accumulation). When the search picks a smaller
micro-batch (``loom_auto``), the rank's rows go through ``train_step`` in that many equal micro-batches: one
optimizer step on the same global batch.
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
            search=search or None)
        accum = res.grad_accum_steps  # > 1 only when the search picks a smaller micro-batch (same global batch)
        dp_rank, dp_size = res.mesh.dp_rank, res.mesh.dp_size  # tp/pp peers read the same rows

        def batch_slice(batch):
            from .common import rank_slice

            return rank_slice(batch, dp_rank, dp_size)

        def step(x):
            if accum == 1:
                return res.train_step({"input_ids": x, "labels": x})
            if x.shape[0] % accum:
                raise RuntimeError(f"torchloom chose {accum} accumulation steps, which do not divide this rank's "
                                   f"{x.shape[0]} sequences")
            # one optimizer step over the rank's rows in `accum` equal micro-batches: the same update as one
            # batch (train_step averages the micro-batch means); the reported loss is their mean
            return torch.stack([res.train_step({"input_ids": c, "labels": c}) for c in x.chunk(accum)]).mean()

        units = sum(1 for m in res.model.modules() if type(m).__name__.startswith("FSDP"))
        entries = list(getattr(res.strategy, "entries", []))
        names = [e.name + ("" if e.name not in ("amp", "half") else f"({getattr(e.config, 'dtype', '')})")
                 for e in entries] or str(res.strategy)
        wrapper = type(res.model).__name__ + (f" ({units} FSDP units)" if units else "")
        notes = [f"strategy: {names}", f"world (mesh): {res.mesh.dims}",
                 f"micro-batch {res.micro_batch_size} x {accum} accumulation step(s) per rank"] + list(res.notes)
        inner = getattr(res.optimizer, "optim", res.optimizer)  # zero1 keeps this rank's shard in .optim
        bf16 = any(e.name in ("amp", "half") and "bfloat16" in str(getattr(e.config, "dtype", ""))
                   for e in entries)
        d = res.mesh.dims  # the world torchloom's mesh spans (its own accessor, not the process group's)
        mesh_world = d.pp * d.dp_replicate * d.dp_shard * d.tp
        return Prepared(step, res.model, inner, mesh_world, wrapper, notes,
                        precision="bf16" if bf16 else "fp32", batch_slice=batch_slice)
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
