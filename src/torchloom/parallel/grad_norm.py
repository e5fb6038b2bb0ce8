"""Global gradient-norm clipping across every shard, replica, tensor and pipeline rank."""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def global_grad_norm(params: Iterable[torch.nn.Parameter], norm_type: float = 2.0,
                     extra_groups: Iterable[dist.ProcessGroup] = ()) -> torch.Tensor:
    """The norm of all gradients as if they were one unsharded vector (fp32 scalar on CPU).

    DTensor gradients (FSDP2 shards, tensor parallel) are reduced over their own mesh (``full_tensor`` of
    the Partial norm), grouped by mesh so mixed plain/DTensor lists work. Plain gradients are taken as
    replicated (DDP, ZeRO-1). Expert gradients count once too: under DDP they are DTensors on ``ep`` (equal
    across edp after ``ExpertGradReducer``), under FSDP on the ``(edp, ep)`` mesh; each is reduced over its
    own mesh (tests/distributed/test_expert_groups.py checks the sum against one process). ``extra_groups`` are groups holding *disjoint* parameters (pipeline stages):
    their partial norms are summed (``p``-th powers) or max-reduced (inf norm) there, so every rank ends up
    with the same number (torchtitan 596).
    """
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh[key].append(p.grad)
    inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float32)
    for mesh, grads in by_mesh.items():
        n = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=False)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        n = n.detach().float().cpu()
        total = torch.maximum(total, n) if inf else total + n**norm_type
    for group in extra_groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    return total if inf else total ** (1.0 / norm_type)


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0,
                    extra_groups: Iterable[dist.ProcessGroup] = ()) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm before
    clipping (same value on every rank)."""
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm(params, norm_type, extra_groups)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        g.mul_(coef.to(g.device, g.dtype))
    return total
