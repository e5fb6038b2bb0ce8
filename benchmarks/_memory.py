"""Per-process memory readings on CPU (``torch.cuda.max_memory_allocated`` is 0 there)."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def rss_bytes(field: str = "VmHWM") -> int:
    """Peak (VmHWM) or current (VmRSS) resident set size in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (local shards only)."""
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    opt = 0
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard in .optim
    for state in inner.state.values():
        opt += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"param_bytes": params, "grad_bytes": grads, "optim_bytes": opt}
