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
:func:`job_peak_flops` also records the machine load the benchmark ran under. A measured peak is taken again
(~0.1 s) at each evaluation and checkpoint and the highest kept (:meth:`MfuMeter.offer`): a benchmark only
ever reads low under load, so a low start is corrected as the run goes on; each record names the peak it
divides by. :class:`MfuMeter` never reports an MFU above 1: a peak measured under load, or a step that
achieves more than the peak (the peak read low), flags the records ``mfu_unreliable`` and an MFU that would
exceed 1 is omitted (``null``).
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
    from torchloom.cost.microbench import solo_matmul_rate

    return solo_matmul_rate(device, dtype, n or (1024 if device.type == "cpu" else 4096), seconds, samples=3)


PEAK_S = 0.3  # the job-start peak benchmark's duration
REMEASURE_S = 0.1  # each re-measurement during the run (at evaluations and checkpoints)


def peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, seconds: float = PEAK_S) -> tuple[float, str]:
    """``(peak FLOP/s of one rank, source)``: datasheet for known GPUs, else a matmul benchmark of ``seconds``."""
    dname = str(dtype).replace("torch.", "")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for frag, table in GPU_PEAK_FLOPS:
            if frag in name and dname in table:
                return table[dname], f"table:{name}:{dname}"
    flops = measure_matmul_flops(device, dtype, seconds=seconds)
    return flops, f"measured:{device.type}_matmul_{dname}_threads{torch.get_num_threads()}"


@dataclass
class PeakFlops:
    """The per-rank peak MFU divides by: ``flops`` (FLOP/s), ``source`` (``"table:<gpu>:<dtype>"`` or
    ``"measured:..."``) and, for a measured one, the machine ``load`` the benchmark ran under
    (:func:`torchloom.cost.load.assess`; empty for a datasheet peak)."""

    flops: float
    source: str
    load: dict[str, Any] = field(default_factory=dict)

    @property
    def under_load(self) -> bool:
        return bool(self.load.get("under_load"))

    @property
    def measured(self) -> bool:
        """A benchmark (worth re-measuring), not a datasheet value."""
        return not self.source.startswith("table:")

    def describe(self) -> str:
        """The job log's line: the peak, its source and, when measured, the load."""
        from torchloom.cost.load import describe

        text = f"peak {self.flops / 1e9:.1f} GFLOP/s per rank ({self.source})"
        if self.load:
            text += f"; while measured, {describe(self.load)}"
        if self.under_load:
            text += ": the peak reads low, so MFU reads high; train records are flagged mfu_unreliable"
        if self.measured:
            text += ("; re-measured at each evaluation and checkpoint during the run, the highest kept "
                     "(MFU divides by it from then on)")
        return text


def job_peak_flops(device: torch.device, dtype: torch.dtype, seconds: float = PEAK_S) -> PeakFlops:
    """The job's peak, measured by every rank at once for ``seconds`` (cores are shared) and the best rank's
    kept, with the load it ran under. Collective: every rank of the default group calls it. The training's
    random streams are left as found (the benchmark draws from its own generator)."""
    from torchloom.cost.load import LoadWindow, assess

    window = LoadWindow()
    state = torch.random.get_rng_state()
    flops, source = peak_flops(device, dtype, seconds)
    torch.random.set_rng_state(state)
    best = torch.tensor([flops], dtype=torch.float64)
    dist.all_reduce(best, op=dist.ReduceOp.MAX)
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, window.finish())
    load = {} if source.startswith("table:") else assess(rows, torch.get_num_threads())
    return PeakFlops(float(best.item()), source, load)


