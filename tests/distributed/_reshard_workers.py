"""Rank functions for the resharding tests (tests/distributed/test_reshard.py, tests/cases/test_c15_*.py).

A *source* run trains a tiny Llama with ``auto_accelerate`` (a real map-style dataset, so the loader is a
``StatefulDataLoader``), saves a checkpoint after ``save_at`` optimizer steps and keeps going: it is the
uninterrupted run. A *target* run builds a differently initialised model under another strategy and world
size, loads that checkpoint and trains the remaining steps. Both record, per optimizer step, the global
mean loss and the sorted global sample ids, and finally the full parameters.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import torchloom
from tests.models import full_params, tiny_llama

N_SAMPLES, SEQ, VOCAB = 50, 16, 128  # global batch 12: 4 steps per epoch (48 samples), steps 5+ in epoch 1

OPTIMS = {
    # SGD+momentum keeps world-size rounding differences at rounding level; AdamW (C15) amplifies them a bit.
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
}


class TokenDataset(Dataset):
    """``N_SAMPLES`` fixed random token sequences; each item carries its index as ``idx``."""

    def __init__(self):
        g = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, VOCAB, (N_SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i], "idx": i}


def _accelerate(strategy, optim: str, global_batch: int, micro_batch: int, model_seed: int):
    cls, kw = OPTIMS[optim]
    return torchloom.auto_accelerate(
        tiny_llama(seed=model_seed), cls, TokenDataset(), lambda batch, out: out.loss, strategy=strategy,
        optim_args=kw, dataloader_args={"batch_size": global_batch, "micro_batch_size": micro_batch},
        model_input_format="unpack_dict",
        lr_scheduler_cls=torch.optim.lr_scheduler.StepLR, lr_scheduler_args={"step_size": 2, "gamma": 0.5},
    )


def _train(res, start: int, end: int, save_at=(), root: str | None = None) -> list[dict]:
    """Optimizer steps ``start+1 .. end``; saves after each step in ``save_at`` (an int or a collection).
    Returns one record per step."""
    save_at = {save_at} if isinstance(save_at, int) else set(save_at)
    records, step, k = [], start, 0
    loss, ids = torch.zeros(()), []
    while step < end:
        for batch in res.dataloader:
            idx = batch.pop("idx").tolist()
            # cp peers read the same samples: count them once (on the first rank of each cp group)
            ids += idx if res.mesh.dims.cp == 1 or res.mesh["cp"].get_local_rank() == 0 else []
            loss += res.train_step(batch)
            k += 1
            if k < res.grad_accum_steps:
                continue
            step, k = step + 1, 0
            assert res.train_step.optimizer_steps == step
            loss /= res.grad_accum_steps
            dist.all_reduce(loss)  # dp == world in these tests
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, ids)
            records.append({"step": step, "loss": loss.item() / dist.get_world_size(),
                            "ids": sorted(i for part in gathered for i in part),
                            "lr": res.optimizer.param_groups[0]["lr"]})
            loss, ids = torch.zeros(()), []
            if step in save_at:
                from torchloom.checkpoint import save

                save(root, step=step, model=res.model, optimizer=res.optimizer, lr_scheduler=res.lr_scheduler,
                     dataloader=res.dataloader, train_step=res.train_step)
            if step == end:
                break
    return records


def run_jobs(tmp: str, jobs: list[dict]) -> list[dict]:
    """Run several source/target jobs in one launch (a launch costs seconds).

    A job: ``{"name", "strategy", "optim", "global_batch", "micro_batch", "steps", "save_at"}`` (source, saves
    to ``<tmp>/<name>``) or the same with ``"load": "<source name>"`` (target: loads the newest complete
    checkpoint of that source and trains the steps after it).
    """
    out = []
    for job in jobs:
        try:
            out.append(_run_job(tmp, job))
        except Exception as e:
            raise RuntimeError(f"job {job['name']} failed: {type(e).__name__}: {e}") from e
    return out


def _run_job(tmp: str, job: dict) -> dict:
    src = job.get("load")
    res = _accelerate(job["strategy"], job["optim"], job["global_batch"], job["micro_batch"],
                      model_seed=0 if src is None else 7)  # a target starts from other weights
    rec: dict = {"name": job["name"], "world": dist.get_world_size(), "accum": res.grad_accum_steps,
                 "notes": res.notes}
    if src is None:
        rec["records"] = _train(res, 0, job["steps"], job["save_at"], str(Path(tmp) / job["name"]))
    else:
        from torchloom.checkpoint import load

        info = load(Path(tmp) / src, model=res.model, optimizer=res.optimizer, lr_scheduler=res.lr_scheduler,
                    dataloader=res.dataloader, train_step=res.train_step)
        rec["loaded_step"] = info["step"]
        rec["optimizer_steps_after_load"] = res.train_step.optimizer_steps
        rec["data_state_after_load"] = res.dataloader.state_dict()
        rec["records"] = _train(res, info["step"], job["steps"])
    params = full_params(res.model)
    rec["params"] = params if dist.get_rank() == 0 else None
    return rec
