"""``torchloom.notebook_launcher``: run a training function on N CPU (gloo) processes from a Jupyter/IPython kernel,
as ``accelerate.notebook_launcher`` does (docs/launch.md, "Notebooks").

A function defined in a notebook cell lives in ``__main__``, which a spawned process cannot import, so the ranks
are forked from the kernel (as Accelerate does). Forking is refused when CUDA or a process group is initialised in
the kernel (the children would inherit a state they cannot use). The ranks run through
:func:`torchloom.testing.dist.start_ranks`, the machinery of ``run_ranks``: results come back through files and
every rank ends through ``clean_exit``.

Forked ranks run with one intra-op thread each: GNU OpenMP (torch's CPU thread pool) deadlocks in a forked child
whose parent has used it (a matmul with 2 threads hung in the child in a probe; with 1 it finished).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
from typing import Any, Callable

from ..testing.dist import start_ranks


class NotebookLaunchError(RuntimeError):
    """A rank of :func:`notebook_launcher` failed, died or timed out.

    Attributes:
        rank: the rank that failed first (by time; a rank's error is often the cause of its peers').
        traceback: that rank's formatted traceback (or the reason it has none: died, timed out).
        failures: ``{rank: message}`` for every rank that did not return a result.
    """

    def __init__(self, message: str, rank: int, traceback: str, failures: dict[int, str]):
        super().__init__(message)
        self.rank, self.traceback, self.failures = rank, traceback, failures


def notebook_launcher(fn: Callable[..., Any], args: tuple = (), nproc: int = 2, *, kwargs: dict | None = None,
                      timeout: float | None = None, start_method: str | None = None,
                      env: dict[str, str] | None = None, all_ranks: bool = False) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``nproc`` CPU processes with a gloo process group, from a notebook.

    Each rank has ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` set and the default process group initialised (gloo) before ``fn`` runs, so
    ``torchloom.auto_accelerate`` inside ``fn`` joins it. ``fn`` may be defined in the notebook.

    Args:
        fn: the training function; its return value must be picklable (tensors, modules, plain data).
        args / kwargs: passed to ``fn`` on every rank (with fork they are not pickled).
        nproc: number of processes (ranks), >= 1.
        timeout: seconds for the whole run, all ranks together; None (default): no limit (interrupt the kernel
            to stop: the ranks are killed).
        start_method: None (default): ``"fork"`` (works for functions defined in the notebook), or
            ``"spawn"``/``"forkserver"`` for an ``fn`` importable from a module (needed when CUDA is initialised
            in the kernel; its ranks use ``cores // nproc`` threads unless ``OMP_NUM_THREADS`` is set).
        env: extra environment variables for the ranks.
        all_ranks: return ``[result_rank0, result_rank1, ...]`` instead of rank 0's result.

    Returns:
        rank 0's return value (``all_ranks=True``: every rank's, in rank order).

    Raises:
        NotebookLaunchError: a rank raised (the message starts with the rank that failed first and its
            traceback, then lists the others), died without a result, or ran past ``timeout``. Ranks still
            running 10 s after another rank failed are stopped.
        RuntimeError: fork requested (the default) while CUDA or a torch.distributed process group is
            initialised in this process, or ``fn`` defined in a notebook with a spawning ``start_method``.
        ValueError: ``nproc`` is not a positive int, or an unknown ``start_method``.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int (the number of processes), got {nproc!r}.")
    method = _start_method(fn, start_method)
    threads = 1 if method == "fork" else None
    print(f"[torchloom] launching {nproc} processes (gloo, CPU, {method})", file=sys.stderr, flush=True)
    outcomes = start_ranks(_call, nproc, (fn, threads, nproc, tuple(args), dict(kwargs or {})),
                           timeout=float("inf") if timeout is None else float(timeout), env=env,
                           start_method=method, grace_s=10.0)
    failed = [o for o in outcomes if o.status != "ok" or o.exitcode not in (0, None)]
    if failed:
        raise _launch_error(failed, timeout)
    values = [o.value for o in outcomes]
    return values if all_ranks else values[0]


def _call(fn, threads: int | None, nproc: int, args: tuple, kwargs: dict):
    """In each rank: a clean torchloom state (a forked child inherits the kernel's current mesh), the thread
    count (module docstring), then ``fn``."""
    import torch

    from ..parallel.mesh import set_current_mesh

    set_current_mesh(None)
    if threads is not None:
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        from .launcher import usable_cores

        torch.set_num_threads(max(1, usable_cores() // nproc))
    return fn(*args, **kwargs)


def _start_method(fn, requested: str | None) -> str:
    import torch
    import torch.distributed as dist

    methods = mp.get_all_start_methods()
    if requested is not None and requested not in ("fork", "spawn", "forkserver"):
        raise ValueError(f"start_method must be None, 'fork', 'spawn' or 'forkserver', got {requested!r}.")
    method = requested or ("fork" if "fork" in methods else "spawn")
    if method not in methods:
        raise RuntimeError(f"start_method {method!r} is not available on this platform (available: "
                           f"{', '.join(methods)}); put fn in a .py module and pass start_method='spawn'.")
    if method == "fork":
        if torch.cuda.is_initialized():
            raise RuntimeError(
                "CUDA is initialised in this process (a cell put a tensor on the GPU or called torch.cuda), and "
                "forked processes cannot use it. Restart the kernel and keep every CUDA call inside the launched "
                "function, or put the function in a .py module and pass start_method='spawn'.")
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed process group is initialised in this process (did a cell call auto_accelerate "
                "or init_process_group?); forked ranks would inherit it. Call "
                "torch.distributed.destroy_process_group() first, or restart the kernel.")
    elif getattr(fn, "__module__", None) == "__main__" and not hasattr(sys.modules["__main__"], "__file__"):
        raise RuntimeError(
            f"{getattr(fn, '__qualname__', fn)!r} is defined in a notebook (module __main__), which "
            f"{method!r} processes cannot import. Use start_method='fork' (the default), or move the function "
            "into a .py module and import it.")
    return method


def _launch_error(failed, timeout) -> NotebookLaunchError:
    others_failed = any(o.status != "hung" for o in failed)  # then hung ranks were stopped by the grace period

    def message(o) -> str:
        if o.status == "error":
            return o.value
        if o.status == "hung":
            why = "10 s after another rank failed" if others_failed else f"at the timeout of {timeout} s"
            return f"rank {o.rank}: still running {why}; stopped"
        if o.status == "died":
            return f"rank {o.rank}: died without a result ({_describe(o.exitcode)})"
        return f"rank {o.rank}: returned a result but exited with code {o.exitcode}"

    if not others_failed:  # a timeout, no failure
        ranks = ", ".join(str(o.rank) for o in failed)
        text = f"rank(s) {ranks} still running at the timeout of {timeout} s; stopped"
        return NotebookLaunchError(f"notebook_launcher: {text}", failed[0].rank, text,
                                   {o.rank: message(o) for o in failed})
    order = sorted(failed, key=lambda o: (o.finished_ns is None, o.status == "hung", o.finished_ns or 0, o.rank))
    first = order[0]
    text = message(first)
    rest = "".join(f"\n  {message(o).splitlines()[0]}" for o in order[1:])
    summary = text if not rest else f"{text}\nthe other failed ranks (often in reaction to rank {first.rank}):{rest}"
    head = "the first failure: " if len(order) > 1 else ""
    return NotebookLaunchError(f"notebook_launcher: {head}{summary}", first.rank, text,
                               {o.rank: message(o) for o in failed})


def _describe(exitcode: int | None) -> str:
    from .launcher import describe_exit

    return describe_exit(exitcode)
