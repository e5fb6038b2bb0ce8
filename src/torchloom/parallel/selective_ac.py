"""Selective activation checkpointing: inside a checkpointed block, keep the outputs of the expensive ops
and recompute only the cheap ones (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022; torchtitan's ``op`` policy in ``torchtitan/models/llama3/infra/parallelize.py``:
save the output of every attention kernel and of every other matrix multiply, recompute the rest).

Used through ``torch.utils.checkpoint.checkpoint(..., context_fn=selective_context)``.
"""
from __future__ import annotations

import functools
from collections import defaultdict

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def _ops(*names: str) -> set:
    out = set()
    for n in names:
        op, _, overload = n.partition(".")
        packet = getattr(torch.ops.aten, op, None)
        if packet is not None and hasattr(packet, overload or "default"):
            out.add(getattr(packet, overload or "default"))
    return out


#: matrix multiplies whose outputs are saved (every other one: the odd-numbered)
MATMULS = _ops("mm.default", "addmm.default")
#: attention kernels whose outputs are always saved
ATTENTION = _ops("_scaled_dot_product_flash_attention.default", "_scaled_dot_product_efficient_attention.default",
                 "_scaled_dot_product_cudnn_attention.default", "_scaled_dot_product_flash_attention_for_cpu.default")


def _policy(counts, ctx, func, *args, **kwargs):
    """Save every attention output and the 1st, 3rd, ... matmul output of the block (counted separately for
    the forward and for the recomputation, so both make the same choices); recompute everything else."""
    if func in ATTENTION:
        return CheckpointPolicy.MUST_SAVE
    if func in MATMULS:
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] += 1
        return CheckpointPolicy.MUST_SAVE if counts[key] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """A fresh ``(forward, recompute)`` context pair for one checkpointed call (``context_fn``)."""
    return create_selective_checkpoint_contexts(functools.partial(_policy, defaultdict(int)))
