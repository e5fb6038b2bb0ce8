"""Rank functions for the optimizer tests: train a tiny Llama with AGD through ``auto_accelerate``; the
parent compares with a single-process run (``reference_agd``)."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import torchloom
from tests.models import full_params, lm_loss, tiny_llama, token_batches
from torchloom.optim import AGD

# default delta keeps near-zero gradient coordinates in the SGD regime, so reduction-order noise (~1e-7
# relative) is not amplified by 1/sqrt(b_hat) as it would be with delta=1e-14
AGD_ARGS = {"lr": 1e-2, "weight_decay": 0.01, "amsgrad": True}


def reference_agd(steps: int, global_batch: int, optim_args: dict, seq: int = 16):
    """Plain single-process AGD: one batch of ``global_batch`` per step. Returns (losses, params)."""
    model = tiny_llama()
    opt = AGD(model.parameters(), **optim_args)
    data = token_batches(steps * global_batch, seq=seq)
    losses = []
    for s in range(steps):
        x = data[s * global_batch:(s + 1) * global_batch]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_agd_many(configs: list[dict]) -> list[dict]:
    """Several ``train_agd`` configurations in one launch (a launch costs seconds)."""
    out = []
    for cfg in configs:
        try:
            out.append(train_agd(**cfg))
        except Exception as e:
            raise RuntimeError(f"config {cfg} failed: {e}") from e
    return out


def _accelerate(strategy, optim_args, global_batch, micro_batch):
    return torchloom.auto_accelerate(
        tiny_llama(), AGD, None, lm_loss, strategy=strategy, optim_args=optim_args,
        dataloader_args={"batch_size": global_batch, "micro_batch_size": micro_batch},
        model_input_format="unpack_dict",
    )


def _train(res, data, steps, global_batch, micro_batch) -> list[float]:
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    losses = []
    for s in steps:
        xs = data[s * global_batch:(s + 1) * global_batch]
        per_rank = xs[r * (global_batch // dp):(r + 1) * (global_batch // dp)]
        acc = torch.zeros(())
        for k in range(res.grad_accum_steps):
            x = per_rank[k * micro_batch:(k + 1) * micro_batch]
            acc += res.train_step({"input_ids": x, "labels": x})
        acc /= res.grad_accum_steps
        dist.all_reduce(acc, group=res.mesh.group("dp"))
        losses.append((acc / dp).item())
    return losses


def train_agd(strategy, steps: int, global_batch: int, micro_batch: int, optim_args: dict,
              resume_at: int | None = None) -> dict:
    """Per-step mean loss, full parameters and facts about the optimizer state on every rank.

    ``resume_at``: after that many steps, copy model and optimizer state with
    ``get_{model,optimizer}_state_dict`` (the DCP path) into a freshly accelerated model and AGD, and run
    the remaining steps there; the result also holds the uninterrupted run's parameters (``params_direct``).
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )

    data = token_batches(steps * global_batch)
    res = _accelerate(strategy, optim_args, global_batch, micro_batch)
    opt = res.optimizer
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps the local AGD in .optim
    if not isinstance(inner, AGD):
        raise TypeError(f"the optimizer is {type(inner).__name__}, not AGD")
    out = {"notes": res.notes, "strategy": repr(res.strategy)}
    if resume_at is None:
        out["losses"] = _train(res, data, range(steps), global_batch, micro_batch)
    else:
        losses = _train(res, data, range(resume_at), global_batch, micro_batch)
        # the state dicts alias the live (sharded) tensors: copy them before training on
        model_sd = copy.deepcopy(get_model_state_dict(res.model))
        optim_sd = copy.deepcopy(get_optimizer_state_dict(res.model, opt))
        out["saved_steps"] = sorted({float(s["step"]) for s in optim_sd["state"].values()})
        out["saved_step_types"] = sorted({type(s["step"]).__name__ for s in optim_sd["state"].values()})
        _train(res, data, range(resume_at, steps), global_batch, micro_batch)
        out["params_direct"] = full_params(res.model)
        res = _accelerate(strategy, optim_args, global_batch, micro_batch)
        set_model_state_dict(res.model, model_sd)
        set_optimizer_state_dict(res.model, res.optimizer, optim_sd)
        losses += _train(res, data, range(resume_at, steps), global_batch, micro_batch)
        out["losses"] = losses
        inner = res.optimizer
    states = list(inner.state.values())
    out["state_types"] = sorted({type(s["exp_avg"]).__name__ for s in states})
    out["steps"] = sorted({float(s["step"]) for s in states})
    local = [s["exp_avg"].to_local() if isinstance(s["exp_avg"], DTensor) else s["exp_avg"] for s in states]
    out["state_numel"] = sum(t.numel() for t in local)
    out["params"] = full_params(res.model)
    return out
