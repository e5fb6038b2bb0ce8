"""Megatron's two tensor-parallel region operators (Shoeybi et al. 2019, section 3), written with DTensor
so the collectives and their autograd come from PyTorch.

``enter_tp_region``  (Megatron's *f*): identity forward, all-reduce of the gradient in backward.
``leave_tp_region``  (Megatron's *g*): all-reduce forward (partial sums -> full), identity backward.

Modules that compute on local shards (fused q/k/v projections, stacked MoE experts) wrap their inputs in
the first and their partial outputs in the second, exactly like a column-wise/row-wise pair.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate


def enter_tp_region(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """A replicated activation entering local computation: the same values forward; in backward the
    per-rank partial gradients are summed over ``mesh`` (every rank computed with its own shard).

    Args:
        x: plain tensor replicated on the tp ranks, or a DTensor (redistributed to Replicate first).

    Returns:
        plain tensor of the full (replicated) shape.
    """
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    elif x.placements != (Replicate(),):
        x = x.redistribute(mesh, [Replicate()])
    return x.to_local(grad_placements=[Partial()])


def leave_tp_region(partial_sum: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum per-rank partial results over ``mesh`` (forward all-reduce); the gradient passes unchanged.

    Args:
        partial_sum: plain tensor holding this rank's contribution.

    Returns:
        plain tensor, the sum over the tp ranks (same on every rank).
    """
    total = DTensor.from_local(partial_sum, mesh, [Partial()], run_check=False)
    return total.redistribute(mesh, [Replicate()]).to_local()
