"""DDP communication hooks: gradient compression that also works on gloo (CPU).

The stock ``bf16_compress_hook`` refuses any backend but NCCL (its own check). Here bf16 gradients
travel as raw bytes through ``all_gather`` and are summed in fp32 on arrival, then rounded to bf16: each
rank receives (world-1) compressed buckets, about world/2 times a ring all-reduce's traffic, fine at the
2-8 ranks a CPU job uses. On NCCL the stock hooks are used.
"""
# no `from __future__ import annotations`: DDP checks the hook's GradBucket annotation at runtime

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook


def _gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def bf16_compress_hook_gloo(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients in bf16 precision using all_gather of bf16 bytes (gloo-safe)."""
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    compressed = buf.to(torch.bfloat16)
    raw = compressed.view(torch.uint8)
    gathered = [torch.empty_like(raw) for _ in range(world)]
    fut = dist.all_gather(gathered, raw, group=group, async_op=True).get_future()

    def decompress(f):
        parts = f.value()[0] if isinstance(f.value(), list) and isinstance(f.value()[0], list) else gathered
        total = torch.zeros_like(buf, dtype=torch.float32)
        for part in parts:
            total += part.view(torch.bfloat16).float()
        # round the mean to bf16 like a bf16 all-reduce would, then back to the bucket dtype
        buf.copy_((total / world).to(torch.bfloat16).to(buf.dtype))
        return buf

    return fut.then(decompress)


def register_comm_hook(ddp_model: torch.nn.parallel.DistributedDataParallel, name: "str | None", group,
                       powersgd_rank: int = 1, powersgd_start_iter: int = 2) -> str | None:
    """Register hook ``name`` ("fp16" | "bf16" | "powersgd" | None) on a DDP model; return a note."""
    if name is None:
        return None
    if name == "fp16":
        ddp_model.register_comm_hook(group, default_hooks.fp16_compress_hook)
        return "ddp: fp16 gradient compression"
    if name == "bf16":
        if _gloo(group):
            ddp_model.register_comm_hook(group, bf16_compress_hook_gloo)
            return "ddp: bf16 gradient compression (gloo all_gather variant)"
        ddp_model.register_comm_hook(group, default_hooks.bf16_compress_hook)
        return "ddp: bf16 gradient compression"
    if name == "powersgd":
        # The batched variant (batched_powerSGD_hook) is broken on torch 2.13; the per-tensor one works.
        state = powerSGD_hook.PowerSGDState(
            process_group=group, matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=powersgd_start_iter, use_error_feedback=True, warm_start=True,
        )
        ddp_model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return f"ddp: PowerSGD (rank {powersgd_rank}, starting at iteration {powersgd_start_iter})"
    raise ValueError(f"unknown comm hook {name!r}")
