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
threads this process has, run on every rank at once so shared cores are accounted for; best of >= 3 timings,
the best rank kept) or the datasheet dense peak for known GPUs; ``peak_flops_source`` records which.
:func:`job_peak_flops` also records the machine load the benchmark ran under, and :class:`MfuMeter` never
reports an MFU above 1: a benchmark under load, or a step that achieves more than the peak (the peak read
low), flags the records ``mfu_unreliable`` and an MFU that would exceed 1 is omitted (``null``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

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


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int | None = None,
                         seconds: float = 0.3) -> float:
    """Best observed ``n x n`` matmul rate (FLOP/s) on ``device``: single calls timed for ``seconds`` and at
    least 3 times, the fastest wins (a timing disturbed by another process never sets the rate).
    ``n``: 1024 on CPU, 4096 on a GPU (a smaller GEMM there measures the launch, not the math)."""
    from torchloom.search.microbench import solo_matmul_rate

    return solo_matmul_rate(device, dtype, n or (1024 if device.type == "cpu" else 4096), seconds, samples=3)


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


@dataclass
class PeakFlops:
    """The per-rank peak MFU divides by: ``flops`` (FLOP/s), ``source`` (``"table:<gpu>:<dtype>"`` or
    ``"measured:..."``) and, for a measured one, the machine ``load`` the benchmark ran under
    (:func:`torchloom.search.load.assess`; empty for a datasheet peak)."""

    flops: float
    source: str
    load: dict[str, Any] = field(default_factory=dict)

    @property
    def under_load(self) -> bool:
        return bool(self.load.get("under_load"))

    def describe(self) -> str:
        """The job log's line: the peak, its source and, when measured, the load."""
        from torchloom.search.load import describe

        text = f"peak {self.flops / 1e9:.1f} GFLOP/s per rank ({self.source})"
        if self.load:
            text += f"; while measured, {describe(self.load)}"
        if self.under_load:
            text += ": the peak reads low, so MFU reads high; train records are flagged mfu_unreliable"
        return text


def job_peak_flops(device: torch.device, dtype: torch.dtype) -> PeakFlops:
    """The job's peak, measured by every rank at once (cores are shared) and the best rank's kept, with the
    load it ran under. Collective: every rank of the default group calls it. The global RNG is left as found
    (the benchmark's random matrices must not shift the training's random stream)."""
    from torchloom.search.load import LoadWindow, assess

    window = LoadWindow()
    state = torch.random.get_rng_state()
    flops, source = peak_flops(device, dtype)
    torch.random.set_rng_state(state)
    best = torch.tensor([flops], dtype=torch.float64)
    dist.all_reduce(best, op=dist.ReduceOp.MAX)
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, window.finish())
    load = {} if source.startswith("table:") else assess(rows, torch.get_num_threads())
    return PeakFlops(float(best.item()), source, load)


class MfuMeter:
    """MFU of the logged steps against one :class:`PeakFlops`, never above 1.

    :meth:`record` takes the model FLOP/s one rank achieved (``flops_per_token * tokens_per_s / world``)
    and returns the record's fields: ``mfu`` (achieved / peak; ``None`` where that exceeds 1) and
    ``mfu_unreliable`` (the peak was measured under load, or some step achieved more than the peak: from
    then on every record, since the peak is known to read low). :attr:`note` holds one line to log the
    first time a step exceeds the peak (:meth:`take_note` clears it); :meth:`summary` gives the run's mean.
    """

    def __init__(self, peak: PeakFlops):
        self.peak = peak
        self.reason = "the peak was measured under load" if peak.under_load else ""
        self.values: list[float] = []
        self.note = ""
        self.exceeded = False

    def record(self, achieved_flops_per_rank: float) -> dict[str, Any]:
        mfu = achieved_flops_per_rank / self.peak.flops if self.peak.flops > 0 else None
        if mfu is not None and mfu > 1.0:
            if not self.exceeded:
                self.exceeded = True
                self.reason = (f"a step achieved {achieved_flops_per_rank / 1e9:.1f} GFLOP/s of model FLOPs per rank, "
                               f"above the peak {self.peak.flops / 1e9:.1f} ({self.peak.source})")
                self.note = (f"MFU unreliable: {self.reason}: the peak was measured low (machine busy while it "
                             "was measured?); MFU is omitted (null) where it would exceed 1 and every record "
                             "from here on is flagged mfu_unreliable")
            mfu = None
        if mfu is not None:
            self.values.append(mfu)
        return {"mfu": mfu, "mfu_unreliable": bool(self.reason)}

    def take_note(self) -> str:
        note, self.note = self.note, ""
        return note

    def summary(self) -> dict[str, Any]:
        """``mfu``: the mean of the reported values (None when none was, or when a step exceeded the peak:
        the omitted steps would bias it), ``mfu_unreliable`` and ``mfu_unreliable_reason``."""
        mean = sum(self.values) / len(self.values) if self.values and not self.exceeded else None
        return {"mfu": mean, "mfu_unreliable": bool(self.reason), "mfu_unreliable_reason": self.reason}
