"""Rank functions for tests/distributed/test_annotations_moe.py: a tiny HF Mixtral whose experts are in
``split`` scopes trained through ``torchloom.auto_accelerate`` with the strategy derived from the annotations,
and the same model trained through ``torchloom.compat.atorch.auto_accelerate`` with ATorch's
``("expert", 2)`` parallel_mode degree in ATorch's plain loop. The reference is ``_ep_workers.reference``."""
from __future__ import annotations

import torch
import torch.distributed as dist

import torchloom
from tests.distributed._ep_workers import LR, MOMENTUM, build, rank_batches
from tests.models import full_params, lm_loss


def annotate(model):
    """EPL's M6 form with the function form: every layer's experts in one split(2) scope, nothing else."""
    torchloom.split(*[layer.mlp.experts for layer in model.model.layers], device_count=2)
    return model


def _mean_loss(acc: torch.Tensor, dp: int, group) -> float:
    dist.all_reduce(acc, group=group)
    return (acc / dp).item()


def train_annotated(steps: int, global_batch: int, micro: int) -> dict:
    res = torchloom.auto_accelerate(
        annotate(build("mixtral")), torch.optim.SGD, None, lm_loss, strategy=None,
        optim_args={"lr": LR, "momentum": MOMENTUM},
        dataloader_args={"batch_size": global_batch, "micro_batch_size": micro}, model_input_format="unpack_dict")
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    losses = []
    for step in rank_batches(steps, global_batch, dp, micro):
        acc = torch.zeros(())
        for x in step[r]:
            acc += res.train_step({"input_ids": x, "labels": x}).detach().float()
        losses.append(_mean_loss(acc / res.grad_accum_steps, dp, res.mesh.group("dp")))
    return {"losses": losses, "params": full_params(res.model), "strategy": res.strategy.to_dict(),
            "notes": res.notes, "mesh": {**res.mesh.dims.as_dict(), "edp": res.mesh.dims.edp}}


def train_atorch(steps: int, global_batch: int) -> dict:
    """ATorch's plain loop: ``loss = loss_func(batch, model(**batch)); loss.backward(); optim.step()``, one
    micro-batch of global_batch / 2 per rank per step."""
    import torchloom.compat.atorch as atorch
    from torchloom.compat.atorch.distributed.distributed import parallel_group_size, parallel_rank

    status, result, best = atorch.auto_accelerate(
        build("mixtral"), torch.optim.SGD, loss_func=lm_loss, optim_args={"lr": LR, "momentum": MOMENTUM},
        load_strategy=[("parallel_mode", ([("data", 2), ("expert", 2)], None))], ignore_dryrun_on_load_strategy=True)
    assert status, "compat auto_accelerate failed"
    native = result.args["torchloom_result"]
    dp, r = native.mesh.dp_size, native.mesh.dp_rank
    losses = []
    for step in rank_batches(steps, global_batch, dp, global_batch // dp):
        (x,) = step[r]
        batch = {"input_ids": x, "labels": x}
        loss = result.loss_func(batch, result.model(**batch))
        loss.backward()
        result.optim.step()
        result.optim.zero_grad()
        losses.append(_mean_loss(loss.detach().float(), dp, native.mesh.group("dp")))
    return {"losses": losses, "params": full_params(result.model), "best": [list(i) for i in best],
            "strategy": native.strategy.to_dict(), "notes": result.args["notes"],
            "groups": {n: (parallel_group_size(n), parallel_rank(n)) for n in ("data", "expert", "expert_fsdp")}}


def run_all(steps: int, global_batch: int, micro: int) -> dict:
    """Both runs in one launch (a launch costs seconds)."""
    return {"annotated": train_annotated(steps, global_batch, micro), "atorch": train_atorch(steps, global_batch)}
