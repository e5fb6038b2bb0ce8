"""Pre-flight health check: find failing or slow ranks before a job starts.

Every rank runs a short fp32 matmul benchmark (GFLOP/s) and an all-reduce benchmark over the world group
(latency of a 4-byte all-reduce and time of a ``allreduce_mib`` MiB all-reduce, in milliseconds). Results
travel through the rendezvous store (not collectives), so rank 0 can still report a rank that raised or
hung: a rank whose result does not arrive within ``timeout_s`` is reported as ``timeout``. Rank 0
prints a table (rank, host, local rank, GFLOP/s, all-reduce ms, verdict) and publishes it to every rank.

Verdicts: ``ok``; ``slow`` (matmul GFLOP/s < ``threshold`` x the median over ranks); ``failed`` (an
exception, named in the table); ``timeout`` (no result in time). The all-reduce times are printed but not
judged: a collective ends when its slowest member ends, so they are a property of the group.

Entry points: ``loom check`` and ``loom run/train --health-check`` start this module as a torchrun job
(``python -m torchloom.elastic.health``); :func:`run_check` runs it inside an existing process group.

Fault injection for tests only: ``TORCHLOOM_HEALTH_FAULT="RANK:KIND[,RANK:KIND]"`` with KIND ``slow``
(the rank's matmul takes 100x as long), ``fail`` (it raises) or ``hang`` (it blocks until the timeout ends
the process). RANK ``*`` = every rank that sees the variable (set it for one launcher to fault one node). See ``docs/health.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

FAULT_ENV = "TORCHLOOM_HEALTH_FAULT"
OK, SLOW, FAILED, TIMEOUT = "ok", "slow", "failed", "timeout"


@dataclass
class RankResult:
    """One rank's measurements. gflops: fp32 matmul GFLOP/s. allreduce_latency_ms / allreduce_ms: time of
    a 4-byte and of an ``allreduce_mib`` MiB all-reduce (median of the repeats, milliseconds)."""

    rank: int
    host: str = "?"
    local_rank: int = -1
    node: str = "?"
    gflops: float | None = None
    allreduce_latency_ms: float | None = None
    allreduce_ms: float | None = None
    allreduce_gbps: float | None = None
    allreduce_error: str | None = None
    error: str | None = None
    verdict: str = OK


@dataclass
class HealthReport:
    """All ranks' results (``results[r]`` is rank r), the median GFLOP/s and the threshold used."""

    results: list[RankResult]
    threshold: float
    median_gflops: float | None = None
    unhealthy_nodes: list[str] = field(default_factory=list)
    this_node: str | None = None  # the node (torchrun GROUP_RANK) whose local rank 0 wrote this copy

    @property
    def healthy(self) -> bool:
        return all(r.verdict == OK for r in self.results)

    @property
    def unhealthy(self) -> list[RankResult]:
        return [r for r in self.results if r.verdict != OK]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "HealthReport":
        d = json.loads(text)
        return cls(results=[RankResult(**r) for r in d["results"]], threshold=d["threshold"],
                   median_gflops=d.get("median_gflops"), unhealthy_nodes=d.get("unhealthy_nodes", []),
                   this_node=d.get("this_node"))

    @property
    def nodes(self) -> list[str]:
        return sorted({r.node for r in self.results})

    def table(self) -> str:
        """The human-readable report."""
        head = f"{'rank':>4}  {'host':<16} {'local':>5}  {'GFLOP/s':>9}  {'AR lat ms':>9}  {'AR ms':>8}  verdict"
        lines = [head]
        for r in self.results:
            f = lambda v, spec: format(v, spec) if v is not None else format("-", ">" + spec.split(".")[0])  # noqa: E731
            verdict = r.verdict + (f" ({r.error})" if r.error else "")
            lines.append(f"{r.rank:>4}  {r.host[:16]:<16} {r.local_rank:>5}  {f(r.gflops, '9.1f')}  "
                         f"{f(r.allreduce_latency_ms, '9.3f')}  {f(r.allreduce_ms, '8.2f')}  {verdict}")
        med = f"{self.median_gflops:.1f}" if self.median_gflops is not None else "-"
        bad = self.unhealthy
        lines.append(f"median {med} GFLOP/s; slow = below {self.threshold:g} x median; "
                     + ("all ranks healthy" if not bad else
                        f"{len(bad)} unhealthy rank(s): {[r.rank for r in bad]} on node(s) {self.unhealthy_nodes}"))
        return "\n".join(lines)


