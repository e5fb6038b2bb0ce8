"""Independent float64 references of ATorch's AGD and WeightedSAM semantics (written from the formulas in
ATorch's code and papers, not from its code), for tests/compat/test_atorch_optimizers_semantics.py, and the
2-rank worker of its distributed test (spawned ranks import it by module name)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def agd_reference(p0, grads_fn, steps, lr=1e-3, betas=(0.9, 0.999), delta=1e-5, weight_decay=0.0,
                  weight_decouple=True, fixed_decay=False, amsgrad=False, clip=None):
    """ATorch's AGD on one tensor: returns (parameters after each step, the gradient each step left in
    ``p.grad``). ``grads_fn(p, t)`` gives the gradient at ``p``."""
    b1, b2 = betas
    p = p0.clone()
    m = torch.zeros_like(p)
    b = torch.zeros_like(p)
    bmax = torch.zeros_like(p)
    params, left_grads = [], []
    for t in range(1, steps + 1):
        g = grads_fn(p, t).clone()
        if weight_decouple:
            p = p * (1.0 - (weight_decay if fixed_decay else lr * weight_decay))
        elif weight_decay:
            g = g + weight_decay * p  # ATorch: in place, into p.grad
        bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
        m_prev_hat = m / (1.0 - b1 ** (t - 1)) if t > 1 else torch.zeros_like(m)
        m = b1 * m + (1.0 - b1) * g
        s = m / bc1 - m_prev_hat
        b = b2 * b + (1.0 - b2) * s * s
        bmax = torch.maximum(bmax, b)
        denom = torch.clamp((bmax if amsgrad else b).sqrt(), min=delta * math.sqrt(bc2))
        u = m / denom  # not bias-corrected: ATorch's clip acts here
        if clip is not None:
            u = u.clamp(-clip, clip)
        p = p - lr * math.sqrt(bc2) / bc1 * u
        params.append(p.clone())
        left_grads.append(g)
    return params, left_grads


def clip_(grads, max_norm):
    """``torch.nn.utils.clip_grad_norm_`` on plain tensors: scale by min(1, max_norm / (norm + 1e-6))."""
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    coef = min(1.0, max_norm / (norm + 1e-6))
    return [g * coef for g in grads]


def wsam_reference(w0, grad_fn, steps, lr, momentum, rho, gamma, decouple, adaptive, max_norm,
                   replica_grad_fns=None, sam_eps=1e-12):
    """ATorch's WeightedSAM around SGD(lr, momentum), on a list of tensors.

    ``grad_fn(ws)`` gives the (averaged) gradient list at ``ws``. With ``replica_grad_fns`` (one per replica),
    each replica perturbs by its own first-pass gradient, and g and g~ are the replicas' averages (ATorch's
    first pass under ``no_sync``)."""
    alpha = gamma / (1.0 - gamma)
    ws = [w.clone() for w in w0]
    bufs = None
    for _ in range(steps):
        fns = replica_grad_fns or [grad_fn]
        gs_r, gts_r = [], []
        for fn in fns:
            g = fn(ws)
            if adaptive:
                norm = math.sqrt(sum(float(((w.abs() * x) ** 2).sum()) for w, x in zip(ws, g)))
                es = [rho * w * w * x / (norm + sam_eps) for w, x in zip(ws, g)]
            else:
                norm = math.sqrt(sum(float((x * x).sum()) for x in g))
                es = [rho * x / (norm + sam_eps) for x in g]
            gs_r.append(g)
            gts_r.append([w + e for w, e in zip(ws, es)])
        n = len(fns)
        g = [sum(parts) / n for parts in zip(*gs_r)]
        # the second pass: each replica at its own perturbed weights, gradients averaged (DDP)
        gt = [sum(parts) / n for parts in zip(*[fn(wp) for fn, wp in zip(fns, gts_r)])]
        if max_norm is not None:
            g, gt = clip_(g, max_norm), clip_(gt, max_norm)
        step_grad = g if decouple else [x + alpha * (y - x) for x, y in zip(g, gt)]
        bufs = [x.clone() for x in step_grad] if bufs is None else [momentum * bf + x for bf, x in
                                                                     zip(bufs, step_grad)]
        ws = [w - lr * bf for w, bf in zip(ws, bufs)]
        if decouple:
            ws = [w - lr * alpha * (y - x) for w, x, y in zip(ws, g, gt)]
    return ws


# ------------------------------------------------------------------------------------------ 2-rank worker
def regression_batch(rank: int):
    """Rank ``rank``'s half of a fixed float64 regression batch (inputs 8 x 3, targets 8 x 2)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(8, 2, generator=gen, dtype=torch.float64)
    return x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]


def initial_linear():
    """The initial weight and bias of the 3 -> 2 linear model (float64)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, generator=gen, dtype=torch.float64), torch.randn(2, generator=gen, dtype=torch.float64)


def wsam_two_step_ddp(steps: int, max_norm):
    """ATorch README's two-step loop on a DDP model: the first backward under ``no_sync``, then
    ``first_step(zero_grad=True)``, the second backward (synchronised), ``second_step(zero_grad=True)``."""
    from torchloom.compat.atorch.optimizers import WeightedSAM

    rank = dist.get_rank()
    lin = torch.nn.Linear(3, 2).double()
    w, b = initial_linear()
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    model = torch.nn.parallel.DistributedDataParallel(lin)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = WeightedSAM(model, base, rho=0.2, gamma=0.8, max_norm=max_norm)
    x, y = regression_batch(rank)
    for _ in range(steps):
        with model.no_sync():
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.first_step(zero_grad=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.second_step(zero_grad=True)
    return [lin.weight.detach().clone(), lin.bias.detach().clone()]
