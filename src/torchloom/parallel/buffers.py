"""Keep the running statistics of normalisation layers (BatchNorm) identical on every data-parallel rank.

Each rank's forward updates ``running_mean``/``running_var`` from its own micro-batch, so without a sync
the ranks drift apart and evaluation depends on the rank (pytorch/pytorch PR 178569). FSDP never syncs
buffers; DDP's ``broadcast_buffers`` copies rank 0's before each forward, which discards the other ranks'
statistics and, under ``torch.no_grad`` evaluation, does not run at all.

torchloom averages them instead: after every optimizer step the floating-point running statistics are
all-reduced (mean) over the data-parallel group (for HSDP the flattened replicate x shard group: buffers are
never sharded) and ``num_batches_tracked`` takes the maximum. The result is exactly "each rank updates the
statistics from its data, then the updates are averaged" — the usual data-parallel BatchNorm semantics
(timm ``distribute_bn``), which a single process can reproduce. ``SyncBatchNorm`` layers are skipped: their
statistics are global already.

The sync is an optimizer step post-hook, so it also runs in a hand-written loop that calls
``res.optimizer.step()``. A step skipped for fp16 overflow does not step the optimizer: its statistics are
averaged at the next step. Before evaluating without a step, call ``sync_buffers(res.model,
res.mesh.group("dp"))`` on every rank. Turn it off with ``sync_buffers=False`` in ``fsdp``/``ddp``; for
``ddp`` that brings back DDP's own ``broadcast_buffers``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch import nn


def running_stat_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of every running statistic that training updates per rank: the buffers of
    normalisation layers with ``track_running_stats=True`` (BatchNorm*, tracked InstanceNorm*), except
    ``SyncBatchNorm``."""
    out = []
    for qual, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._NormBase) and not isinstance(mod, nn.SyncBatchNorm) \
                and mod.track_running_stats:
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                buf = getattr(mod, name, None)
                if isinstance(buf, torch.Tensor):
                    out.append((f"{qual}.{name}" if qual else name, buf))
    return out


@torch.no_grad()
def sync_buffers(model_or_buffers: nn.Module | list[torch.Tensor], group: dist.ProcessGroup | None = None) -> int:
    """Average floating-point buffers over ``group`` (default: the world) in place; integer buffers
    (``num_batches_tracked``) take the group maximum. Collective: call on every rank of ``group``.

    Args:
        model_or_buffers: a model (its :func:`running_stat_buffers`) or an explicit list of buffers.
        group: the data-parallel process group.

    Returns:
        The number of buffers synchronised (0 without a process group or with one rank).
    """
    if isinstance(model_or_buffers, nn.Module):
        buffers = [b for _, b in running_stat_buffers(model_or_buffers)]
    else:
        buffers = list(model_or_buffers)
    if not buffers or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0
    world = dist.get_world_size(group)
    floats = [b for b in buffers if b.is_floating_point()]
    ints = [b for b in buffers if not b.is_floating_point()]
    for tensors, op in ((floats, dist.ReduceOp.SUM), (ints, dist.ReduceOp.MAX)):
        if not tensors:
            continue
        # one collective per dtype: flatten (in fp64 for the sum, so the mean rounds once)
        dtype = torch.float64 if op == dist.ReduceOp.SUM else torch.int64
        flat = torch.cat([t.detach().reshape(-1).to("cpu" if _gloo(group) else t.device, dtype) for t in tensors])
        dist.all_reduce(flat, op=op, group=group)
        if op == dist.ReduceOp.SUM:
            flat /= world
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n
    return len(buffers)


def install_buffer_sync(ctx, method: str) -> None:
    """Register, after the optimizer exists, a step post-hook that runs :func:`sync_buffers` over the
    data-parallel group (only when the model has running statistics and dp > 1). Notes what it did."""
    n = sum(len(running_stat_buffers(part)) for part in ctx.model_parts)
    if ctx.mesh.dp_size == 1 or not n:
        return
    group = ctx.mesh.group("dp")

    def register(c) -> None:
        parts = c.model_parts  # final (wrapped, materialised) modules; buffers are looked up at each step
        # because moving or materialising a model replaces its buffer tensors

        def hook(opt, args, kwargs) -> None:
            for part in parts:
                sync_buffers(part, group)

        c.optimizer.register_step_post_hook(hook)

    ctx.post_optimizer.append(register)
    ctx.note(f"{method}: {n} running-statistic buffers averaged over dp={ctx.mesh.dp_size} after every optimizer step")


def _gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def broadcast_module_states(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Copy every parameter and buffer of ``model`` from the group's first rank to the others (in place,
    before sharding or wrapping), so all ranks start from one model."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            # tensor-parallel DTensors: each dp peer holds the same shard; broadcast the local shard
            t = t.to_local() if isinstance(t, DTensor) else t.data
            dist.broadcast(t, group=group, group_src=0)
