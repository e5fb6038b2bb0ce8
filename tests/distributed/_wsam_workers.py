"""Rank functions for WSAM under data parallelism, and the single-process references they are compared to."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import torchloom
from tests.models import full_params, lm_loss, tiny_llama, token_batches
from torchloom.optim import WSAM

HP = dict(lr=0.1, momentum=0.9, rho=0.1, gamma=0.8)  # base SGD + momentum keeps float noise at rounding level


def reference_wsam(steps: int, global_batch: int, replicas: int, max_grad_norm=None, seq: int = 16):
    """WSAM written out with autograd, independent of the WSAM class: each of ``replicas`` equal slices of
    the global batch perturbs the weights by its own normalised gradient (replicas=1: the averaged
    gradient); g and g~ are the means over replicas; SGD steps on (clipped) g, then
    w -= lr * alpha * (g~ - g)."""
    model = tiny_llama()
    params = list(model.parameters())
    base = torch.optim.SGD(params, lr=HP["lr"], momentum=HP["momentum"])
    alpha = HP["gamma"] / (1 - HP["gamma"])
    data = token_batches(steps * global_batch, seq=seq)
    per = global_batch // replicas
    losses = []
    for s in range(steps):
        xs = data[s * global_batch:(s + 1) * global_batch]
        g_sum = [torch.zeros_like(p) for p in params]
        gp_sum = [torch.zeros_like(p) for p in params]
        loss_sum = 0.0
        for r in range(replicas):
            x = xs[r * per:(r + 1) * per]
            loss = model(input_ids=x, labels=x).loss
            g = torch.autograd.grad(loss, params)
            loss_sum += loss.item()
            norm = torch.sqrt(sum((gi.double() ** 2).sum() for gi in g)).item()
            originals = [p.detach().clone() for p in params]
            with torch.no_grad():
                for p, gi in zip(params, g):
                    p.add_(gi * (HP["rho"] / (norm + 1e-12)))
            gp = torch.autograd.grad(model(input_ids=x, labels=x).loss, params)
            with torch.no_grad():
                for p, w in zip(params, originals):
                    p.copy_(w)
            for acc, gi in zip(g_sum, g):
                acc += gi
            for acc, gi in zip(gp_sum, gp):
                acc += gi
        g = [t / replicas for t in g_sum]
        gp = [t / replicas for t in gp_sum]
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        base.step()
        with torch.no_grad():
            for p, gi, gpi in zip(params, g, gp):
                p.add_(gpi - gi, alpha=-HP["lr"] * alpha)
        losses.append(loss_sum / replicas)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _accelerate(strategy, global_batch, micro_batch, max_grad_norm):
    return torchloom.auto_accelerate(
        tiny_llama(), functools.partial(WSAM, base_optimizer=torch.optim.SGD), None, lm_loss, strategy=strategy,
        optim_args=dict(HP), dataloader_args={"batch_size": global_batch, "micro_batch_size": micro_batch},
        model_input_format="unpack_dict", max_grad_norm=max_grad_norm,
    )


def _train(res, steps, global_batch, first_step=0, seq=16):
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    data = token_batches((first_step + steps) * global_batch, seq=seq)
    micro = global_batch // dp // res.grad_accum_steps
    losses = []
    for s in range(first_step, first_step + steps):
        xs = data[s * global_batch:(s + 1) * global_batch]
        per_rank = xs[r * (global_batch // dp):(r + 1) * (global_batch // dp)]
        acc = torch.zeros(())
        for k in range(res.grad_accum_steps):
            x = per_rank[k * micro:(k + 1) * micro]
            acc += res.train_step({"input_ids": x, "labels": x})
        acc /= res.grad_accum_steps
        dist.all_reduce(acc, group=res.mesh.group("dp"))
        losses.append((acc / dp).item())
    return losses


def train_wsam(configs: list[dict]) -> list[dict]:
    """For each config: ``steps`` WSAM steps through ``auto_accelerate``; losses, full params, notes.
    ``dcp=True`` also moves the model and WSAM state through ``get_state_dict``/``set_state_dict`` into a
    fresh run (empty optimizer state: DCP initialises it with a zero-gradient ``step()``), trains one more
    step in both and returns the max parameter difference."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.utils._pytree import tree_map

    out = []
    for cfg in configs:
        res = _accelerate(cfg["strategy"], cfg["global_batch"], cfg["micro_batch"], cfg.get("max_grad_norm"))
        losses = _train(res, cfg["steps"], cfg["global_batch"])
        item = {"losses": losses, "params": full_params(res.model), "notes": res.notes,
                "accum": res.grad_accum_steps, "is_wsam": isinstance(res.optimizer, WSAM)}
        if cfg.get("dcp"):
            # clone: load_state_dict keeps the given tensors, which would share res's momentum buffers
            msd, osd = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
                                get_state_dict(res.model, res.optimizer))
            fresh = _accelerate(cfg["strategy"], cfg["global_batch"], cfg["micro_batch"], cfg.get("max_grad_norm"))
            set_state_dict(fresh.model, fresh.optimizer, model_state_dict=msd, optim_state_dict=osd)
            _train(res, 1, cfg["global_batch"], first_step=cfg["steps"])
            _train(fresh, 1, cfg["global_batch"], first_step=cfg["steps"])
            a, b = full_params(res.model), full_params(fresh.model)
            item["dcp_max_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a)
        out.append(item)
    return out
