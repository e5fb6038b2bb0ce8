"""``loom calibrate``: measure (or read the cached) hardware calibration per co-location level and print it."""
from __future__ import annotations

import json
import sys

from .hardware import Hardware
from .load import describe


def _size(n: float) -> str:
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k:
            return f"{n / k:g}{unit}"
    return f"{n:g}"


def _ms(t: float) -> str:
    return f"{t * 1e3:.3g}ms" if t < 1 else f"{t:.3g}s"


def format_table(hw: Hardware) -> str:
    """A readable summary of one calibration: the machine load it was measured under (and whether that
    makes it provisional), matmul GFLOP/s per rank by GEMM size and dtype, memory bandwidth, per-op
    overhead, and each collective's time by message size and group size with the bandwidth (bytes / time)
    reached at the largest size."""
    fp = hw.fingerprint
    lines = [f"{hw.name}: {fp.get('gpu') or fp.get('cpu')}, {fp.get('cores')} cores, torch {fp.get('torch')}, "
             f"{fp.get('backend')} -- {hw.ranks_per_node} rank(s) per node x {hw.threads_per_rank} thread(s)"
             + (f" x {hw.num_nodes} nodes" if hw.num_nodes > 1 else ""),
             f"  {hw.sources.get('matmul_flops', '')}; cache {hw.sources.get('cache', '-')}",
             f"  load: {describe(hw.load)}"
             + (" -> PROVISIONAL: rates may read low; re-measured at its first use on a quiet machine "
                f"(or now: loom calibrate --refresh --nproc {hw.ranks_per_node} on a quiet machine)"
                if hw.provisional else "")]
    lines.append("  matmul GFLOP/s per rank (square GEMM n^3, all ranks at once):")
    for dt, pts in hw.matmul_flops.items():
        row = "  ".join(f"n={round((f / 2) ** (1 / 3))}: {r / 1e9:.1f}" for f, r in pts)
        lines.append(f"    {dt:<9} {row}")
    lines.append(f"  memory bandwidth per rank: {hw.mem_bw / 1e9:.2f} GB/s; per-op overhead: "
                 f"{hw.op_overhead_s * 1e6:.2f} us; memory per rank: {hw.memory_bytes / 2 ** 30:.1f} GiB")
    if hw.eager_op_overhead_s:
        lines.append("  host time per op in eager model code: " + ", ".join(
            f"{k} {v * 1e6:.2f} us" for k, v in hw.eager_op_overhead_s.items()))
    if hw.optimizer_tensor_s:
        per_elem = "  ".join(f"{int(n):,}: {v * 1e9:.2f}" for n, v in hw.optimizer_element_s)
        lines.append(f"  optimizer step (clip + AdamW): {hw.optimizer_tensor_s * 1e6:.2f} us per tensor; ns per "
                     f"element by tensor size: {per_elem}"
                     + (f"; {hw.optimizer_dtensor_s * 1e6:.2f} us per DTensor parameter (FSDP2 / TP)"
                        if hw.optimizer_dtensor_s else ""))
    if hw.intra:
        sizes = sorted({b for fits in hw.intra.values() for f in fits.values() for b, _ in f.points})
        head = "".join(f"{_size(s):>10}" for s in sizes)
        lines.append("  collectives (time per call by bytes per rank; groups of one size run side by side):")
        lines.append(f"    {'kind':<15}{'group':>5}{head}{'GB/s':>9}")
        for kind, fits in hw.intra.items():
            for g, fit in sorted(fits.items()):
                times = dict(fit.points)
                cells = "".join(f"{_ms(times[s]) if s in times else '-':>10}" for s in sizes)
                b, t = fit.points[-1]
                lines.append(f"    {kind:<15}{g:>5}{cells}{b / t / 1e9:>9.2f}")
    if hw.num_nodes > 1:
        lines.append(f"  across nodes: {hw.inter_bw / 1e9:.2f} GB/s per rank, {hw.inter_latency_s * 1e6:.1f} us per step")
    return "\n".join(lines)


def parse_levels(text: str | None, default: list[int]) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; raises ValueError naming a bad entry."""
    if not text:
        return default
    out = []
    for part in str(text).split(","):
        try:
            n = int(part)
        except ValueError:
            raise ValueError(f"--nproc: {part!r} is not an integer (give e.g. 1,2,4).") from None
        if n < 1:
            raise ValueError(f"--nproc: {n} must be >= 1.")
        out.append(n)
    return out


def run_command(nproc: str | None, refresh: bool, budget: float, cache_dir: str | None, as_json: bool) -> int:
    """The body of ``loom calibrate``; returns the exit code (2 for bad input)."""
    import torch

    from ..errors import HardwareError
    from .calibrate import local_hardware

    default = [torch.cuda.device_count()] if torch.cuda.is_available() else [1, 2, 4]
    try:
        levels = parse_levels(nproc, default)
        hws = [local_hardware(n, refresh=refresh, cache_dir=cache_dir, budget_s=budget) for n in levels]
    except (ValueError, HardwareError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps([hw.to_dict() for hw in hws], indent=1))
    else:
        print("\n\n".join(format_table(hw) for hw in hws))
    return 0
