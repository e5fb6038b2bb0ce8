"""Run a function on N gloo ranks (CPU) and return each rank's result to the caller.

Why not ``torch.multiprocessing.spawn``: a rank that used FSDP on gloo can abort at interpreter exit on
this torch build (``terminate called without an active exception``). Each rank here ends with
:func:`torchloom.elastic.shutdown.clean_exit`, which destroys the process group, flushes and leaves with
``os._exit`` so a correct run always exits 0, and results travel back through files, not pipes.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, outdir, args, kwargs, env):
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
    with open(Path(outdir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(payload, f)
    clean_exit(code)


FAILURE_GRACE_S = 120.0  # after one rank fails, how long the others get to finish (they may be stuck in a collective)


def _wait_all(procs: list, timeout: float) -> None:
    """Wait until every process has exited, ``timeout`` seconds in all (one deadline, not one per process), or
    until ``FAILURE_GRACE_S`` after the first rank exited with an error: its peers are then usually blocked in
    a collective that can never complete, and waiting the whole timeout would only delay the report."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while alive := [p for p in procs if p.is_alive()]:
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (0, None) for p in procs):
            failed_at = now
        if now >= deadline or (failed_at is not None and now - failed_at >= FAILURE_GRACE_S):
            return
        alive[0].join(0.2)  # returns at once if it has exited since the list was taken


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
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="loom_ranks_") as outdir:
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, port, outdir, args, kwargs, env or {}))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        _wait_all(procs, timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors, results = [], []
        for r, p in enumerate(procs):
            out = Path(outdir) / f"rank{r}.pkl"
            if not out.exists():
                state = "hung (timeout)" if r in hung else f"died with exit code {p.exitcode}"
                errors.append(f"rank {r} {state} without a result")
                continue
            with open(out, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(value)
            else:
                results.append(value)
            if p.exitcode not in (0, None) and status == "ok":
                errors.append(f"rank {r} returned a result but exited with code {p.exitcode}")
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
        return results
