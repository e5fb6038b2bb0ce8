"""Built-in accelerator table, for planning on hardware we do not have (``loom plan --gpu h100 ...``).

Each :class:`Accelerator` holds datasheet numbers — **dense** (not 2:4-sparse) peak FLOP/s per dtype, memory
size and HBM bandwidth, the intra-node link bandwidth per GPU (unidirectional) and a typical inter-node
bandwidth per GPU — with the datasheet URL of every value in ``sources``. :func:`cluster` turns one into a
:class:`~torchloom.cost.hardware.Hardware` through the efficiency assumptions below; each is a named
constant with where it comes from. None was fitted to torchtitan's published Llama rows (they are the
held-out check of ``benchmarks/search_accuracy.py``).

Memory sizes: HBM is sold in binary gigabytes (stacks of 16 or 24 GiB), so "80 GB" is taken as 80 GiB;
torch reports slightly less (the driver keeps a few hundred MiB), which the cost model's headroom covers.
Link and network bandwidths are decimal (1 GB/s = 1e9 B/s; 400 Gb/s = 50e9 B/s).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import HardwareError
from .hardware import COLLECTIVES, CollectiveFit, Hardware, _ring_factor

GiB, GB, TFLOPS = 2 ** 30, 1e9, 1e12
GBIT = 1e9 / 8  # bytes/s in one Gb/s

# ---- efficiency assumptions (what a real run reaches of the datasheet number) -----------------------------
#: Largest-GEMM fraction of dense peak. NVIDIA: an 8192^3 bf16 torch.mm measured 769-798 TFLOP/s of 989 on an
#: H200 (two machines, 2026-10-28 and 2026-11-04; mean of ten products after three warm-ups) = 0.80.
GEMM_EFFICIENCY = {"nvidia": 0.80, "amd": 0.50}
GEMM_EFFICIENCY_SOURCE = {
    "nvidia": "measured: 8192^3 bf16 torch.mm at 769-798 TFLOP/s of 989 on an H200 (2026-11)",
    "amd": "MI300X sustains ~45-50% of dense peak in BF16 GEMMs: https://aiweekly.co/alerts/"
           "amd-mi300x-hits-only-45-of-peak-flops-in-practice ; AMD's own max-achievable-FLOPs method: "
           "https://rocm.blogs.amd.com/software-tools-optimization/measuring-max-achievable-flops-part2/README.html",
}
#: Fixed GPU-side time per GEMM kernel (launch latency, ramp-up and tail of the last wave): small GEMMs reach
#: less of the peak (NVIDIA, "Matrix Multiplication Background User's Guide", wave quantization:
#: https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/index.html).
#: Assumed 3 us: a 1024^3 bf16 GEMM then reaches ~45% of an H100's peak, a 4096^3 one ~95% of the large-GEMM rate.
GEMM_FIXED_S = 3e-6
#: Achieved fraction of HBM bandwidth by large elementwise kernels: a device-to-device copy measured 4.3 TB/s
#: (bytes read + written) of 4.8 on an H200 (2026-11) = 0.90.
MEM_EFFICIENCY = 0.90
#: Ring bus bandwidth reached of the link bandwidth: nccl-tests all_reduce busbw at large sizes, 8x A100 SXM
#: 230-250 GB/s of 300, 8x H100 PCIe 35-45 GB/s of 64
#: (https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests); MI300X xGMI assumed lower (RCCL).
LINK_EFFICIENCY = {"nvlink": 0.80, "pcie": 0.62, "xgmi": 0.70}
#: Inter-node: fraction of the NIC line rate reached by NCCL ring traffic (assumption, same order as NVLink).
NET_EFFICIENCY = 0.80
#: Latency floor of one intra-node collective (NCCL LL protocol, small messages) and per ring step across nodes.
INTRA_LATENCY_S = 10e-6
INTER_LATENCY_S = 5e-6
#: Eager PyTorch host cost per dispatched op (dispatcher + kernel launch), assumption.
OP_OVERHEAD_S = 6e-6
#: Achieved fraction of dense peak of the fused attention kernel, ``(forward, backward)`` by kernel and GPU
#: generation, of the FLOPs the kernel computes (causal tiles and backward's recomputed scores included).
#: ``flash2`` is what PyTorch's SDPA runs on NVIDIA GPUs (its flash backend is FlashAttention-2). A100: "50-73% of
#: the theoretical maximum FLOPs/s" (Dao 2023, arXiv 2307.08691, abstract: the forward reaches the top of the
#: range, the backward the bottom). H100: PyTorch SDPA measured 287-304 TFLOP/s forward at head dim 128 over
#: sequences 1k-16k (pytorch/benchmark PR 2296, ``run_benchmark.py triton --op flash_attention``, sdpa-tflops)
#: = 0.30 of 989; backward at A100's backward/forward ratio (50/73) = 0.21. ``flash3`` is the Hopper kernel
#: class of FlashAttention-3 and cuDNN's fused attention (what Transformer Engine / Megatron run): forward
#: 638-648 TFLOP/s at head dim 128 (Shah et al. 2024, arXiv 2407.08608, Fig. 5; cuDNN 595-617) = 0.65,
#: backward 1.5-1.75x FlashAttention-2's (same paper, sec. 4.1): 1.6 x 0.26 (upstream FA2's 370 forward x
#: 50/73) = 0.42. Blackwell and MI300X have no published figure here: the Hopper values are assumed (flagged
#: in ``sources``).
ATTENTION_EFFICIENCY = {
    "flash2": {"ampere": (0.70, 0.50), "hopper": (0.30, 0.21), "other": (0.30, 0.21)},
    "flash3": {"ampere": (0.70, 0.50), "hopper": (0.65, 0.42), "other": (0.65, 0.42)},
}
#: the attention kernel ``loom plan`` assumes: what torchloom runs (PyTorch SDPA)
DEFAULT_ATTENTION_KERNEL = "flash2"
_GENERATION = {"a100-40gb": "ampere", "a100-80gb": "ampere", "h100-sxm": "hopper", "h100-pcie": "hopper",
               "h200": "hopper"}
FIT_SIZES = (4e3, 64e3, 1e6, 16e6, 256e6, 4e9)  # bytes at which the intra-node fits are tabulated

_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_DGX_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/nvidia-dgx-a100-datasheet.pdf"
_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_DGX_H100 = "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"
_DGX_H200 = "https://www.nvidia.com/en-us/data-center/dgx-h200/"
_HGX_B200 = "https://www.nvidia.com/en-us/data-center/hgx/"
_DGX_B200 = "https://www.nvidia.com/en-us/data-center/dgx-b200/"
_MI300X = "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf"
_MI300X_PLATFORM = "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-platform-data-sheet.pdf"
_CX7 = "https://www.nvidia.com/content/dam/en-zz/Solutions/networking/infiniband-adapters/infiniband-connectx7-data-sheet.pdf"


@dataclass(frozen=True)
class Accelerator:
    """One GPU model's datasheet numbers.

    Attributes:
        name: table key (``"h100-sxm"``); description: the product name.
        vendor: ``"nvidia"`` / ``"amd"`` (selects the GEMM efficiency assumption).
        peak_flops: dense peak FLOP/s by dtype: ``bfloat16``, ``float16``, ``tf32``, ``float32``, and ``float8``
            where the GPU has FP8 tensor cores (H100/H200: 3,958 TFLOPS with sparsity in the datasheet, halved;
            B200: 72 PF FP8 with sparsity per 8-GPU HGX, /8 /2; MI300X: 2,614.9 TFLOPS dense).
        memory_bytes: HBM capacity (bytes); mem_bw: HBM bandwidth (bytes/s).
        link: ``"nvlink"`` (NVSwitch: every GPU reaches any peer at ``link_bw``), ``"pcie"`` (through the PCIe
            switch at ``link_bw``) or ``"xgmi"`` (fully connected mesh: ``link_bw`` per peer link,
            ``link_count`` links).
        link_bw: intra-node bandwidth per GPU (per link for ``xgmi``), one direction, bytes/s.
        link_count: peer links per GPU (``xgmi`` only).
        inter_bw: typical inter-node bandwidth per GPU, one direction, bytes/s.
        gpus_per_node: the usual node (HGX/DGX/OAM platform).
        sources: the datasheet (or assumption) behind each field.
    """

    name: str
    description: str
    vendor: str
    peak_flops: dict[str, float]
    memory_bytes: float
    mem_bw: float
    link: str
    link_bw: float
    inter_bw: float
    gpus_per_node: int = 8
    link_count: int = 1
    sources: dict[str, str] = field(default_factory=dict)

    REQUIRED = ("name", "vendor", "peak_flops", "memory_bytes", "mem_bw", "link", "link_bw", "inter_bw")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Accelerator":
        """A user-described accelerator (same fields; ``description``/``sources`` optional).

        Raises:
            HardwareError: a required field is missing, an unknown field is given, or a value is bad."""
        missing = [k for k in cls.REQUIRED if k not in d]
        if missing:
            raise HardwareError(f"accelerator description is missing {', '.join(missing)} "
                                f"(required: {', '.join(cls.REQUIRED)}).")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise HardwareError(f"accelerator description has unknown field(s) {', '.join(unknown)}; "
                                f"known: {', '.join(sorted(known))}.")
        acc = cls(**{"description": d["name"], **d})
        acc.check()
        return acc

    def check(self) -> None:
        """Raise :class:`HardwareError` naming the first bad value."""
        for k in ("memory_bytes", "mem_bw", "link_bw", "inter_bw"):
            if not float(getattr(self, k)) > 0:
                raise HardwareError(f"accelerator {self.name!r}: {k} must be > 0, got {getattr(self, k)!r}.")
        if "bfloat16" not in self.peak_flops and "float32" not in self.peak_flops:
            raise HardwareError(f"accelerator {self.name!r}: peak_flops needs at least bfloat16 or float32.")
        if self.link not in LINK_EFFICIENCY:
            raise HardwareError(f"accelerator {self.name!r}: link must be one of {sorted(LINK_EFFICIENCY)}, "
                                f"got {self.link!r}.")
        if self.vendor not in GEMM_EFFICIENCY:
            raise HardwareError(f"accelerator {self.name!r}: vendor must be one of {sorted(GEMM_EFFICIENCY)}.")

    def group_bw(self, group_size: int) -> float:
        """Per-GPU one-direction bandwidth a ring over ``group_size`` GPUs of one node can use (bytes/s):
        the whole ``link_bw`` through a switch; ``min(g-1, link_count)`` peer links in an xGMI mesh."""
        if self.link == "xgmi":
            return self.link_bw * max(1, min(group_size - 1, self.link_count))
        return self.link_bw


def _nvidia(name, description, bf16, tf32, fp32, mem_gib, mem_bw, link, link_bw, inter_bw, src, node_src, fp8=None):
    flops = {"bfloat16": bf16, "float16": bf16, "tf32": tf32, "float32": fp32}
    if fp8:
        flops["float8"] = fp8
    sources = {"peak_flops": src + " (dense; the datasheet's tensor numbers are with 2:4 sparsity, halved)",
               "memory_bytes": src, "mem_bw": src, "link_bw": src, "inter_bw": node_src, "link": src}
    return Accelerator(name, description, "nvidia", flops, mem_gib * GiB, mem_bw, link, link_bw, inter_bw,
                       sources=sources)


ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    _nvidia("a100-40gb", "NVIDIA A100 40GB SXM4", 312 * TFLOPS, 156 * TFLOPS, 19.5 * TFLOPS, 40, 1555 * GB,
            "nvlink", 300 * GB, 200 * GBIT, _A100,
            _DGX_A100 + " (8x ConnectX-6 200 Gb/s HDR InfiniBand for compute, one per GPU)"),
    _nvidia("a100-80gb", "NVIDIA A100 80GB SXM4", 312 * TFLOPS, 156 * TFLOPS, 19.5 * TFLOPS, 80, 2039 * GB,
            "nvlink", 300 * GB, 200 * GBIT, _A100,
            _DGX_A100 + " (8x ConnectX-6 200 Gb/s HDR InfiniBand for compute, one per GPU)"),
    _nvidia("h100-sxm", "NVIDIA H100 SXM5 80GB", 989.4 * TFLOPS, 494.7 * TFLOPS, 66.9 * TFLOPS, 80, 3350 * GB,
            "nvlink", 450 * GB, 400 * GBIT, _H100,
            _DGX_H100 + " (8x ConnectX-7 400 Gb/s NDR InfiniBand for compute, one per GPU)", fp8=1978.9 * TFLOPS),
    _nvidia("h100-pcie", "NVIDIA H100 PCIe 80GB", 756.5 * TFLOPS, 378 * TFLOPS, 51.2 * TFLOPS, 80, 2000 * GB,
            "pcie", 64 * GB, 400 * GBIT, _H100 + " (PCIe Gen5 x16: 128 GB/s both directions; the NVLink bridge "
            "joins pairs only, so node-wide rings run over PCIe)",
            _CX7 + " (assumption: one 400 Gb/s NDR ConnectX-7 per GPU as in DGX; many PCIe servers have fewer)",
            fp8=1513 * TFLOPS),
    _nvidia("h200", "NVIDIA H200 SXM 141GB", 989.4 * TFLOPS, 494.7 * TFLOPS, 66.9 * TFLOPS, 141, 4800 * GB,
            "nvlink", 450 * GB, 400 * GBIT, _H200,
            _DGX_H200 + " (8x ConnectX-7 400 Gb/s NDR InfiniBand for compute, one per GPU)", fp8=1978.9 * TFLOPS),
    _nvidia("b200", "NVIDIA B200 SXM (HGX/DGX B200)", 2250 * TFLOPS, 1125 * TFLOPS, 75 * TFLOPS, 180, 8000 * GB,
            "nvlink", 900 * GB, 400 * GBIT, _HGX_B200 + " (8-GPU totals divided by 8: FP16/BF16 36 PF and TF32 "
            "18 PF with sparsity, FP32 600 TF, 1.44 TB memory at 64 TB/s, NVLink 5 1.8 TB/s both directions)",
            _DGX_B200 + " (8x ConnectX-7 400 Gb/s for compute, one per GPU)", fp8=4500 * TFLOPS),
    Accelerator("mi300x", "AMD Instinct MI300X OAM 192GB", "amd",
                {"bfloat16": 1307.4 * TFLOPS, "float16": 1307.4 * TFLOPS, "tf32": 653.7 * TFLOPS,
                 "float32": 163.4 * TFLOPS, "float8": 2614.9 * TFLOPS},
                192 * GiB, 5300 * GB, "xgmi", 64 * GB, 400 * GBIT, link_count=7,
                sources={"peak_flops": _MI300X + " (dense matrix numbers; sparsity doubles them)",
                         "memory_bytes": _MI300X, "mem_bw": _MI300X, "link": _MI300X_PLATFORM,
                         "link_bw": _MI300X + " (7 Infinity Fabric links of 128 GB/s both directions, fully "
                                              "connected 8-GPU platform)",
                         "inter_bw": _MI300X_PLATFORM + " (assumption: one 400 Gb/s NIC per GPU)"}),
)}

ALIASES = {"a100": "a100-80gb", "a100-40g": "a100-40gb", "a100-80g": "a100-80gb", "h100": "h100-sxm",
           "h100-sxm5": "h100-sxm", "h200-sxm": "h200", "b200-sxm": "b200", "mi300": "mi300x"}


def lookup(gpu: str) -> Accelerator:
    """The table entry for ``gpu`` (case, spaces and underscores ignored; aliases: ``h100`` = ``h100-sxm``,
    ``a100`` = ``a100-80gb``).

    Raises:
        HardwareError: an unknown name, listing the known ones and the closest match."""
    key = "-".join(str(gpu).strip().lower().replace("_", " ").replace("-", " ").split())
    key = ALIASES.get(key, key)
    if key in ACCELERATORS:
        return ACCELERATORS[key]
    known = sorted(ACCELERATORS) + sorted(ALIASES)
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    raise HardwareError(f"unknown GPU {gpu!r}.{hint} Known: {', '.join(sorted(ACCELERATORS))} "
                        f"(aliases: {', '.join(f'{a}={b}' for a, b in sorted(ALIASES.items()))}); "
                        "describe another one with Accelerator.from_dict.")


def match_device_name(device_name: str) -> Accelerator | None:
    """The table entry for a ``torch.cuda.get_device_name()`` string (``"NVIDIA H100 80GB HBM3"``,
    ``"NVIDIA H200"``, ``"AMD Instinct MI300X"``), or None when the table has no such device."""
    n = device_name.lower()
    if "mi300x" in n:
        return ACCELERATORS["mi300x"]
    if "b200" in n:
        return ACCELERATORS["b200"]
    if "h200" in n:
        return ACCELERATORS["h200"]
    if "h100" in n:
        return ACCELERATORS["h100-pcie" if "pcie" in n else "h100-sxm"]
    if "a100" in n:
        return ACCELERATORS["a100-40gb" if "40gb" in n.replace(" ", "") else "a100-80gb"]
    return None


def gemm_curve(acc: Accelerator, dtype: str) -> list[tuple[float, float]]:
    """``(gemm_flops, flop_per_s)`` points: ``rate(f) = f / (f / (eff * peak) + GEMM_FIXED_S)``, tabulated
    from 2*256^3 to 2*16384^3 FLOPs (``Hardware.matmul_rate`` interpolates in log-size)."""
    peak = acc.peak_flops[dtype] * GEMM_EFFICIENCY[acc.vendor]
    sizes = [2.0 * n ** 3 for n in (256, 512, 1024, 2048, 4096, 8192, 16384)]
    return [(f, f / (f / peak + GEMM_FIXED_S)) for f in sizes]


def collective_fit(acc: Accelerator, kind: str, group_size: int) -> CollectiveFit:
    """Intra-node ring model over the node's links: ``INTRA_LATENCY_S + factor * bytes / (eff * bw)`` with the
    ring factor of ``kind`` (all-reduce 2(g-1)/g, all-gather/reduce-scatter/all-to-all (g-1)/g, send/recv and
    broadcast 1), tabulated at ``FIT_SIZES``."""
    bw = acc.group_bw(group_size) * LINK_EFFICIENCY[acc.link]
    factor = _ring_factor(kind, group_size)
    return CollectiveFit([(s, INTRA_LATENCY_S + factor * s / bw) for s in FIT_SIZES])


def attention_rates(acc: Accelerator, kernel: str = DEFAULT_ATTENTION_KERNEL) -> dict[str, list[float]]:
    """``{dtype: [forward, backward]}`` achieved FLOP/s of ``kernel`` (:data:`ATTENTION_EFFICIENCY`) on ``acc``
    for the half-precision dtypes (flash kernels run in bf16/fp16 only).

    Raises:
        HardwareError: an unknown kernel."""
    if kernel not in ATTENTION_EFFICIENCY:
        raise HardwareError(f"unknown attention kernel {kernel!r}; one of {sorted(ATTENTION_EFFICIENCY)}.")
    fwd, bwd = ATTENTION_EFFICIENCY[kernel][_GENERATION.get(acc.name, "other")]
    return {dt: [acc.peak_flops[dt] * fwd, acc.peak_flops[dt] * bwd] for dt in ("bfloat16", "float16")
            if dt in acc.peak_flops}


def cluster(gpu: str | Accelerator | dict | None, gpus: int | None, gpus_per_node: int | None = None,
            attention_kernel: str = DEFAULT_ATTENTION_KERNEL) -> Hardware:
    """A :class:`Hardware` for ``gpus`` GPUs of kind ``gpu`` (a table name, an :class:`Accelerator` or a dict
    for :meth:`Accelerator.from_dict`), ``gpus_per_node`` per node (default: the platform's usual 8, or
    ``gpus`` when fewer).

    Achieved matmul = dense peak x :data:`GEMM_EFFICIENCY` with the small-GEMM fixed cost
    (:func:`gemm_curve`); ``mem_bw`` = HBM x :data:`MEM_EFFICIENCY`; intra-node collectives from the ring
    model (:func:`collective_fit`) for every group size dividing ``gpus_per_node``; across nodes the ring model
    with ``inter_bw x NET_EFFICIENCY`` and ``INTER_LATENCY_S`` per step. ``peak_flops`` is the datasheet
    (what MFU divides by). Attention runs at ``attention_kernel``'s rate (:func:`attention_rates`).

    Raises:
        HardwareError: an unknown GPU (did-you-mean), a missing ``gpu``/``gpus``, counts < 1, or ``gpus`` not a
            multiple of ``gpus_per_node``.
    """
    if gpu is None or gpu == "":
        raise HardwareError(f"the cluster description is missing 'gpu' (one of {', '.join(sorted(ACCELERATORS))}).")
    if gpus is None:
        raise HardwareError("the cluster description is missing 'gpus' (the total number of GPUs).")
    acc = gpu if isinstance(gpu, Accelerator) else Accelerator.from_dict(gpu) if isinstance(gpu, dict) else lookup(gpu)
    acc.check()
    gpus = int(gpus)
    per_node = int(gpus_per_node) if gpus_per_node is not None else min(acc.gpus_per_node, gpus)
    if gpus < 1 or per_node < 1:
        raise HardwareError(f"gpus and gpus_per_node must be >= 1 (got gpus={gpus}, gpus_per_node={per_node}).")
    if gpus % per_node:
        raise HardwareError(f"{gpus} GPUs do not fill nodes of {per_node}: gpus must be a multiple of "
                            f"gpus_per_node (e.g. {gpus // per_node * per_node or per_node} or "
                            f"{(gpus // per_node + 1) * per_node}).")
    matmul = {dt: gemm_curve(acc, dt) for dt in acc.peak_flops}
    sizes = [g for g in range(2, per_node + 1) if per_node % g == 0]
    intra = {k: {g: collective_fit(acc, k, g) for g in sizes} for k in COLLECTIVES} if sizes else {}
    assumption = "assumption, see torchloom.cost.accelerators"
    return Hardware(
        name=acc.name, device_type="cuda", memory_bytes=acc.memory_bytes, ranks_per_node=per_node,
        num_nodes=gpus // per_node, matmul_flops=matmul, peak_flops=dict(acc.peak_flops),
        mem_bw=acc.mem_bw * MEM_EFFICIENCY, op_overhead_s=OP_OVERHEAD_S, intra=intra,
        inter_bw=acc.inter_bw * NET_EFFICIENCY, inter_latency_s=INTER_LATENCY_S,
        fingerprint={"gpu": acc.description, "gpu_count": gpus, "gpus_per_node": per_node, "backend": "nccl",
                     "source": "accelerator table"},
        attention_flops=attention_rates(acc, attention_kernel), attention_kernel=attention_kernel,
        sources={**acc.sources,
                 "matmul_flops": f"peak x {GEMM_EFFICIENCY[acc.vendor]} ({GEMM_EFFICIENCY_SOURCE[acc.vendor]}), "
                                 f"{GEMM_FIXED_S * 1e6:g} us fixed per GEMM ({assumption})",
                 "mem_bw": f"{acc.sources.get('mem_bw', '')} x {MEM_EFFICIENCY} ({assumption})",
                 "intra": f"ring model on {acc.link} x {LINK_EFFICIENCY[acc.link]} + {INTRA_LATENCY_S * 1e6:g} us "
                          f"({assumption})",
                 "inter_bw": f"{acc.sources.get('inter_bw', '')} x {NET_EFFICIENCY} ({assumption})",
                 "op_overhead_s": assumption,
                 "attention_flops": f"{attention_kernel}: peak x {ATTENTION_EFFICIENCY[attention_kernel][_GENERATION.get(acc.name, 'other')]} "
                                    "(forward, backward; see torchloom.cost.accelerators.ATTENTION_EFFICIENCY"
                                    + ("" if acc.name in _GENERATION else "; Hopper's values assumed") + ")"},
    )
