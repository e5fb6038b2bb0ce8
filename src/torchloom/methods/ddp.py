"""`ddp`: DistributedDataParallel over the data-parallel mesh dimension."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.nn.parallel import DistributedDataParallel

from ..parallel.buffers import install_buffer_sync, running_stat_buffers
from ..parallel.comm_hooks import register_comm_hook
from ..strategy.registry import Method, Stage, register_method


@dataclass
class DDPConfig:
    """DDP options (see ``torch.nn.parallel.DistributedDataParallel``); sizes in MiB.

    sync_buffers: average the running statistics of BatchNorm-like layers over the data-parallel ranks after
        every optimizer step (``torchloom.parallel.buffers``), so evaluation is the same on every rank.
    broadcast_buffers: DDP's copy of rank 0's buffers before each forward. None (default) = off when
        ``sync_buffers`` averages running statistics (rank 0's copy would discard the other ranks'), else on.
    """

    bucket_cap_mb: float = 25.0
    static_graph: bool = False
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    broadcast_buffers: bool | None = None
    sync_buffers: bool = True
    comm_hook: Literal["fp16", "bf16", "powersgd"] | None = None
    powersgd_rank: int = 1
    powersgd_start_iter: int = 2


@register_method
class DDP(Method):
    """Data parallel with gradient all-reduce (Li et al., "PyTorch Distributed", VLDB 2020).

    Gradients are averaged over ``dp_replicate x dp_shard`` (the flattened ``dp`` mesh); tensor/pipeline
    peers are excluded. Optional gradient compression hooks: fp16, bf16 (gloo-safe), PowerSGD
    (Vogels et al., NeurIPS 2019).
    """

    name = "ddp"
    aliases = {"data_parallel": {}}
    Config = DDPConfig
    stage = Stage.DATA_PARALLEL
    data_parallel = True
    mesh_dims = ("dp_replicate", "dp_shard")
    conflicts = {"fsdp": "both own gradient synchronisation for data parallelism; fsdp already averages "
                         "gradients (and shards them). Use one."}

    def configure(self, ctx) -> None:
        ctx.data_parallel = self.name

    def apply(self, ctx) -> None:
        c = self.config
        group = ctx.mesh.group("dp")
        dev = ctx.device
        averaged = c.sync_buffers and any(running_stat_buffers(p) for p in ctx.model_parts)
        broadcast = (not averaged) if c.broadcast_buffers is None else c.broadcast_buffers
        notes = []

        def wrap(module):
            model = DistributedDataParallel(
                module,
                device_ids=[dev.index] if dev.type != "cpu" and dev.index is not None else None,
                process_group=group,
                bucket_cap_mb=c.bucket_cap_mb,
                static_graph=c.static_graph,
                find_unused_parameters=c.find_unused_parameters,
                gradient_as_bucket_view=c.gradient_as_bucket_view,
                **_buffer_sync_kwargs(broadcast),
            )
            notes.append(register_comm_hook(model, c.comm_hook, group, c.powersgd_rank, c.powersgd_start_iter))
            return model

        ctx.map_parts(wrap)
        note = notes[0] if notes else ""
        ctx.note(f"ddp: DistributedDataParallel over dp={ctx.mesh.dp_size}" + (f"; {note}" if note else ""))
        if c.sync_buffers:
            install_buffer_sync(ctx, "ddp")


def _buffer_sync_kwargs(sync: bool) -> dict:
    """``broadcast_buffers`` is deprecated in newer torch in favour of ``forward_sync_buffers``."""
    import inspect

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params and sync:
        return {"forward_sync_buffers": True}
    return {"broadcast_buffers": sync}
