"""What the planner knows about the machines: achieved compute, memory bandwidth and collective costs.

A :class:`Hardware` comes either from calibration on this machine (:func:`torchloom.cost.calibrate.
local_hardware`, cached per machine fingerprint) or from the built-in accelerator table
(:func:`torchloom.cost.accelerators.cluster`), and is read by the methods' ``estimate`` hooks and the cost
model through the query methods below, never by poking at the raw fits.

Units: seconds, bytes, FLOP/s, bytes/s.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field
from typing import Any

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")


@dataclass
class CollectiveFit:
    """Measured time of one collective kind for one group size: ``points`` are ``(bytes, seconds)`` pairs
    sorted by size (bytes = the per-rank message: the tensor all-reduced, the *output* of an all-gather, the
    *input* of a reduce-scatter, the tensor sent). Between points time is interpolated linearly in bytes;
    beyond the largest, extrapolated with the last segment's bandwidth; below the smallest, the smallest
    point's time (latency floor)."""

    points: list[tuple[float, float]] = field(default_factory=list)

    def time(self, nbytes: float) -> float:
        pts = self.points
        if not pts or nbytes <= 0:
            return 0.0
        if nbytes <= pts[0][0]:
            return pts[0][1]
        xs = [p[0] for p in pts]
        i = bisect.bisect_left(xs, nbytes)
        if i >= len(pts):
            (x0, t0), (x1, t1) = pts[-2] if len(pts) > 1 else (0.0, 0.0), pts[-1]
            slope = (t1 - t0) / (x1 - x0) if x1 > x0 else 0.0
            return t1 + slope * (nbytes - x1)
        (x0, t0), (x1, t1) = pts[i - 1], pts[i]
        return t0 + (t1 - t0) * (nbytes - x0) / (x1 - x0)


