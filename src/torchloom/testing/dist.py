"""Run a function on N gloo ranks (CPU) and return each rank's result to the caller.

Why not ``torch.multiprocessing.spawn``: a rank that used FSDP on gloo can abort at interpreter exit on
this torch build (``terminate called without an active exception``). Each rank here ends with
:func:`torchloom.elastic.shutdown.clean_exit`, which destroys the process group, flushes and leaves with
``os._exit`` so a correct run always exits 0, and results travel back through files, not pipes.

Ranks start from a forkserver that has imported torch, torchloom and (when installed) transformers once
(:data:`PRELOAD`): a spawned rank re-imports them, 3-5 s of CPU each on a small machine, which dominated the
test suite. A rank still sees the caller's environment, working directory and ``sys.path`` as of the launch,
as a spawned one would (the environment is re-applied in the rank; ``multiprocessing`` carries the other two).
``start_method="spawn"`` (or ``TORCHLOOM_START_METHOD=spawn``) gives fresh interpreters.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


#: ports :func:`free_port` draws from: below Linux's ephemeral range (32768-60999), which ``bind(0)`` and
#: outgoing connections draw from, split into one block per pytest-xdist worker, so two test processes (or a
#: connection's source port) never pick the same port between its check and its use
PORT_BASE, PORT_BLOCK = 10000, 2500


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now.

    Under pytest-xdist (``PYTEST_XDIST_WORKER=gwN``) it is drawn at random from worker N's own block of
    :data:`PORT_BLOCK` ports starting at :data:`PORT_BASE` (8 blocks, then they repeat): a port that was free
    when checked is taken by the rank that asked for it, not by another worker's launch in the meantime.
    Elsewhere, and when no port of the block is free, the kernel picks one (``bind(0)``)."""
    import random

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        base = PORT_BASE + (int(worker[2:]) % 8) * PORT_BLOCK
        for port in random.sample(range(base, base + PORT_BLOCK), 50):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the forkserver, inherited by every rank it forks. Importing them starts no thread (with
# OMP_NUM_THREADS=1 or not: libgomp starts its pool at the first parallel region), so forking is safe.
PRELOAD = ("torch", "torch.distributed", "torchloom", "torchloom.api", "transformers")
_preloaded_contexts: set[int] = set()


def _context(start_method: str | None):
    """The multiprocessing context of ``start_method`` (None: ``$TORCHLOOM_START_METHOD``, else forkserver where
    the platform has it, else spawn); a forkserver context preloads :data:`PRELOAD` (modules that are not
    installed are skipped by ``multiprocessing``)."""
    method = start_method or os.environ.get("TORCHLOOM_START_METHOD") or (
        "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    ctx = mp.get_context(method)
    if method == "forkserver" and id(ctx) not in _preloaded_contexts:
        ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server starts (the first launch)
        _preloaded_contexts.add(id(ctx))
    return ctx


def _worker(fn, rank, world_size, port, outdir, args, kwargs, env, caller_env=None):
    if caller_env is not None:  # a forked rank starts with the forkserver's environment: take the caller's
        os.environ.clear()
        os.environ.update(caller_env)
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    import torch.distributed as dist

    from torchloom.elastic.shutdown import clean_exit

    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(*args, **kwargs)
        payload = ("ok", result)
    except BaseException as e:  # noqa: BLE001 - report every failure to the parent
        payload = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        code = 1
    try:
        data = pickle.dumps(payload)
    except Exception as e:  # noqa: BLE001 - an unpicklable result must still reach the parent as an error
        data = pickle.dumps(("error", f"rank {rank}: the result of {getattr(fn, '__qualname__', fn)!r} cannot be "
                                      f"pickled ({type(e).__name__}: {e}); return plain data, tensors or modules."))
        code = 1
    tmp = Path(outdir) / f"rank{rank}.pkl.tmp"
    tmp.write_bytes(data)
    tmp.rename(tmp.with_suffix(""))  # the parent never reads a half-written result
    clean_exit(code)


FAILURE_GRACE_S = 120.0  # after one rank fails, how long the others get to finish (they may be stuck in a collective)


def _wait_all(procs: list, timeout: float, grace_s: float = FAILURE_GRACE_S) -> None:
    """Wait until every process has exited, ``timeout`` seconds in all (one deadline, not one per process), or
    until ``grace_s`` after the first rank exited with an error: its peers are then usually blocked in
    a collective that can never complete, and waiting the whole timeout would only delay the report."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while alive := [p for p in procs if p.is_alive()]:
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (0, None) for p in procs):
            failed_at = now
        if now >= deadline or (failed_at is not None and now - failed_at >= grace_s):
            return
        alive[0].join(0.2)  # returns at once if it has exited since the list was taken


@dataclass
class RankOutcome:
    """How one rank of :func:`start_ranks` ended.

    status: ``"ok"`` (``value`` is fn's result), ``"error"`` (``value`` is ``"rank R: Type: message\n<traceback>"``),
    ``"hung"`` (still running at the deadline; stopped) or ``"died"`` (exited without a result).
    exitcode: the process's exit status (negative: killed by that signal). finished_ns: when the rank wrote
    its result (the file's mtime), None without one; it orders failures in time.
    """

    rank: int
    status: str
    value: Any = None
    exitcode: int | None = None
    finished_ns: int | None = None


def start_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), kwargs: dict | None = None, *,
                timeout: float = 300.0, env: dict[str, str] | None = None, start_method: str | None = None,
                grace_s: float = FAILURE_GRACE_S) -> list[RankOutcome]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks (``start_method`` processes, each ending through
    ``clean_exit``; None: a forkserver with torch and torchloom preloaded, see the module docstring); return
    every rank's :class:`RankOutcome`. Never raises for a rank's failure. Ranks still running at ``timeout``
    seconds (all ranks together), or ``grace_s`` after another rank failed, are killed; so are all of them
    when the caller is interrupted (KeyboardInterrupt is re-raised)."""
    ctx = _context(start_method)
    caller_env = dict(os.environ) if ctx.get_start_method() == "forkserver" else None
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="loom_ranks_") as outdir:
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, port, outdir, args, kwargs or {}, env or {},
                                              caller_env))
            for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            _wait_all(procs, timeout, grace_s)
        finally:
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        outcomes = []
        for r, p in enumerate(procs):
            out = Path(outdir) / f"rank{r}.pkl"
            if not out.exists():
                outcomes.append(RankOutcome(r, "hung" if r in hung else "died", None, p.exitcode))
                continue
            with open(out, "rb") as f:
                status, value = pickle.load(f)
            outcomes.append(RankOutcome(r, status, value, p.exitcode, out.stat().st_mtime_ns))
        return outcomes


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return ``[result_rank0, ...]``.

    ``fn`` must be importable (a module-level function) and its result picklable (move tensors to CPU).
    The default process group is initialised before ``fn`` runs.

    Raises:
        RuntimeError: a rank raised (its traceback is included), died, or ran past ``timeout`` seconds (all
            ranks together; ranks still running ``FAILURE_GRACE_S`` after another rank failed are stopped).
    """
    errors, results = [], []
    for o in start_ranks(fn, world_size, args, kwargs, timeout=timeout, env=env):
        if o.status in ("hung", "died"):
            state = "hung (timeout)" if o.status == "hung" else f"died with exit code {o.exitcode}"
            errors.append(f"rank {o.rank} {state} without a result")
            continue
        if o.status == "error":
            errors.append(o.value)
        else:
            results.append(o.value)
        if o.exitcode not in (0, None) and o.status == "ok":
            errors.append(f"rank {o.rank} returned a result but exited with code {o.exitcode}")
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return results