def judge(results: list[RankResult], threshold: float) -> HealthReport:
    """Give each result its verdict: ``failed``/``timeout`` stay; a rank whose GFLOP/s is below
    ``threshold`` x the median of the measured ranks is ``slow``."""
    stuck = [r.rank for r in results if r.verdict == TIMEOUT]
    for r in results:
        if r.verdict == OK and r.allreduce_error:
            if stuck:  # the all-reduce broke because a rank never joined it: not this rank's fault
                r.error = f"all_reduce aborted waiting for rank(s) {stuck}"
            else:
                r.verdict, r.error = FAILED, f"all_reduce: {r.allreduce_error}"
    measured = [r.gflops for r in results if r.gflops is not None and r.verdict == OK]
    med = statistics.median(measured) if measured else None
    for r in results:
        if r.verdict == OK and r.gflops is not None and med is not None and r.gflops < threshold * med:
            r.verdict = SLOW
            r.error = f"{r.gflops / med:.2f} x median"
    nodes = sorted({r.node for r in results if r.verdict != OK})
    return HealthReport(results=results, threshold=threshold, median_gflops=med, unhealthy_nodes=nodes)


# ------------------------------------------------------------------------------------ benchmarks
def _fault(rank: int) -> str | None:
    spec = os.environ.get(FAULT_ENV, "")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        r, _, kind = item.partition(":")
        if r.strip() in (str(rank), "*"):
            return kind.strip()
    return None


def matmul_gflops(size: int = 512, seconds: float = 0.3, fault: str | None = None) -> float:
    """fp32 ``size`` x ``size`` matmul throughput on this process's CPU, in GFLOP/s (best of repeats for
    about ``seconds`` seconds). ``fault`` is the test hook (``slow``/``fail``/``hang``)."""
    if fault == "fail":
        raise RuntimeError("injected matmul failure (TORCHLOOM_HEALTH_FAULT)")
    if fault == "hang":
        threading.Event().wait()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    torch.mm(a, b)  # warm-up
    best, t_end = float("inf"), time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        c = torch.mm(a, b)
        dt = time.perf_counter() - t
        if fault == "slow":
            time.sleep(dt * 99)  # 100 x as long
            dt *= 100
        best = min(best, dt)
        if time.perf_counter() > t_end:
            break
    if not torch.isfinite(c).all():
        raise RuntimeError("matmul produced non-finite values")
    return 2 * size ** 3 / best / 1e9


def allreduce_ms(numel: int, repeats: int = 5, group=None) -> float:
    """Median time of an all-reduce of ``numel`` fp32 values over ``group``, in milliseconds. Collective."""
    t = torch.ones(numel)
    dist.all_reduce(t, group=group)  # warm-up / connection set-up
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        s = time.perf_counter()
        dist.all_reduce(t, group=group)
        times.append((time.perf_counter() - s) * 1e3)
    return statistics.median(times)


