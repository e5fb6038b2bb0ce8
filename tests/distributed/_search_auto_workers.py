"""Rank function: ``strategy="auto"`` on a tiny Llama (calibration, search, confirming trials), then training
with the chosen plan on fixed batches; the parent compares with a single-process reference."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import torchloom
from tests.distributed._train_workers import OPTIMS
from tests.models import lm_loss, tiny_llama, token_batches

SEQ = 16
DISTINCT = 2  # the training cycles over this many global batches, so 10 steps visibly learn them


def batches(steps: int, global_batch: int) -> list[torch.Tensor]:
    """The global batch of each step: ``DISTINCT`` fixed batches of random tokens, in turn."""
    data = token_batches(DISTINCT * global_batch, seq=SEQ)
    return [data[(s % DISTINCT) * global_batch:(s % DISTINCT + 1) * global_batch] for s in range(steps)]


def reference(steps: int, global_batch: int, amp: bool) -> list[float]:
    """Single-process training on the same batches (bf16 autocast when the plan uses amp): per-step loss."""
    model = tiny_llama()
    cls, kw = OPTIMS["sgd"]
    opt = cls(model.parameters(), **kw)
    losses = []
    for x in batches(steps, global_batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def auto_train(cache_dir: str, steps: int, global_batch: int, search: dict) -> dict:
    """Search with ``search`` options, then ``steps`` optimizer steps of ``global_batch`` fixed samples (this
    rank's data-parallel slice, in the plan's per-call batches). Returns the per-step mean loss and what the
    search saw and chose."""
    os.environ["TORCHLOOM_CACHE_DIR"] = cache_dir
    dataset = [{"input_ids": x, "labels": x} for x in token_batches(64, seq=SEQ, seed=99)]  # the trials' data
    cls, kw = OPTIMS["sgd"]
    res = torchloom.auto_accelerate(tiny_llama(), cls, dataset, lm_loss, strategy="auto", optim_args=kw,
                                    dataloader_args={"batch_size": global_batch}, model_input_format="unpack_dict",
                                    search=search)
    s = res.search
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    per_call = res.micro_batch_size
    losses = []
    for xs in batches(steps, global_batch):
        mine = xs[r * (global_batch // dp):(r + 1) * (global_batch // dp)]
        acc = torch.zeros(())
        for k in range(res.grad_accum_steps):
            x = mine[k * per_call:(k + 1) * per_call]
            acc += res.train_step({"input_ids": x, "labels": x}).detach().float()
        acc /= res.grad_accum_steps
        dist.all_reduce(acc, group=res.mesh.group("dp"))
        losses.append((acc / dp).item())
    return {"losses": losses, "chosen": s.chosen.key(), "label": s.chosen.label(), "chosen_by": s.chosen_by,
            "trials": [(t.candidate.key(), t.status, t.step_time_s) for t in s.trials],
            "ranked": [e.candidate.key() for e in s.ranked[:30]], "n_ranked": len(s.ranked),
            "amp": "amp" in res.strategy, "strategy": res.strategy.to_list(explicit_only=True),
            "table": s.table(), "elapsed_s": s.elapsed_s, "notes": list(res.notes[:4])}
