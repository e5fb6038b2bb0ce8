"""Hardware calibration on this machine, cached per machine fingerprint.

Three ways in:

- :func:`measure_in_group` runs on **every rank of an initialised process group** (the user's job, its real
  ranks and backend) and returns rank 0's measurements, as a :meth:`Hardware.to_dict`, on every rank.
- :func:`job_hardware` is what ``strategy="auto"`` calls inside a job: the cached calibration for this
  machine, ranks per node, threads and backend, or a fresh :func:`measure_in_group` (rank 0 writes the cache).
- :func:`local_hardware` calibrates without a job: it starts ``ranks_per_node`` local ranks (gloo on CPU,
  NCCL on GPUs), unless a cache file exists.

Cache: ``<dir>/<fingerprint-hash>-w<ranks per node>[-n<nodes>].json`` with ``<dir>`` = ``cache_dir``, else
``$TORCHLOOM_CACHE_DIR/hardware``, else ``$TORCHLOOM_CACHE/hardware``, else ``~/.cache/torchloom/hardware``.
A file that cannot be read, or that holds another machine's fingerprint, ranks per node or thread count, or
no record of the machine's load and layout probe, is ignored with a warning and re-measured. ``loom calibrate``
refreshes it.

Load: every calibration records the load it ran under (:mod:`torchloom.cost.load`); one taken under load
is cached as ``provisional`` (never over a quiet one) and warned about. Before a cached calibration is
trusted, the load is measured *now* (:func:`measure_now`: a :data:`microbench.PROBE_S` window of
``/proc/stat`` around a matmul probe run in the calibration's layout, all ranks' worth of threads at once)
and :func:`recheck` decides: a provisional cache on a quiet machine is re-measured; a quiet one whose probe
reads :data:`RECHECK_RATIO` times faster now was measured under load nobody noticed (re-measured); a machine
under load now keeps the cache, with a warning that timings measured now are disturbed. No re-measurement
is started on a machine under load. See ``docs/calibration.md``.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..elastic.launcher import usable_cores
from ..errors import HardwareError
from . import eager_overhead
from . import load as machine_load
from . import microbench as mb
from .hardware import COLLECTIVES, CollectiveFit, Hardware

DEFAULT_BUDGET_S = 10.0  # measurement time; spawning the ranks adds 5-10 s on a loaded 2-core machine
COMPUTE_SHARE = 0.3  # of the budget: matmul, memory, overhead; the rest goes to the collectives
RECHECK_RATIO = 1.3  # re-check probe now vs when calibrated: faster by more -> the cache was taken under load
PROBE_VERSION = 2  # 2: the probe runs the calibration's layout (all ranks as threads); 1 was rank 0 alone


# -------------------------------------------------------------------------------------------- fingerprint
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware"):
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _ram_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def fingerprint(backend: str | None = None) -> dict[str, Any]:
    """What identifies this machine for calibration and plans: CPU model, usable cores
    (``os.sched_getaffinity``), RAM (GiB, rounded), GPU model and count (when CUDA is available), torch
    version and the collective backend (``backend``, default ``nccl`` with CUDA else ``gloo``)."""
    cuda = torch.cuda.is_available()
    return {
        "cpu": _cpu_model(),
        "cores": usable_cores(),
        "ram_gib": round(_ram_bytes() / 2 ** 30),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "backend": backend or ("nccl" if cuda else "gloo"),
    }


#: what the calibration measures, in the cache file's name: a calibration measured another way is not reused
#: (2: GEMMs timed as ``x @ W^T``, nn.Linear's layout; 3: host cost per op of eager model code,
#: ``eager_op_overhead_s``, and the optimizer step per tensor and per element; 4: chunks spanning scheduler
#: slices when the ranks oversubscribe the cores; 5: the optimizer step over DTensor parameters, ``optimizer_dtensor_s``, FSDP2's
#: own work per unit, ``fsdp_unit_s``, TrainStep's per micro-batch, ``train_step_call_s``, and the backward's GEMM layouts,
#: ``backward_gemm_factor``)
CALIBRATION_METHOD = {"calibration_method": 5}
#: shortest timed chunk when the ranks oversubscribe the cores: several CFS time slices (Linux's default
#: ``sched_min_granularity`` is 0.75-3 ms and a slice is at most ``sched_latency`` 6-24 ms), so a chunk sees its
#: co-tenants run
OVERSUBSCRIBED_CHUNK_S = 0.05


def fingerprint_hash(fp: dict[str, Any]) -> str:
    """A short stable hash (12 hex digits) of a fingerprint: names cache files."""
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]


def threads_per_rank(ranks_per_node: int) -> int:
    """Intra-op threads each of ``ranks_per_node`` ranks uses, as ``loom run`` sets them:
    ``$OMP_NUM_THREADS`` when set, else usable cores // ranks (at least 1)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            pass
    return max(1, usable_cores() // max(1, ranks_per_node))


# -------------------------------------------------------------------------------------------- measuring
def _divisors(n: int) -> list[int]:
    return [g for g in range(2, n + 1) if n % g == 0]


def _dtypes(device: torch.device) -> list[torch.dtype]:
    if device.type == "cuda":
        return [torch.float32, torch.bfloat16, torch.float16]
    return [torch.float32, torch.bfloat16]


def _subgroups(partition: list[list[int]], backend: str, members: list[int]):
    """This rank's group of ``partition`` (every rank of the default group must call); the whole
    ``members`` group is reused instead of creating a copy."""
    me = dist.get_rank()
    if len(partition) == 1 and partition[0] == members:
        return None, partition[0], False
    mine, _ = dist.new_subgroups_by_enumeration(partition, backend=backend)
    return mine, next(p for p in partition if me in p), True


def measure_in_group(budget_s: float = DEFAULT_BUDGET_S, *, group=None, ranks_per_node: int | None = None,
                     message_sizes=None, matmul_sizes=None) -> dict[str, Any]:
    """Calibrate on every rank of ``group`` (default: the world) at once; return rank 0's result
    (a :meth:`Hardware.to_dict`) on every rank.

    All ranks of the *default* group must call it (sub-groups are created for the group sizes and destroyed
    afterwards). Measures, with every rank working at once: matmul FLOP/s per rank by dtype (fp32, bf16;
    fp16 too on CUDA) at five square GEMM sizes; memory bandwidth (elementwise add on tensors larger than the
    caches); per-op dispatch overhead; and on the group's backend all-reduce, all-gather, reduce-scatter,
    all-to-all, send/recv (ring shift) and broadcast for ``message_sizes`` (default 4 KiB ... 64 MiB; to
    256 MiB on CUDA) and every group size dividing ``ranks_per_node`` (default ``$LOCAL_WORLD_SIZE``, else the
    group size), all groups of one size running side by side. With several nodes, an all-reduce across nodes at the smallest and largest
    size gives the ring model's ``inter_bw``/``inter_latency_s``.

    ``budget_s`` (seconds) is split over the measurements; each still runs at least one timed call, so
    large messages on a slow backend can exceed it (the wall time is recorded in ``sources``).

    The load the measurement ran under is recorded (``load``: :func:`torchloom.cost.load.assess`, plus
    ``probe_flops`` and ``probe_workers``: the re-check probe, :func:`measure_now`'s, that rank 0 runs first
    with ``ranks_per_node`` threads while the other ranks wait); under load the result is ``provisional``.

    Raises:
        HardwareError: no initialised process group, or a group size that does not divide into nodes.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise HardwareError("measure_in_group needs an initialised process group (dist.init_process_group); "
                            "without a job use torchloom.cost.calibrate.local_hardware(ranks_per_node).")
    t_start = time.perf_counter()
    members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    world = len(members)
    local = int(ranks_per_node or os.environ.get("LOCAL_WORLD_SIZE") or world)
    if local < 1 or world % local:
        raise HardwareError(f"{world} ranks do not divide into nodes of {local} ranks; pass ranks_per_node.")
    nodes = world // local
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    # co-located ranks oversubscribing the cores: time in chunks that span scheduler slices (Timer.min_chunk_s)
    oversubscribed = device.type == "cpu" and local * torch.get_num_threads() > usable_cores()
    timer = mb.Timer(device, group, min_chunk_s=OVERSUBSCRIBED_CHUNK_S if oversubscribed else 0.0)
    sizes = list(message_sizes or mb.MESSAGE_SIZES[device.type])
    msizes = list(matmul_sizes or mb.MATMUL_SIZES[device.type])
    dtypes = _dtypes(device)
    gsizes = _divisors(local)

    window = machine_load.LoadWindow()  # every rank: its own CPU time, and the host's, while measuring
    # the re-check probe as measure_now() runs it (rank 0, the node's ranks as threads; the other ranks wait):
    # what a later recheck() compares with
    threads, workers = torch.get_num_threads(), _probe_workers(device, local)
    probe = _probe(device, threads, workers) if dist.get_rank() == members[0] else 0.0
    timer.slowest(0.0)

    # timed measurements sharing the compute budget: the GEMM sweep, memory bandwidth, bare dispatch, eager
    # code per style, the optimizer per tensor and per element at each size (a new one must be counted here)
    n_compute = (len(dtypes) * (len(msizes) + 1) + 2 + eager_overhead.measured_styles()
                 + 4 + len(eager_overhead.OPTIMIZER_SIZES))
    n_comm = len(COLLECTIVES) * len(sizes) * len(gsizes) + (2 if nodes > 1 else 0)
    t_compute = budget_s * (COMPUTE_SHARE if n_comm else 1.0) / n_compute
    t_comm = budget_s * (1 - COMPUTE_SHARE) / max(1, n_comm)

    matmul = {str(dt).removeprefix("torch."): mb.matmul_rates(timer, dt, msizes, t_compute) for dt in dtypes}
    backward_gemm = {str(dt).removeprefix("torch."): mb.backward_gemm_factor(
        timer, dt, mb.BACKWARD_LAYOUT_N[device.type], t_compute) for dt in dtypes}
    mem_bw = mb.memory_bandwidth(timer, mb.STREAM_BYTES[device.type], t_compute)
    overhead = mb.op_overhead(timer, t_compute)
    eager = eager_overhead.measure(timer, t_compute)
    per_tensor = eager_overhead.optimizer_tensor_seconds(timer, t_compute)
    per_element = eager_overhead.optimizer_element_seconds(timer, t_compute, per_tensor)
    per_dtensor = eager_overhead.optimizer_dtensor_seconds(timer, t_compute, group)
    per_call = eager_overhead.train_step_seconds(timer, t_compute, group)

    intra: dict[str, dict[int, CollectiveFit]] = {k: {} for k in COLLECTIVES}
    for g in gsizes:
        blocks = [members[i:i + g] for i in range(0, world, g)]
        pg, ranks, made = _subgroups(blocks, backend, members)
        pg = group if not made else pg
        for kind in COLLECTIVES:
            intra[kind][g] = CollectiveFit(mb.collective_points(timer, kind, sizes, pg, ranks, t_comm))
        if made:
            dist.destroy_process_group(pg)
    fsdp_unit = fsdp_tensor = fsdp_reduce = 0.0
    if world in intra["all_gather"]:  # FSDP2's own work per unit beside the collectives just fitted
        fsdp_unit, fsdp_tensor, fsdp_reduce = eager_overhead.fsdp_unit_seconds(
            timer, t_compute, group, intra["all_gather"][world].time, intra["reduce_scatter"][world].time)
    inter_bw = inter_lat = 0.0
    if nodes > 1:
        inter_bw, inter_lat = _measure_inter(timer, members, local, nodes, backend, sizes, t_comm)

    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, window.finish(), group=group)
    load = machine_load.assess(rows, torch.get_num_threads())
    load.update(_probe_record(device, probe, workers, threads))

    peaks, peak_source = _peaks(device, matmul)
    hw = Hardware(
        name=f"local-{device.type}" if device.type == "cpu" else "local-" + _slug(torch.cuda.get_device_name()),
        device_type=device.type,
        memory_bytes=float(torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                           else _ram_bytes() / local),
        ranks_per_node=local, num_nodes=nodes,
        matmul_flops=matmul, peak_flops=peaks, backward_gemm_factor=backward_gemm,
        mem_bw=mem_bw, op_overhead_s=overhead, eager_op_overhead_s=eager, optimizer_tensor_s=per_tensor,
        optimizer_element_s=per_element, optimizer_dtensor_s=per_dtensor, fsdp_unit_s=fsdp_unit,
        fsdp_tensor_s=fsdp_tensor, fsdp_unit_reduce_s=fsdp_reduce, train_step_call_s=per_call,
        intra={k: v for k, v in intra.items() if v},
        inter_bw=inter_bw, inter_latency_s=inter_lat,
        fingerprint=fingerprint(backend), threads_per_rank=torch.get_num_threads(),
        load=load, provisional=bool(load["under_load"]),
    )
    _table_kernels(hw, device)
    wall = time.perf_counter() - t_start
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    how = f"measured {stamp} on {world} {backend} ranks ({local} per node, {hw.threads_per_rank} threads each)"
    hw.sources = {"matmul_flops": how, "mem_bw": how, "op_overhead_s": how, "intra": how,
                  "eager_op_overhead_s": how + " (tiny reference decoders forward + backward, ops counted by the "
                                               "analysis: torchloom.cost.eager_overhead)",
                  "optimizer_tensor_s": how + " (clip_grad_norm_ + AdamW step over 64 16-element tensors)",
                  "optimizer_dtensor_s": how + " (torchloom's clip_grad_norm_ + AdamW over 32 DTensors sharded "
                                               "over the ranks: what FSDP2 / tensor parallelism step)",
                  "fsdp_unit_s": how + " (FSDP2 over the ranks: 8 units of one and of four Linears forward + backward, "
                                       "the plain models and the calibrated all-gathers / reduce-scatters "
                                       "subtracted; also fsdp_tensor_s, fsdp_unit_reduce_s)",
                  "backward_gemm_factor": how + " (input- and weight-gradient GEMM layouts against the forward's "
                                                "at the same size: torchloom.cost.microbench.backward_gemm_factor)",
                  "train_step_call_s": how + " (TrainStep over a one-Linear model, the loss reported over the "
                                             "ranks, against the same work run bare)",
                  "optimizer_element_s": how + " (clip_grad_norm_ + AdamW step, 4 Mi elements in tensors of 64 Ki, 512 Ki and 4 Mi elements)",
                  "peak_flops": peak_source or how + " (maximum measured rate per dtype)",
                  "memory_bytes": "torch.cuda device memory" if device.type == "cuda" else "MemTotal / ranks per node",
                  "calibration_wall_s": f"{wall:.1f}", "load": machine_load.describe(load)}
    if nodes > 1:
        hw.sources["inter_bw"] = how + " (all-reduce across nodes, ring model fit)"
    box = [hw.to_dict()]
    dist.broadcast_object_list(box, src=members[0], group=group, device=device if device.type == "cuda" else None)
    return box[0]


def _slug(name: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def _peaks(device: torch.device, matmul: dict[str, list[tuple[float, float]]]) -> tuple[dict[str, float], str]:
    """Datasheet peaks (and their source) for a GPU the accelerator table knows; otherwise (and on CPU) the
    maximum measured rate per dtype and no source."""
    measured = {dt: max(r for _, r in pts) for dt, pts in matmul.items()}
    if device.type == "cuda":
        from .accelerators import match_device_name

        acc = match_device_name(torch.cuda.get_device_name(device))
        if acc is not None:
            return {**measured, **acc.peak_flops}, acc.sources["peak_flops"]
    return measured, ""


def _table_kernels(hw: Hardware, device: torch.device) -> None:
    """On a GPU the accelerator table knows: the attention kernel's rates from the table
    (:func:`~torchloom.cost.accelerators.attention_rates`, not measured here) and, where it has FP8 but the
    calibration measured none, an FP8 GEMM curve = the measured bf16 curve x (FP8 peak / bf16 peak): the bf16
    GEMMs' measured efficiency carried over (an assumption, named in ``sources``)."""
    if device.type != "cuda":
        return
    from .accelerators import attention_rates, match_device_name

    acc = match_device_name(torch.cuda.get_device_name(device))
    if acc is None:
        return
    hw.attention_flops = attention_rates(acc)
    hw.attention_kernel = "flash2"
    hw.sources["attention_flops"] = "accelerator table (ATTENTION_EFFICIENCY, flash2), not measured"
    bf16 = hw.matmul_flops.get("bfloat16")
    if "float8" in acc.peak_flops and "float8" not in hw.matmul_flops and bf16 and acc.peak_flops.get("bfloat16"):
        ratio = acc.peak_flops["float8"] / acc.peak_flops["bfloat16"]
        hw.matmul_flops["float8"] = [(f, r * ratio) for f, r in bf16]
        hw.sources["matmul_flops.float8"] = f"measured bf16 curve x {ratio:.2f} (FP8/bf16 datasheet peaks; assumed)"


def _measure_inter(timer, members, local, nodes, backend, sizes, target_s) -> tuple[float, float]:
    """Per-rank bandwidth and per-step latency across nodes: an all-reduce over the ranks of equal local
    rank (every local rank at once, as data parallel across nodes does) at the smallest and the largest
    size, solved for the ring model ``t = 2(g-1) lat + 2(g-1)/g bytes / bw``."""
    partition = [[members[n * local + r] for n in range(nodes)] for r in range(local)]
    pg, ranks, made = _subgroups(partition, backend, members)
    pg = pg if made else timer.group
    (n1, t1), (n2, t2) = mb.collective_points(timer, "all_reduce", [min(sizes), max(sizes)], pg, ranks, target_s)
    if made:
        dist.destroy_process_group(pg)
    steps, factor = 2 * (nodes - 1), 2 * (nodes - 1) / nodes
    inv_bw = max((t2 - t1) / (factor * (n2 - n1)), 1e-15)
    return 1.0 / inv_bw, max(0.0, (t1 - factor * n1 * inv_bw) / steps)


# ------------------------------------------------------------------------------------------------ cache
def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """Where calibration files live (see the module docstring)."""
    if path is not None:
        return Path(path)
    for env in ("TORCHLOOM_CACHE_DIR", "TORCHLOOM_CACHE"):
        if os.environ.get(env):
            return Path(os.environ[env]) / "hardware"
    return Path.home() / ".cache" / "torchloom" / "hardware"


def cache_path(fp: dict[str, Any], ranks_per_node: int, num_nodes: int = 1,
               directory: str | os.PathLike | None = None) -> Path:
    """The cache file for this fingerprint and job layout."""
    nodes = f"-n{num_nodes}" if num_nodes > 1 else ""
    return cache_dir(directory) / f"{fingerprint_hash({**fp, **CALIBRATION_METHOD})}-w{ranks_per_node}{nodes}.json"


def load_cached(path: Path, fp: dict[str, Any], ranks_per_node: int, threads: int,
                num_nodes: int = 1) -> Hardware | None:
    """The cached :class:`Hardware` at ``path`` if it was measured on this machine (same fingerprint) for the
    same ranks per node, nodes and threads per rank; otherwise None, with a warning saying why."""
    if not path.exists():
        return None
    try:
        hw = Hardware.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError) as e:
        warnings.warn(f"calibration cache {path} is unreadable ({type(e).__name__}: {e}); re-measuring.",
                      stacklevel=3)
        return None
    have = (hw.fingerprint, hw.ranks_per_node, hw.num_nodes, hw.threads_per_rank)
    want = (fp, ranks_per_node, num_nodes, threads)
    if have != want:
        diff = _difference(dict(zip(("fingerprint", "ranks_per_node", "num_nodes", "threads_per_rank"), have)),
                           dict(zip(("fingerprint", "ranks_per_node", "num_nodes", "threads_per_rank"), want)))
        warnings.warn(f"calibration cache {path} was measured for another setup ({diff}); re-measuring.",
                      stacklevel=3)
        return None
    if not _current_probe(hw):
        what = "no machine load" if not hw.load.get("probe_flops") else "an older re-check probe (rank 0 alone)"
        warnings.warn(f"calibration cache {path} records {what} (written by an older torchloom): it may "
                      "have been measured while other jobs ran; re-measuring.", stacklevel=3)
        return None
    return hw