# ------------------------------------------------------------------------------------ the check
def run_check(threshold: float = 0.5, *, timeout_s: float = 60.0, matmul_size: int = 512,
              allreduce_mib: float = 4.0, store=None, prefix: str = "loom_health") -> HealthReport:
    """Run the health check on every rank of the default process group and return the report (the same
    on every rank; rank 0 prints it). Collective: every rank must call it.

    Args:
        threshold: a rank is ``slow`` when its GFLOP/s < ``threshold`` x the median (0 < threshold <= 1).
        timeout_s: seconds rank 0 waits for each rank's result (and the other ranks for the report).
        matmul_size: matrix side of the fp32 matmul benchmark.
        allreduce_mib: size of the bandwidth all-reduce, in MiB.
        store: the key-value store results travel through (None = the default group's store).

    Raises:
        ValueError: ``threshold`` outside (0, 1].
        RuntimeError: the report did not arrive from rank 0 within ``timeout_s`` (rank 0 itself failed).
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"health-check threshold must be in (0, 1] (a fraction of the median), got {threshold}")
    rank, world = dist.get_rank(), dist.get_world_size()
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    host = socket.gethostname()
    node = os.environ.get("GROUP_RANK", host)  # torchrun's node rank
    res = RankResult(rank=rank, host=host, local_rank=local_rank, node=str(node))
    store.set(f"{prefix}/id{rank}", json.dumps([host, local_rank, str(node)]))  # names a rank that then hangs
    fault = _fault(rank)
    try:
        res.gflops = matmul_gflops(matmul_size, fault=fault)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        res.error, res.verdict = f"{type(e).__name__}: {e}", FAILED
    try:
        res.allreduce_latency_ms = allreduce_ms(1)
        n = max(1, int(allreduce_mib * 2 ** 20 / 4))
        res.allreduce_ms = allreduce_ms(n)
        res.allreduce_gbps = n * 4 / (res.allreduce_ms / 1e3) / 1e9
    except Exception as e:  # noqa: BLE001 - a collective that timed out or broke: judged on rank 0
        res.allreduce_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    store.set(f"{prefix}/rank{rank}", json.dumps(asdict(res)))
    if rank == 0:
        results = []
        deadline = time.monotonic() + timeout_s
        for r in range(world):
            key = f"{prefix}/rank{r}"
            try:
                left = max(0.1, deadline - time.monotonic())
                store.wait([key], timedelta(seconds=left))
                results.append(RankResult(**json.loads(store.get(key))))
            except Exception:  # noqa: BLE001 - the store's wait timed out
                who = RankResult(rank=r, verdict=TIMEOUT, error=f"no result within {timeout_s:g} s")
                if store.check([f"{prefix}/id{r}"]):
                    who.host, who.local_rank, who.node = json.loads(store.get(f"{prefix}/id{r}"))
                results.append(who)
        report = judge(results, threshold)
        store.set(f"{prefix}/report", report.to_json())
        print("[loom check]\n" + report.table(), flush=True)
        # rank 0's worker may host the store: wait (bounded) until the others have read the report
        readers = sum(1 for r in results[1:] if r.verdict != TIMEOUT)
        deadline = time.monotonic() + timeout_s
        while store.add(f"{prefix}/read", 0) < readers and time.monotonic() < deadline:
            time.sleep(0.01)
        return report
    try:
        store.wait([f"{prefix}/report"], timedelta(seconds=timeout_s * 2 + 10))
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"health check: rank {rank} got no report from rank 0 within "
                           f"{timeout_s * 2 + 10:g} s; see rank 0's output") from e
    report = HealthReport.from_json(store.get(f"{prefix}/report").decode())
    store.add(f"{prefix}/read", 1)
    return report


# ------------------------------------------------------------------------------ worker entry point
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torchloom.elastic.health",
                                description="torchloom health check worker (run by `loom check`).")
    p.add_argument("--threshold", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds")
    p.add_argument("--matmul-size", type=int, default=512)
    p.add_argument("--allreduce-mib", type=float, default=4.0)
    p.add_argument("--report", default=None, help="file the node's local rank 0 writes the JSON report to")
    return p


def main(argv: list[str] | None = None) -> None:
    """Worker: join the group, run the check, write the report (local rank 0), exit 0. A rank that cannot
    finish (a hang) is ended by a timer with exit code 124 after 2 x timeout + 30 s."""
    from .shutdown import clean_exit

    a = parser().parse_args(argv)
    done = threading.Event()
    code = 0
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
        threading.Thread(target=_leave_if_stuck, args=(dist.distributed_c10d._get_default_store().clone(),
                                                       a.timeout, done), daemon=True).start()
        report = run_check(a.threshold, timeout_s=a.timeout, matmul_size=a.matmul_size,
                           allreduce_mib=a.allreduce_mib)
        if a.report and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            report.this_node = os.environ.get("GROUP_RANK", socket.gethostname())
            tmp = Path(a.report + ".tmp")
            tmp.write_text(report.to_json())
            os.replace(tmp, a.report)
    except BaseException as e:  # noqa: BLE001
        print(f"[loom check] rank {os.environ.get('RANK')}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 1
    done.set()
    clean_exit(code)


def _leave_if_stuck(store, timeout_s: float, done: threading.Event, prefix: str = "loom_health") -> None:
    """Watcher thread of a check worker: once rank 0 has published the report (or 2 x timeout + 10 s
    passed), give this rank 5 s to finish, else leave with exit code 124 (it is stuck, e.g. in a hung
    device call, and was reported as ``timeout``)."""
    try:
        store.wait([f"{prefix}/report"], timedelta(seconds=timeout_s * 2 + 10))
    except Exception:  # noqa: BLE001 - no report: rank 0 is gone or stuck too
        pass
    if not done.wait(5.0):
        print(f"[loom check] rank {os.environ.get('RANK')}: stuck after the report; exiting with code 124",
              file=sys.stderr, flush=True)
        os._exit(124)


def launch_check(opts, *, threshold: float = 0.5, timeout_s: float = 60.0) -> tuple[int, "HealthReport | None"]:
    """Run the check as its own torchrun job with the launch options ``opts`` (a
    :class:`~torchloom.elastic.launcher.LaunchOptions`; no restarts; ``rdzv_id`` gets a ``-health``
    suffix so it never meets the job's rendezvous). Returns (the check job's exit code, this node's copy of
    the report or None when none was written)."""
    import dataclasses
    import tempfile

    o = dataclasses.replace(opts, max_restarts=0,
                            rdzv_id=None if opts.rdzv_id is None else f"{opts.rdzv_id}-health")
    with tempfile.TemporaryDirectory(prefix="loom_check_") as d:
        path = str(Path(d) / "report.json")
        args = ["--threshold", str(threshold), "--timeout", str(timeout_s), "--report", path]
        # its own process: torchrun's agent leaves rendezvous state (a c10d store client or server on the
        # endpoint) in the process that ran it, and the job's rendezvous on the same endpoint comes next
        import multiprocessing as mp

        proc = mp.get_context("spawn").Process(target=_run_check_job, args=(o, args), name="loom-check")
        proc.start()
        proc.join()
        code = proc.exitcode if proc.exitcode is not None else 1
        return (128 - code if code < 0 else code), read_report(path)


def _run_check_job(opts, args: list[str]) -> None:
    from . import launcher
    from .shutdown import clean_exit

    clean_exit(launcher.run(opts, "torchloom.elastic.health", args, module=True))


def preflight(opts, *, threshold: float = 0.5, timeout_s: float = 60.0, exclude_unhealthy: bool = False) -> int:
    """The ``--health-check`` gate before a ``loom run``/``loom train`` job on this node. Returns 0 when the
    job may start here, else the exit code to leave with (messages go to stderr).

    Without ``exclude_unhealthy`` any unhealthy rank refuses the job (on every node). With it (only with an
    elastic ``--nnodes MIN:MAX``) a node holding an unhealthy rank leaves (code 3) and the healthy nodes
    start, as long as there are at least MIN of them: the c10d rendezvous forms with the nodes that join.

    Raises:
        ValueError: ``exclude_unhealthy`` without an elastic ``--nnodes MIN:MAX`` range.
    """
    lo = str(opts.nnodes).split(":")[0]
    if exclude_unhealthy and ":" not in str(opts.nnodes):
        raise ValueError("--exclude-unhealthy needs an elastic --nnodes MIN:MAX range (a node that fails the "
                         "check leaves and the rendezvous forms without it); a fixed --nnodes cannot start "
                         "without a node, and ranks within a node cannot be excluded.")
    code, report = launch_check(opts, threshold=threshold, timeout_s=timeout_s)
    say = lambda m: print(f"[loom check] {m}", file=sys.stderr, flush=True)  # noqa: E731
    if report is None:
        say(f"the health check failed to produce a report (exit code {code}); the job does not start. Run "
            "`loom check` with the same options to see why.")
        return code or 1
    if report.healthy:
        return 0
    bad = [r.rank for r in report.unhealthy]
    if not exclude_unhealthy:
        say(f"unhealthy rank(s) {bad} on node(s) {report.unhealthy_nodes}: the job does not start. Fix or "
            "replace them, raise --health-threshold, or with an elastic --nnodes MIN:MAX use "
            "--exclude-unhealthy to start without those nodes.")
        return 1
    if report.this_node in report.unhealthy_nodes:
        say(f"this node ({report.this_node}) failed the health check (rank(s) {bad}); it leaves so the job "
            "can start on the healthy nodes.")
        return 3
    healthy = len(report.nodes) - len(report.unhealthy_nodes)
    if healthy < int(lo):
        say(f"only {healthy} healthy node(s), fewer than the minimum --nnodes {lo}: the job does not start.")
        return 1
    say(f"excluding node(s) {report.unhealthy_nodes}; starting on {healthy} healthy node(s).")
    return 0


def read_report(path: str | Path) -> HealthReport | None:
    """The report a health-check job wrote to ``path``, or None when none was written."""
    try:
        return HealthReport.from_json(Path(path).read_text())
    except (OSError, ValueError, KeyError):
        return None


if __name__ == "__main__":
    main()
