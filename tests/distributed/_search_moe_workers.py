"""Rank function: ``strategy="auto"`` on a tiny Hugging Face Mixtral with expert parallelism in the space
(calibration, search, confirming trials that run the real ``expert_parallel``), then training with the chosen
plan; the parent compares with a single-process reference."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import torchloom
from tests.distributed._train_workers import OPTIMS
from tests.models import full_params, lm_loss, tiny_moe, token_batches

SEQ = 16


def batches(steps: int, global_batch: int) -> list[torch.Tensor]:
    """Two fixed global batches of random tokens, in turn (so a few steps visibly learn them)."""
    data = token_batches(2 * global_batch, seq=SEQ)
    return [data[(s % 2) * global_batch:(s % 2 + 1) * global_batch] for s in range(steps)]


def reference(steps: int, global_batch: int, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process running each data-parallel rank's slice as its own micro-batch (the load-balancing loss is
    per micro-batch per rank, as in the parallel run), gradients accumulated over the slices: per-step mean
    loss and the parameters after the last step."""
    model = tiny_moe("mixtral")
    cls, kw = OPTIMS["sgd"]
    opt = cls(model.parameters(), **kw)
    losses = []
    per = global_batch // dp
    for xs in batches(steps, global_batch):
        total = 0.0
        for r in range(dp):
            x = xs[r * per:(r + 1) * per]
            loss = model(input_ids=x, labels=x).loss
            (loss / dp).backward()
            total += loss.item() / dp
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def auto_train(cache_dir: str, steps: int, global_batch: int, search: dict) -> dict:
    """Search with ``search``, then ``steps`` optimizer steps on this rank's slice of each global batch (one
    micro-batch per step). Returns the per-step mean loss over the data-parallel ranks and what was chosen."""
    os.environ["TORCHLOOM_CACHE_DIR"] = cache_dir
    dataset = [{"input_ids": x, "labels": x} for x in token_batches(32, seq=SEQ, seed=99)]  # the trials' data
    cls, kw = OPTIMS["sgd"]
    res = torchloom.auto_accelerate(tiny_moe("mixtral"), cls, dataset, lm_loss, strategy="auto", optim_args=kw,
                                    dataloader_args={"batch_size": global_batch},
                                    model_input_format="unpack_dict", search=search)
    s = res.search
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    losses = []
    for xs in batches(steps, global_batch):
        mine = xs[r * (global_batch // dp):(r + 1) * (global_batch // dp)]
        per_call = res.micro_batch_size
        acc = torch.zeros(())
        for k in range(res.grad_accum_steps):
            x = mine[k * per_call:(k + 1) * per_call]
            acc += res.train_step({"input_ids": x, "labels": x}).detach().float()
        acc /= res.grad_accum_steps
        dist.all_reduce(acc, group=res.mesh.group("dp"))
        losses.append((acc / dp).item())
    params = full_params(res.model)  # collective: every rank
    return {"losses": losses, "params": params if dist.get_rank() == 0 else None, "chosen": s.chosen.key(), "label": s.chosen.label(), "chosen_by": s.chosen_by,
            "ep": s.chosen.dims.ep, "dp": dp, "accum": res.grad_accum_steps,
            "trials": [(t.candidate.label(), t.status, t.step_time_s) for t in s.trials], "table": s.table()}
