"""Timed micro-benchmarks that every rank of a process group runs at the same moment.

Used by :mod:`torchloom.cost.calibrate`. Ranks that share a machine also share its cores and memory
channels, so each number here is measured with **all ranks working at once** and is the time the *slowest*
rank took (a training step waits for its slowest rank): per-rank matmul FLOP/s by GEMM size and dtype,
memory bandwidth, per-op dispatch overhead, and collective times by message size and group size — groups
smaller than the world run side by side (two groups of 2 in a world of 4, as ``dp x tp`` does).

Every rank runs the same number of repetitions (collectives must match): each measurement times one call on
every rank, agrees on the slowest (all-reduce MAX), and derives the repetition count from the time budget.
On CUDA, timing brackets the work with ``torch.cuda.synchronize``.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

KiB, MiB = 1 << 10, 1 << 20
MESSAGE_SIZES = {"cpu": (4 * KiB, 64 * KiB, MiB, 8 * MiB, 64 * MiB),
                 "cuda": (4 * KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB)}  # NCCL saturates only at 100s of MiB
MATMUL_SIZES = {"cpu": (64, 128, 256, 512, 1024), "cuda": (256, 1024, 2048, 4096, 8192)}
STREAM_BYTES = {"cpu": 64 * MiB, "cuda": 1024 * MiB}  # per tensor: well beyond the last-level cache
MAX_REPS = 200
_clock = time.perf_counter  # every timing below reads this (tests script it)


class Timer:
    """Times a callable on every rank of ``group`` at once and agrees on the slowest rank's time."""

    def __init__(self, device: torch.device, group=None, min_chunk_s: float = 0.0):
        self.device, self.group = device, group
        #: when > 0 every timed chunk lasts at least this long and the single probe call does not count: ranks that
        #: oversubscribe the cores (4 single-threaded ranks on 2) get ~1/oversubscription of a core in a step, but a
        #: chunk shorter than a scheduler time slice runs while its co-tenant is descheduled and reads an
        #: uncontended core (small GEMMs measured 78-80 GFLOP/s per rank at 4 ranks on 2 cores, as at 2 ranks;
        #: GEMMs long enough to span slices 44)
        self.min_chunk_s = min_chunk_s
        self._flag = torch.zeros(1, dtype=torch.float64, device=device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def slowest(self, seconds: float) -> float:
        """The largest of every rank's ``seconds`` (also lines the ranks up for the next measurement)."""
        self._flag.fill_(seconds)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group)
        return float(self._flag.item())

    def _run(self, fn: Callable[[], object], reps: int) -> float:
        self._sync()
        t = _clock()
        for _ in range(reps):
            fn()
        self._sync()
        return _clock() - t

    def per_call(self, fn: Callable[[], object], target_s: float, warmup: bool = True, samples: int = 2) -> float:
        """Seconds per call of ``fn`` with every rank calling it at once (the slowest rank's time).

        An untimed warm-up call (first-call allocation, lazy communicator set-up) unless ``warmup`` is False,
        one timed probe call that sizes the loop, then ``target_s`` worth of calls split into up to three
        chunks (at least ``samples - 1``); the fastest of the probe and the chunks wins (the least disturbed by
        other processes: load only ever adds time). When the probe alone spends ``target_s``, ``samples - 1``
        more single calls are timed: best of ``samples`` (at least 2)."""
        if warmup:
            fn()
        probe = self.slowest(self._run(fn, 1))
        extra = max(1, samples - 1)
        if self.min_chunk_s > 0 and probe < self.min_chunk_s:  # oversubscribed: chunks spanning time slices only
            per = int(math.ceil(self.min_chunk_s / max(probe, 1e-9)))
            chunks = max(2, extra)
            return min(self.slowest(self._run(fn, per)) / per for _ in range(chunks))
        if probe >= target_s:  # one call spends the budget (large GEMMs, messages): best of `samples` calls
            return min([probe] + [self.slowest(self._run(fn, 1)) for _ in range(extra)])
        reps = int(max(1, min(MAX_REPS, target_s / max(probe, 1e-9))))
        chunks = max(min(3, reps), extra)
        per = max(1, reps // chunks)
        return min([probe] + [self.slowest(self._run(fn, per)) / per for _ in range(chunks)])


# ----------------------------------------------------------------------------------------------- compute
MATMUL_SAMPLES = 3  # best of at least 3 timings per GEMM size: one disturbed timing does not set the rate


def matmul_rates(timer: Timer, dtype: torch.dtype, sizes, target_s: float) -> list[tuple[float, float]]:
    """``(gemm_flops, flop_per_s)`` per rank for square ``n x n @ n x n`` GEMMs (FLOPs = 2 n^3), each the
    best of at least :data:`MATMUL_SAMPLES` timings. The right operand is a transposed weight, ``x @ W^T``, as
    ``nn.Linear`` computes it: on CPUs without native bf16 the library's packed path for that layout is ~6x
    faster in bf16 than a plain ``a @ b`` (measured 5.8 vs 0.9 GFLOP/s on this build machine's AMD EPYC, one
    thread, 1024x256 @ 256x768), and the training step runs the former."""
    out = []
    for n in sizes:
        a = torch.randn(n, n, device=timer.device).to(dtype)
        w = torch.randn(n, n, device=timer.device).to(dtype)
        c = torch.empty(n, n, device=timer.device, dtype=dtype)
        flops = 2.0 * n ** 3
        out.append((flops, flops / timer.per_call(lambda: torch.mm(a, w.t(), out=c), target_s,
                                                  samples=MATMUL_SAMPLES)))
    return out


#: the square size the backward's GEMM layouts are compared at (``backward_gemm_factor``)
BACKWARD_LAYOUT_N = {"cpu": 256, "cuda": 4096}


def backward_gemm_factor(timer: Timer, dtype: torch.dtype, n: int, target_s: float) -> float:
    """How much longer a ``Linear``'s backward GEMMs take than the forward's at the same FLOPs:
    ``(t(dY @ W) + t(dY^T @ X)) / (2 t(X @ W^T))`` for ``n x n`` operands (the input gradient multiplies by the
    weight as stored, a plain ``a @ b``; the weight gradient by a transposed left operand). 1 where the library
    treats the layouts alike (cuBLAS; fp32 on CPU); on CPUs without native bf16 the plain layout runs ~6x
    slower than the packed ``x @ W^T`` path (measured on the build machine's AMD EPYC, one thread, bf16: 1.1,
    20 and 6-9 GFLOP/s for input gradient, weight gradient and forward): the backward then costs ~3x the
    forward's GEMM time per FLOP, which the forward-layout sweep alone (``matmul_rates``) cannot see."""
    x = torch.randn(n, n, device=timer.device).to(dtype)
    w = torch.randn(n, n, device=timer.device).to(dtype)
    dy = torch.randn(n, n, device=timer.device).to(dtype)
    c = torch.empty(n, n, device=timer.device, dtype=dtype)
    t = [timer.per_call(fn, target_s / 3, samples=MATMUL_SAMPLES)
         for fn in (lambda: torch.mm(x, w.t(), out=c), lambda: torch.mm(dy, w, out=c),
                    lambda: torch.mm(dy.t(), x, out=c))]
    return (t[1] + t[2]) / (2 * t[0]) if t[0] > 0 else 1.0


PROBE_N = {"cpu": 512, "cuda": 4096}  # the re-check probe's GEMM: ~10 ms on a CPU core, ~0.2 ms on a GPU
PROBE_S = 0.3  # the re-check probe's duration (and the load window around it): /proc/stat ticks are 10 ms
_mm = torch.mm  # every probe GEMM calls this (tests count and pace the calls)


def solo_matmul_rate(device: torch.device, dtype: torch.dtype = torch.float32, n: int | None = None,
                     seconds: float = 0.1, samples: int = 3, max_samples: int = 50,
                     start: threading.Barrier | None = None) -> float:
    """FLOP/s of ``n x n @ n x n`` (default :data:`PROBE_N`) in this thread alone (no process group): one
    untimed call, then single calls timed until ``seconds`` have passed and at least ``samples`` were timed
    (at most ``max_samples``); the fastest wins (load only ever adds time). The train job's peak benchmark
    and each worker of :func:`layout_matmul_rate`. ``start``: a barrier passed after the untimed call, so
    that several workers time at the same moment. The operands come from an own generator: the global
    random stream (a training run's) is left as it was."""
    n = int(n or PROBE_N.get(device.type, 1024))
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    _mm(a, b, out=c)
    sync()
    if start is not None:
        start.wait()
    best, timed = float("inf"), 0
    deadline = _clock() + seconds
    while timed < max_samples and (timed < samples or _clock() < deadline):
        t = _clock()
        _mm(a, b, out=c)
        sync()
        best = min(best, _clock() - t)
        timed += 1
    return 2.0 * n ** 3 / max(best, 1e-12)


def layout_matmul_rate(device: torch.device, workers: int = 1, dtype: torch.dtype = torch.float32,
                       n: int | None = None, seconds: float = PROBE_S) -> float:
    """The calibration's re-check probe: FLOP/s per worker of ``n x n`` GEMMs (default :data:`PROBE_N`)
    with ``workers`` threads of this process computing **at the same moment** for ``seconds`` (each with
    the caller's intra-op threads: ``workers x threads`` cores busy, as a job of ``workers`` ranks), each
    the best of its single-call timings; the slowest worker's rate is returned (a step waits for its
    slowest rank). One worker alone hardly notices other processes on a machine with free cores (the
    scheduler finds it a core for its short calls); all of the job's workers at once are slowed as the
    job's ranks are. On CUDA one worker on ``device`` (each rank has its own GPU)."""
    workers = max(1, int(workers)) if device.type == "cpu" else 1
    if workers == 1:
        return solo_matmul_rate(device, dtype, n, seconds, max_samples=10_000)
    start = threading.Barrier(workers)
    rates, errors = [0.0] * workers, []

    def work(i: int) -> None:
        try:
            rates[i] = solo_matmul_rate(device, dtype, n, seconds, max_samples=10_000, start=start)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)
            start.abort()

    pool = [threading.Thread(target=work, args=(i,), name=f"torchloom-probe-{i}", daemon=True)
            for i in range(workers)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        raise (real or errors)[0]
    return min(rates)


def memory_bandwidth(timer: Timer, nbytes: int, target_s: float) -> float:
    """Bytes/s per rank of a large elementwise add ``c = a + b`` (reads 2, writes 1 tensor of ``nbytes``)."""
    n = nbytes // 4
    a, b = torch.ones(n, device=timer.device), torch.ones(n, device=timer.device)
    c = torch.empty_like(a)
    return 3.0 * n * 4 / timer.per_call(lambda: torch.add(a, b, out=c), target_s)


def op_overhead(timer: Timer, target_s: float, ops: int = 200) -> float:
    """Seconds per dispatched tiny op (an in-place add on 8 elements: all dispatch, no work)."""
    x = torch.zeros(8, device=timer.device)

    def loop():
        for _ in range(ops):
            x.add_(1.0)

    return timer.per_call(loop, target_s) / ops


# ------------------------------------------------------------------------------------------- collectives
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def message_numel(nbytes: int, g: int) -> int:
    """fp32 elements of a ``nbytes`` message, rounded down to a multiple of the group size ``g``."""
    return max(g, (nbytes // 4) // g * g)


def collective_call(kind: str, nbytes: int, group, ranks: list[int], device: torch.device) -> Callable[[], None]:
    """A callable running one ``kind`` collective of ``nbytes`` per rank (the contract's byte convention:
    the all-reduced tensor, the all-gather *output*, the reduce-scatter *input*, the all-to-all input, the
    broadcast tensor, the tensor each rank sends) over ``group`` (global ``ranks``, this rank among them).

    ``send_recv`` is a ring shift: every rank sends to the next and receives from the previous one at once
    (pipeline stages exchange activations and gradients concurrently in steady state)."""
    g = len(ranks)
    n = message_numel(nbytes, g)
    z = lambda k: torch.zeros(k, device=device)  # noqa: E731
    if kind == "all_reduce":
        x = z(n)
        return lambda: dist.all_reduce(x, group=group)
    if kind == "all_gather":
        out, inp = z(n), z(n // g)
        return lambda: _all_gather(out, inp, group=group)
    if kind == "reduce_scatter":
        inp, out = z(n), z(n // g)
        return lambda: _reduce_scatter(out, inp, group=group)
    if kind == "all_to_all":
        inp, out = z(n), z(n)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    if kind == "broadcast":
        x = z(n)
        return lambda: dist.broadcast(x, src=ranks[0], group=group)
    if kind == "send_recv":
        me = ranks.index(dist.get_rank())
        nxt, prv = ranks[(me + 1) % g], ranks[(me - 1) % g]
        x, y = z(n), z(n)

        ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, y, prv, group)]

        def shift():  # batched: on NCCL a separate send and receive with the same peer would deadlock
            for r in dist.batch_isend_irecv(ops):
                r.wait()

        return shift
    raise ValueError(f"unknown collective {kind!r}")


def collective_points(timer: Timer, kind: str, sizes, group, ranks: list[int],
                      target_s: float) -> list[tuple[float, float]]:
    """``(bytes, seconds)`` for each message size, ascending (every group of the partition running at once).

    Only the smallest size gets a warm-up call (it sets up the connections; at larger sizes the probe call
    suffices). Times are then made non-decreasing in size by a suffix minimum: a larger message cannot be
    faster, and on a shared machine the noise only ever adds time."""
    pts = []
    for i, s in enumerate(sorted(sizes)):
        fn = collective_call(kind, s, group, ranks, timer.device)
        pts.append((4.0 * message_numel(s, len(ranks)), timer.per_call(fn, target_s, warmup=i == 0)))
    for i in range(len(pts) - 2, -1, -1):
        pts[i] = (pts[i][0], min(pts[i][1], pts[i + 1][1]))
    return pts
