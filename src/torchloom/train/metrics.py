"""Training metrics: peak memory per rank, model FLOPs and MFU; the JSON-lines writer
(:class:`MetricsWriter`) now lives in :mod:`torchloom.tracking.jsonl` and is re-exported here.

Peak memory: on accelerators ``torch.<device>.max_memory_allocated()`` (reset each step); on CPU, where
that returns 0, the process's peak resident set size (``VmHWM`` in ``/proc/self/status``), reset each
step by writing ``5`` to ``/proc/self/clear_refs`` (if the kernel refuses, the value is the peak since
the process started, and ``peak_mem_source`` says ``rss_lifetime``).

MFU (model FLOPs utilisation, PaLM, Chowdhery et al. 2022, appendix B):
``flops_per_token = 6 * N + 12 * n_layers * hidden * seq_len`` with ``N`` the parameters that take part
in matmuls (all but the input embedding; for a Mixture-of-Experts model only the ``top_k`` experts a token
is routed to, :func:`active_params`), and ``mfu = flops_per_token * tokens_per_s / (peak_flops *
world_size)``. ``peak_flops`` is per rank: a short matmul benchmark on CPU (in the compute dtype, with the
threads this process has, run on every rank at once so shared cores are accounted for) or the datasheet
dense peak for known GPUs; ``peak_flops_source`` records which.
"""
from __future__ import annotations

import re
import time

import torch

# the JSON-lines writer is shared with the trackers (res.log, docs/hf.md); re-exported here for loom train
from torchloom.tracking.jsonl import MetricsWriter, read_metrics  # noqa: F401

# dense (no sparsity) peak FLOP/s per GPU: {name fragment: {dtype: flops}}; first match wins.
GPU_PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 66.9e12}),
    ("H100 PCIe", {"bfloat16": 756.0e12, "float16": 756.0e12, "float32": 51.2e12}),
    ("H100", {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 66.9e12}),
    ("GH200", {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 66.9e12}),
    ("A100", {"bfloat16": 312.0e12, "float16": 312.0e12, "float32": 19.5e12}),
    ("L40S", {"bfloat16": 362.05e12, "float16": 362.05e12, "float32": 91.6e12}),
    ("L4", {"bfloat16": 121.0e12, "float16": 121.0e12, "float32": 30.3e12}),
    ("V100", {"float16": 125.0e12, "float32": 15.7e12}),
]


# ---------------------------------------------------------------------------------------- memory
_STATUS = "/proc/self/status"


def _vm_hwm_bytes() -> int:
    try:
        with open(_STATUS) as f:
            m = re.search(r"^VmHWM:\s+(\d+)\s+kB", f.read(), re.M)
        return int(m.group(1)) * 1024 if m else 0
    except OSError:
        return 0


class PeakMemory:
    """Per-step peak memory of this process: ``reset()`` at a step's start, ``read()`` at its end."""

    def __init__(self, device: torch.device):
        self.device = device
        self.accel = getattr(torch, device.type, None) if device.type != "cpu" else None
        self.source = f"{device.type}_max_memory_allocated" if self.accel is not None else "rss"

    def reset(self) -> None:
        if self.accel is not None:
            self.accel.reset_peak_memory_stats(self.device)
            return
        if self.source == "rss":
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self.source = "rss_lifetime"

    def read(self) -> int:
        if self.accel is not None:
            return int(self.accel.max_memory_allocated(self.device))
        return _vm_hwm_bytes()


# ----------------------------------------------------------------------------------------- FLOPs
def matmul_params(model: torch.nn.Module) -> int:
    """Parameters used in matmuls: every parameter except input embeddings (a tied head is counted once,
    as the head). Call on the plain (unsharded) model."""
    seen: set[int] = set()
    emb: set[int] = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            emb.add(id(m.weight))
    out_emb = getattr(model, "get_output_embeddings", lambda: None)()
    head = id(out_emb.weight) if out_emb is not None and getattr(out_emb, "weight", None) is not None else None
    n = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in emb and id(p) != head:
            continue
        n += p.numel()
    return n


def active_params(model: torch.nn.Module, top_k: int) -> int:
    """Parameters one token passes through: all of them, except that of each experts module
    (:mod:`torchloom.moe.protocol`: fused ``[E, ...]`` parameters) only ``top_k`` of its ``E`` experts count.
    Call on the plain (unsharded) model. For a dense model the total."""
    from torchloom.moe.protocol import find_experts_modules

    total = sum(p.numel() for p in model.parameters())
    for _, m in find_experts_modules(model):
        e = m.num_experts
        total -= sum(p.numel() for p in m.parameters(recurse=False)) * (e - min(top_k, e)) // e
    return total


def expert_shares(counts: torch.Tensor) -> tuple[float | None, float | None]:
    """``(smallest, largest)`` share of a layer's routed assignments one expert received, over all layers
    (``counts``: tokens per expert, ``[layers, E]``); ``1 / E`` both when perfectly balanced, ``(None, None)``
    when nothing was routed."""
    counts = counts.to(torch.float64)
    totals = counts.sum(dim=-1, keepdim=True)
    used = totals.squeeze(-1) > 0
    if not bool(used.any()):
        return None, None
    shares = counts[used] / totals[used]
    return float(shares.min()), float(shares.max())


def flops_per_token(n_matmul_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM's estimate with the attention term."""
    return 6.0 * n_matmul_params + 12.0 * n_layers * hidden * seq_len


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024,
                         seconds: float = 0.3) -> float:
    """Best observed ``n x n`` matmul rate (FLOP/s) over a short run on ``device``."""
    a = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    sync = getattr(torch, device.type).synchronize if device.type != "cpu" else (lambda: None)
    for _ in range(2):
        a @ b
    sync()
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        sync()
        dt = time.perf_counter() - t
        best = max(best, 4 * 2 * n**3 / dt)
    return best


def peak_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """``(peak FLOP/s of one rank, source)``: datasheet for known GPUs, else a matmul benchmark."""
    dname = str(dtype).replace("torch.", "")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for frag, table in GPU_PEAK_FLOPS:
            if frag in name and dname in table:
                return table[dname], f"table:{name}:{dname}"
    flops = measure_matmul_flops(device, dtype)
    return flops, f"measured:{device.type}_matmul_{dname}_threads{torch.get_num_threads()}"