def _current_probe(hw: Hardware) -> bool:
    """Whether ``hw`` records its load and a re-check probe of this version (comparable with one now)."""
    return bool(hw.load.get("probe_flops")) and hw.load.get("probe_version") == PROBE_VERSION


def _probe_workers(device: torch.device, ranks_per_node: int) -> int:
    """Threads the re-check probe runs: the job's ranks per node on CPU (their cores), 1 on a GPU."""
    return max(1, int(ranks_per_node)) if device.type == "cpu" else 1


def _probe(device: torch.device, threads: int, workers: int) -> float:
    """The re-check probe (:func:`microbench.layout_matmul_rate`): ``workers`` threads with ``threads``
    intra-op threads each, for :data:`microbench.PROBE_S` seconds; FLOP/s of the slowest worker."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return mb.layout_matmul_rate(device, workers)
    finally:
        torch.set_num_threads(before)


def _probe_record(device: torch.device, flops: float, workers: int, threads: int) -> dict[str, Any]:
    return {"probe_flops": flops, "probe_workers": workers, "probe_version": PROBE_VERSION,
            "probe": f"float32 {mb.PROBE_N.get(device.type, 1024)}^2 matmul for {mb.PROBE_S} s, best call of each "
                     f"of {workers} thread(s) at once ({threads} intra-op thread(s) each), the slowest kept"}


def measure_now(device: torch.device, threads: int, ranks_per_node: int) -> dict[str, Any]:
    """The machine now, as a cached calibration of ``ranks_per_node`` ranks x ``threads`` threads would
    see it, in this process (~:data:`microbench.PROBE_S` s): a :class:`~torchloom.cost.load.LoadWindow`
    around the re-check probe (:func:`_probe`), assessed for the calibration's layout. Returns
    :func:`torchloom.cost.load.assess`'s record plus ``probe_flops``/``probe_workers``; what
    :func:`recheck` compares with the cache. Inside a job every rank calls :func:`_measure_now_in_group`."""
    workers = _probe_workers(device, ranks_per_node)
    window = machine_load.LoadWindow()
    flops = _probe(device, threads, workers)
    now = machine_load.assess([window.finish()], threads, ranks_per_host=ranks_per_node)
    now.update(_probe_record(device, flops, workers, threads))
    return now


def _measure_now_in_group(device: torch.device, threads: int, ranks_per_node: int) -> dict[str, Any] | None:
    """:func:`measure_now` inside a job (collective): every rank opens a load window (their own CPU time is
    theirs, not other processes'), rank 0 runs the probe while the others wait; rank 0 gets the record,
    the others None."""
    workers = _probe_workers(device, ranks_per_node)
    window = machine_load.LoadWindow()
    flops = _probe(device, threads, workers) if dist.get_rank() == 0 else 0.0
    dist.all_reduce(torch.zeros(1, device=device))  # the others wait for the probe inside their windows
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, window.finish())
    if dist.get_rank() != 0:
        return None
    now = machine_load.assess(rows, threads)
    now.update(_probe_record(device, flops, workers, threads))
    return now


def recheck(hw: Hardware, path: Path, now: dict[str, Any]) -> bool:
    """Whether the cached ``hw`` may be used as it is, given the machine ``now`` (:func:`measure_now`'s
    record: the load in the calibration's layout and the re-check probe, compared with
    ``hw.load["probe_flops"]``). Never asks to re-measure on a machine under load now.

    - ``hw`` is provisional (measured under load) and the machine is quiet now -> False (re-measure);
      still under load -> True, with the provisional warning;
    - quiet now and the probe :data:`RECHECK_RATIO` times faster than when calibrated: the cache was
      measured under load that went unnoticed -> False (re-measure), with a warning;
    - under load now, or the probe as much slower: True (kept), with a warning that timings measured now
      (trials, tokens/s, MFU) are disturbed;
    - otherwise True, silently.
    """
    then, flops = float(hw.load.get("probe_flops") or 0.0), float(now.get("probe_flops") or 0.0)
    rates = f"probe {flops / 1e9:.1f} GFLOP/s now, {then / 1e9:.1f} when calibrated"
    quiet = not now.get("under_load")
    if hw.provisional:
        if quiet:
            warnings.warn(f"calibration cache {path} is provisional (measured under load: "
                          f"{machine_load.describe(hw.load)}) and the machine is quiet now "
                          f"({machine_load.describe(now)}; {rates}); re-measuring.", stacklevel=3)
            return False
        warnings.warn(_provisional_note(hw, f"calibration cache {path}") + f" Now: {machine_load.describe(now)}.",
                      stacklevel=3)
        return True
    if then and flops > RECHECK_RATIO * then:
        if quiet:
            warnings.warn(f"calibration cache {path} was measured under load: this machine is {flops / then:.1f}x "
                          f"faster now ({rates}); re-measuring.", stacklevel=3)
            return False
        warnings.warn(f"calibration cache {path} reads low ({rates}), but the machine is under load now "
                      f"({machine_load.describe(now)}): kept; it is re-measured at its first use on a quiet "
                      "machine.", stacklevel=3)
        return True
    if not quiet or (then and flops * RECHECK_RATIO < then):
        why = (f"busy now ({machine_load.describe(now)}; {rates})" if not quiet else
               f"{then / max(flops, 1e-9):.1f}x slower now than when calibrated ({rates}; {machine_load.describe(now)})")
        warnings.warn(f"this machine is {why}: the calibration {path} is kept, but timings measured now (trials, "
                      "tokens/s, MFU) are disturbed.", stacklevel=3)
    return True


def _provisional_note(hw: Hardware, what: str) -> str:
    return (f"{what} is provisional: measured under load ({machine_load.describe(hw.load)}); its rates may read "
            f"low, so predicted step times run long. It is re-measured at its first use on a quiet machine "
            f"(the load is measured, ~{mb.PROBE_S} s, before a cache is used); to force it, on a quiet machine: "
            f"loom calibrate --refresh --nproc {hw.ranks_per_node}")


def _difference(have: dict, want: dict) -> str:
    out = []
    for k in want:
        if isinstance(want[k], dict) and isinstance(have.get(k), dict):
            out += [f"{k}.{kk}: {have[k].get(kk)!r} there, {want[k].get(kk)!r} here"
                    for kk in sorted(set(want[k]) | set(have[k])) if have[k].get(kk) != want[k].get(kk)]
        elif have.get(k) != want[k]:
            out.append(f"{k}: {have.get(k)!r} there, {want[k]!r} here")
    return "; ".join(out)


def save_cache(path: Path, hw: Hardware) -> None:
    """Write ``hw`` to ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(hw.to_dict(), f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def store(path: Path, hw: Hardware) -> bool:
    """Cache ``hw`` at ``path`` unless it is provisional and ``path`` holds a quiet calibration of the same
    setup (that one is kept; a warning says so). A provisional ``hw`` that is cached is warned about.
    Returns whether it was written."""
    if hw.provisional:
        try:
            old = Hardware.from_dict(json.loads(path.read_text())) if path.exists() else None
        except (OSError, ValueError, TypeError, KeyError):
            old = None
        same = old is not None and (old.fingerprint, old.ranks_per_node, old.num_nodes, old.threads_per_rank) == (
            hw.fingerprint, hw.ranks_per_node, hw.num_nodes, hw.threads_per_rank)
        if same and _current_probe(old) and not old.provisional:
            warnings.warn(f"calibration measured under load ({machine_load.describe(hw.load)}) is not cached: "
                          f"{path} holds a quiet one ({old.sources.get('matmul_flops', '')}), kept.", stacklevel=3)
            return False
        warnings.warn(_provisional_note(hw, f"calibration cached at {path}"), stacklevel=3)
    save_cache(path, hw)
    return True


# --------------------------------------------------------------------------------------- entry points
def _standalone_rank(budget_s: float, threads: int, kwargs: dict) -> dict[str, Any] | None:
    """One rank of :func:`local_hardware`'s job (the default group is gloo; on CUDA an NCCL group is added)."""
    torch.set_num_threads(threads)  # torch was imported (unpickling this function) before the env was set
    group = None
    if torch.cuda.is_available():
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        group = dist.new_group(backend="nccl")
    out = measure_in_group(budget_s, group=group, **kwargs)
    return out if dist.get_rank() == 0 else None


def measure_standalone(ranks_per_node: int, budget_s: float = DEFAULT_BUDGET_S, **kwargs) -> Hardware:
    """Start ``ranks_per_node`` local ranks (``OMP_NUM_THREADS`` = :func:`threads_per_rank`) and calibrate."""
    from ..testing.dist import run_ranks

    if torch.cuda.is_available() and ranks_per_node > torch.cuda.device_count():
        raise HardwareError(f"{ranks_per_node} ranks per node but {torch.cuda.device_count()} GPUs here; "
                            "calibrate at most one rank per GPU.")
    threads = threads_per_rank(ranks_per_node)
    env = {"OMP_NUM_THREADS": str(threads), "LOCAL_WORLD_SIZE": str(ranks_per_node)}
    out = run_ranks(_standalone_rank, ranks_per_node, budget_s, threads, kwargs, env=env, timeout=600.0)
    return Hardware.from_dict(out[0])


def local_hardware(ranks_per_node: int = 1, *, refresh: bool = False, cache_dir: str | os.PathLike | None = None,
                   budget_s: float = DEFAULT_BUDGET_S, **measure: Any) -> Hardware:
    """This machine as a job of ``ranks_per_node`` local ranks would see it: the cached calibration when
    :func:`recheck` trusts it against :func:`measure_now` (~0.3 s), or a fresh one (:func:`measure_standalone`,
    then cached by :func:`store`: a provisional one never replaces a quiet one). ``refresh`` re-measures.
    ``measure`` goes to :func:`measure_in_group` (``message_sizes``, ``matmul_sizes``: shorter sweeps for tests).

    Raises:
        HardwareError: ``ranks_per_node`` < 1, or more ranks than GPUs on a CUDA machine.
    """
    if int(ranks_per_node) < 1:
        raise HardwareError(f"ranks_per_node must be >= 1, got {ranks_per_node}.")
    fp = fingerprint()
    path = cache_path(fp, ranks_per_node, 1, cache_dir)
    threads = threads_per_rank(ranks_per_node)
    hw = None if refresh else load_cached(path, fp, ranks_per_node, threads)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if hw is not None and not recheck(hw, path, measure_now(device, threads, ranks_per_node)):
        hw = None
    if hw is None:
        hw = measure_standalone(ranks_per_node, budget_s, **measure)
        hw.sources["cache"] = str(path)
        store(path, hw)
    return hw


def job_hardware(refresh: bool = False, *, cache_dir: str | os.PathLike | None = None,
                 budget_s: float = DEFAULT_BUDGET_S, **measure: Any) -> Hardware:
    """Inside a job (every rank must call): the cached calibration for this machine, backend, ranks per node
    (``$LOCAL_WORLD_SIZE``) and threads when :func:`recheck` trusts it (rank 0 decides, after every rank took
    part in :func:`_measure_now_in_group`), or
    :func:`measure_in_group` on the live group (``measure`` is passed to it). Rank 0 decides and writes the
    cache (:func:`store`); every rank returns the same :class:`Hardware`.

    Raises:
        HardwareError: no initialised process group.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise HardwareError("job_hardware needs an initialised process group; outside a job use "
                            "torchloom.cost.calibrate.local_hardware(ranks_per_node).")
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    threads = torch.get_num_threads()
    cached: Hardware | None = None
    path: Path | None = None
    have = [False]
    if dist.get_rank() == 0:
        fp = fingerprint(backend)
        path = cache_path(fp, local, world // local, cache_dir)
        cached = None if refresh else load_cached(path, fp, local, threads, world // local)
        have = [cached is not None]
    dist.broadcast_object_list(have, src=0, device=device)
    if have[0]:  # a cache to check: every rank takes part in measuring the load now
        now = _measure_now_in_group(device or torch.device("cpu"), threads, local)
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            box = [cached.to_dict() if recheck(cached, path, now) else None]
        dist.broadcast_object_list(box, src=0, device=device)
        if box[0] is not None:
            return Hardware.from_dict(box[0])
    hw = Hardware.from_dict(measure_in_group(budget_s, ranks_per_node=local, **measure))
    path = cache_path(hw.fingerprint, local, world // local, cache_dir)
    hw.sources["cache"] = str(path)
    if dist.get_rank() == 0:
        store(path, hw)
    return hw
