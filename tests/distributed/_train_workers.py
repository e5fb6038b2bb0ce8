"""Rank functions: train a tiny model with a strategy; the parent compares with a 1-process reference."""
from __future__ import annotations

import torch
import torch.distributed as dist

import torchloom
from tests.models import full_params, lm_loss, tiny_llama, token_batches


OPTIMS = {
    # SGD with momentum keeps float differences at rounding level, so parameters compare tightly;
    # AdamW divides by sqrt(v) and amplifies 1e-7 gradient noise where gradients are near eps.
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2}),
}


def reference_llama(steps: int, global_batch: int, optim: str = "sgd", tie: bool = False, max_grad_norm=None,
                    seq: int = 16, autocast_dtype=None):
    """Plain single-process training: one batch of ``global_batch`` per step."""
    model = tiny_llama(tie=tie)
    cls, kw = OPTIMS[optim]
    opt = cls(model.parameters(), **kw)
    data = token_batches(steps * global_batch, seq=seq)
    losses = []
    for s in range(steps):
        x = data[s * global_batch:(s + 1) * global_batch]
        with torch.autocast("cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_many(configs: list[dict]) -> list[dict]:
    """Run several ``train_llama`` configurations in one launch (a launch costs seconds here)."""
    out = []
    for cfg in configs:
        try:
            out.append(train_llama(**cfg))
        except Exception as e:
            raise RuntimeError(f"config {cfg} failed: {e}") from e
    return out


def train_llama(strategy, steps: int, global_batch: int, micro_batch: int, optim: str = "sgd", tie: bool = False,
                max_grad_norm=None, seq: int = 16, meta: bool = False):
    """Per-step mean loss (averaged over the global batch) and full params on every rank."""
    if meta:
        with torch.device("meta"):
            model = tiny_llama(tie=tie)
    else:
        model = tiny_llama(tie=tie)
    cls, kw = OPTIMS[optim]
    res = torchloom.auto_accelerate(
        model, cls, None, lm_loss, strategy=strategy, optim_args=kw,
        dataloader_args={"batch_size": global_batch, "micro_batch_size": micro_batch},
        model_input_format="unpack_dict", max_grad_norm=max_grad_norm,
    )
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    data = token_batches(steps * global_batch, seq=seq)
    losses = []
    for s in range(steps):
        xs = data[s * global_batch:(s + 1) * global_batch]
        per_rank = xs[r * (global_batch // dp):(r + 1) * (global_batch // dp)]
        acc = torch.zeros(())
        for k in range(res.grad_accum_steps):
            x = per_rank[k * micro_batch:(k + 1) * micro_batch]
            acc += res.train_step({"input_ids": x, "labels": x})
        acc /= res.grad_accum_steps
        dist.all_reduce(acc, group=res.mesh.group("dp"))
        losses.append((acc / dp).item())
    return {"losses": losses, "params": full_params(res.model), "notes": res.notes,
            "strategy": repr(res.strategy), "accum": res.grad_accum_steps}