@dataclass
class Hardware:
    """One kind of device and how a job of ``ranks_per_node`` processes per node performs on it.

    Attributes:
        name: ``"local-cpu"``, ``"h100-sxm"``, ...
        device_type: ``"cpu"`` / ``"cuda"``.
        memory_bytes: usable memory per rank (GPU memory; on CPU: host RAM / ranks per node).
        ranks_per_node / num_nodes: the job layout the compute and collective numbers hold for.
        matmul_flops: achieved dense matmul FLOP/s per rank by dtype name, as ``(gemm_flops, flop_per_s)``
            points by GEMM size (FLOPs of one GEMM) — small GEMMs reach less. Measured **with all
            ``ranks_per_node`` ranks computing at once** (co-located ranks share cores).
        backward_gemm_factor: by dtype, the backward's weight GEMMs' time against the forward layout's at the
            same FLOPs (input gradient ``dY @ W`` and weight gradient ``dY^T @ X`` vs ``X @ W^T``); absent: 1.
            Measured: ~1 for fp32 and on GPUs, ~3 for bf16 on CPUs without native bf16.
        peak_flops: datasheet (or measured-maximum on CPU) dense FLOP/s per rank by dtype (what MFU divides by).
        mem_bw: achieved memory bandwidth per rank in bytes/s (all ranks streaming at once).
        op_overhead_s: fixed cost per dispatched op (eager-mode launch/dispatch), seconds: a bare loop of tiny
            ops (what compiled code and library kernels pay per launch).
        eager_op_overhead_s: host seconds per counted op inside eager model code, by code style
            (``{"modules": ..., "transformers": ...}``: module calls, autograd recording and its backward
            node, the model's Python between ops; :mod:`torchloom.cost.eager_overhead`); empty: unknown, the
            cost model uses ``op_overhead_s``.
        optimizer_tensor_s: host seconds per parameter tensor of gradient clipping + an AdamW step (the device's
            default implementation: a per-tensor loop on CPU, multi-tensor kernels on CUDA); 0: unknown (not
            priced).
        optimizer_dtensor_s: the same per DTensor parameter (FSDP2 shards, tensor-parallel weights: DTensor
            dispatch of every optimizer op and the norm's reduction); 0: unknown, ``optimizer_tensor_s`` is used.
        fsdp_unit_s / fsdp_tensor_s / fsdp_unit_reduce_s: FSDP2's own host seconds beside its collectives
            per ``fully_shard`` unit and per parameter tensor of a unit for the forward + backward of a
            micro-batch, and extra per unit when that backward reduces the gradients (hooks, flat-buffer copies,
            DTensor views, waits; :func:`~torchloom.cost.eager_overhead.fsdp_unit_seconds`); 0: unknown (the
            FSDP estimate then assumes a dozen bare dispatches per unit).
        train_step_call_s: seconds per micro-batch of torchloom's ``TrainStep`` around the model (input
            preparation, loss bookkeeping and its dp all-reduce, accumulation scaling, zeroing; measured against
            the same work run bare: :func:`~torchloom.cost.eager_overhead.train_step_seconds`); 0: unknown.
        optimizer_element_s: seconds per parameter element of the same step by tensor size, ``[(elements per
            tensor, s)]``, all ranks at once (what the default implementation's passes over memory cost, from
            cache for small tensors); empty: unknown, the cost model prices a fused Adam's traffic at ``mem_bw``.
        intra: collective fits inside a node, ``{kind: {group_size: CollectiveFit}}``.
        inter_bw / inter_latency_s: per-rank bandwidth (bytes/s) and latency across nodes (ring model).
        fingerprint: what identifies the machine (CPU/GPU model, cores, torch version, backend): plans and
            calibrations are keyed by it.
        sources: where each value came from (datasheet URL or "measured <date>").
        threads_per_rank: intra-op threads each rank computed with when measured (0 = not applicable:
            a table entry for a GPU).
        load: the machine load a calibration ran under (:func:`torchloom.cost.load.assess`'s record, plus
            ``probe_flops``/``probe_workers``/``probe_version``: the re-check probe then, run in the
            calibration's layout); empty for a table entry.
        provisional: measured under load (``load["under_load"]``): the rates may read low, so it is re-measured
            at its first use on a quiet machine and it never replaces a quiet calibration in the cache.
        attention_flops: achieved FLOP/s per rank of the fused attention kernel by dtype, ``[forward,
            backward]`` (of the FLOPs it computes: causal tiles, backward's recomputed scores included); empty
            where attention is priced as its GEMMs at :meth:`matmul_rate` (a calibrated CPU).
        attention_kernel: the kernel those rates are for (``"flash2"``, ``"flash3"``), or ``""``.
    """

    name: str
    device_type: str
    memory_bytes: float
    ranks_per_node: int = 1
    num_nodes: int = 1
    matmul_flops: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    peak_flops: dict[str, float] = field(default_factory=dict)
    mem_bw: float = 0.0
    op_overhead_s: float = 0.0
    eager_op_overhead_s: dict[str, float] = field(default_factory=dict)
    optimizer_tensor_s: float = 0.0
    optimizer_dtensor_s: float = 0.0
    fsdp_unit_s: float = 0.0
    fsdp_tensor_s: float = 0.0
    fsdp_unit_reduce_s: float = 0.0
    train_step_call_s: float = 0.0
    optimizer_element_s: list[tuple[float, float]] = field(default_factory=list)
    intra: dict[str, dict[int, CollectiveFit]] = field(default_factory=dict)
    inter_bw: float = 0.0
    inter_latency_s: float = 0.0
    fingerprint: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    threads_per_rank: int = 0
    load: dict[str, Any] = field(default_factory=dict)
    provisional: bool = False
    attention_flops: dict[str, list[float]] = field(default_factory=dict)
    attention_kernel: str = ""
    backward_gemm_factor: dict[str, float] = field(default_factory=dict)

    # -- queries used by the cost model -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.num_nodes

    def matmul_rate(self, dtype: str, gemm_flops: float) -> float:
        """Achieved FLOP/s per rank for one GEMM of ``gemm_flops`` FLOPs in ``dtype`` (log-linear
        interpolation between calibrated sizes; fp32 numbers are used for a dtype never measured)."""
        pts = self.matmul_flops.get(dtype) or self.matmul_flops.get("float32") or []
        if not pts:
            raise ValueError(f"hardware '{self.name}' has no matmul calibration for {dtype}.")
        return _log_interp(pts, gemm_flops)

    def attention_rate(self, dtype: str, backward: bool) -> float | None:
        """Achieved FLOP/s of the attention kernel's forward or backward in ``dtype``, or None when attention is
        priced as GEMMs (no entry)."""
        r = self.attention_flops.get(dtype)
        return r[1 if backward else 0] if r else None

    def optimizer_element_rate(self, elements_per_tensor: float) -> float:
        """Seconds per element of the optimizer step for tensors of ``elements_per_tensor`` (log-linear between
        the measured sizes, the end values beyond them); 0 without a measurement."""
        return _log_interp(self.optimizer_element_s, elements_per_tensor) if self.optimizer_element_s else 0.0

    def host_op_seconds(self, eager_code: str | None) -> float:
        """Host seconds per counted op of an eager pass of ``eager_code`` style (``ModelInfo.eager_code``), else
        (None: a compiled pass; no measurement for the style) the bare dispatch cost ``op_overhead_s``."""
        if eager_code is not None:
            v = self.eager_op_overhead_s.get(eager_code)
            if v:
                return v
        return self.op_overhead_s

    @property
    def async_launch(self) -> bool:
        """Kernels launch asynchronously (CUDA streams): the host's per-op dispatch overlaps the device's work,
        so a pass costs the longer of the two, not their sum (CUDA C Programming Guide, "Asynchronous
        Concurrent Execution"). On CPU the dispatching thread runs the kernels itself: the sum."""
        return self.device_type == "cuda"

    def collective_time(self, kind: str, nbytes: float, group_size: int, *, spans_nodes: bool = False) -> float:
        """Seconds for one ``kind`` collective of ``nbytes`` per rank over ``group_size`` ranks.

        Inside a node: the calibrated fit for that group size (the nearest measured size, scaled by the ring
        factor ``(g-1)/g`` when the exact size was not measured). Across nodes (``spans_nodes``): the ring
        model with ``inter_bw`` and ``inter_latency_s``.

        Raises:
            ValueError: an unknown collective kind.
        """
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}; one of {COLLECTIVES}.")
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        if spans_nodes and self.inter_bw > 0:
            return _ring_time(kind, nbytes, group_size, self.inter_bw, self.inter_latency_s)
        fits = self.intra.get(kind) or {}
        if group_size in fits:
            return fits[group_size].time(nbytes)
        if not fits:
            raise ValueError(f"hardware '{self.name}' has no calibration for {kind}.")
        near = min(fits, key=lambda g: abs(g - group_size))
        scale = _ring_factor(kind, group_size) / max(_ring_factor(kind, near), 1e-9)
        return fits[near].time(nbytes) * scale

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["intra"] = {k: {str(g): f["points"] for g, f in v.items()} for k, v in d["intra"].items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Hardware":
        d = dict(d)
        d["intra"] = {k: {int(g): CollectiveFit([tuple(p) for p in pts]) for g, pts in v.items()}
                      for k, v in (d.get("intra") or {}).items()}
        d["matmul_flops"] = {k: [tuple(p) for p in v] for k, v in (d.get("matmul_flops") or {}).items()}
        d["optimizer_element_s"] = [tuple(p) for p in d.get("optimizer_element_s") or ()]
        for k in _HOST_SECONDS:  # a bad value in a hand-edited or torn cache: ValueError (the cache re-measures)
            v = d.get(k, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"hardware field {k} must be a finite number >= 0 (seconds), got {v!r}")
        factors = d.get("backward_gemm_factor") or {}
        if not isinstance(factors, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                for v in factors.values()):
            raise ValueError(f"hardware field backward_gemm_factor must map dtypes to numbers > 0, got {factors!r}")
        return cls(**d)


#: calibrated host seconds that must be finite and >= 0 (0 = not measured)
_HOST_SECONDS = ("optimizer_tensor_s", "optimizer_dtensor_s", "fsdp_unit_s", "fsdp_tensor_s", "fsdp_unit_reduce_s",
                 "train_step_call_s")


def _log_interp(pts, x: float) -> float:
    """The value at ``x`` of sorted ``(size, value)`` points: linear in ``log(size)`` between them, the end values
    beyond them."""
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    xs = [math.log(p[0]) for p in pts]
    i = bisect.bisect_left(xs, math.log(x))
    (x0, r0), (x1, r1) = (xs[i - 1], pts[i - 1][1]), (xs[i], pts[i][1])
    return r0 + (r1 - r0) * (math.log(x) - x0) / (x1 - x0)


def _ring_factor(kind: str, g: int) -> float:
    if kind == "all_reduce":
        return 2.0 * (g - 1) / g
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (g - 1) / g
    return 1.0


def _ring_time(kind: str, nbytes: float, g: int, bw: float, latency: float) -> float:
    """Bandwidth-optimal ring: all-reduce moves 2(g-1)/g of the bytes per rank, all-gather/reduce-scatter
    (g-1)/g of the full tensor (Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
    operations in MPICH"); ``2(g-1)`` (all-reduce) or ``g-1`` latency steps."""
    steps = 2 * (g - 1) if kind == "all_reduce" else (1 if kind in ("send_recv", "broadcast") else g - 1)
    return steps * latency + _ring_factor(kind, g) * nbytes / bw