class MfuMeter:
    """MFU of the logged steps against the highest measured :class:`PeakFlops`, never above 1.

    The peak is measured at job start (``step``: the step the run starts from) and may be offered again later
    (:meth:`offer`, at evaluations and checkpoints): the highest is kept, since load only ever makes a
    benchmark read low, so a peak read low at start is raised (and MFU lowered) as the run goes on.

    :meth:`record` takes the model FLOP/s one rank achieved (``flops_per_token * tokens_per_s / world``)
    and returns the record's fields: ``mfu`` (achieved / peak in effect; ``None`` where that exceeds 1),
    ``mfu_unreliable`` (the peak in effect was measured under load, or some step so far achieved more than
    it), ``peak_flops``/``peak_flops_source``/``peak_flops_step`` (the peak this record divides by and the
    step it was measured at) and, on the first record that divides by a peak, ``peak_flops_load`` (the load
    it was measured under: :func:`torchloom.cost.load.compact`). :attr:`note` holds lines to log (a step
    above the peak, a raised peak; :meth:`take_note` clears them); :meth:`summary` gives the run's figures.
    """

    def __init__(self, peak: PeakFlops, step: int = 0):
        self.peak, self.step = peak, int(step)
        self.measurements = [self._measurement(peak, step)]
        self.achieved: list[float] = []
        self.notes: list[str] = []
        self._announced = False  # the first record dividing by the peak in effect carries its load

    @staticmethod
    def _measurement(peak: PeakFlops, step: int) -> dict[str, Any]:
        return {"step": int(step), "flops": peak.flops, "stolen_fraction": peak.load.get("stolen_fraction"),
                "under_load": peak.under_load}

    @property
    def note(self) -> str:
        return "; ".join(self.notes)

    def take_note(self) -> str:
        note, self.notes = self.note, []
        return note

    def offer(self, peak: PeakFlops, step: int) -> bool:
        """A re-measurement of the peak at ``step``: kept (and returned True, with a note) when higher than
        the peak in effect; every measurement is listed in :meth:`summary`."""
        self.measurements.append(self._measurement(peak, step))
        if peak.flops <= self.peak.flops:
            return False
        self.notes.append(f"peak re-measured at step {step}: {peak.flops / 1e9:.1f} GFLOP/s per rank, above the "
                          f"{self.peak.flops / 1e9:.1f} measured at step {self.step} (that one read low); MFU "
                          f"divides by it from step {step + 1} (peak_flops_step {step})")
        self.peak, self.step, self._announced = peak, int(step), False
        return True

    def _reason(self) -> str:
        from torchloom.cost.load import describe

        top = max(self.achieved, default=0.0)
        if top > self.peak.flops:
            return (f"a step achieved {top / 1e9:.1f} GFLOP/s of model FLOPs per rank, above the peak "
                    f"{self.peak.flops / 1e9:.1f} ({self.peak.source}, step {self.step})")
        if self.peak.under_load:
            return f"the peak was measured under load at step {self.step} ({describe(self.peak.load)})"
        return ""

    def record(self, achieved_flops_per_rank: float) -> dict[str, Any]:
        """The MFU fields of one train record (see the class docstring)."""
        before = max(self.achieved, default=0.0)
        self.achieved.append(float(achieved_flops_per_rank))
        mfu = achieved_flops_per_rank / self.peak.flops if self.peak.flops > 0 else None
        if mfu is not None and mfu > 1.0:
            if before <= self.peak.flops:  # the first step above this peak: say so once
                self.notes.append(f"MFU unreliable: {self._reason()}: the peak was measured low (machine busy while "
                                  "it was measured?); MFU is omitted (null) where it would exceed 1 and records are "
                                  "flagged mfu_unreliable until a re-measured peak exceeds every step")
            mfu = None
        out = {"mfu": mfu, "mfu_unreliable": bool(self._reason()), "peak_flops": self.peak.flops,
               "peak_flops_source": self.peak.source, "peak_flops_step": self.step}
        if not self._announced:
            from torchloom.cost.load import compact

            out["peak_flops_load"] = compact(self.peak.load)
            self._announced = True
        return out

    def summary(self) -> dict[str, Any]:
        """``mfu``: the mean achieved model FLOP/s per rank over the run's records divided by the final (highest)
        peak (None when no record, or when a step exceeded that peak), ``mfu_unreliable``,
        ``mfu_unreliable_reason``, and ``mfu_peak``: the peak divided by (``flops``, ``source``, ``step``,
        ``load``) and every measurement (``step``, ``flops``, ``stolen_fraction``, ``under_load``)."""
        from torchloom.cost.load import compact

        reason = self._reason()
        exceeded = max(self.achieved, default=0.0) > self.peak.flops
        mean = (sum(self.achieved) / len(self.achieved) / self.peak.flops
                if self.achieved and self.peak.flops > 0 and not exceeded else None)
        return {"mfu": mean, "mfu_unreliable": bool(reason), "mfu_unreliable_reason": reason,
                "mfu_peak": {"flops": self.peak.flops, "source": self.peak.source, "step": self.step,
                             "load": compact(self.peak.load), "measurements": list(self.measurements)}}
