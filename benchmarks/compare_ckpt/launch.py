"""Starts the ranks of one worker phase as separate sessions (like torchrun's worker group) and kills
them like a failed job (SIGKILL to each rank's process group)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], nproc: int, logdir: Path, tag: str, threads: int,
          run_id: str | None = None) -> list[subprocess.Popen]:
    """``nproc`` ranks of ``python -m benchmarks.compare_ckpt.worker ARGS``, stdout+stderr to
    ``logdir/<tag>.rank<r>.log``; ``threads`` intra-op threads per rank. Each launch gets its own
    ``TORCHELASTIC_RUN_ID``: DLRover keys its local sockets by it (``/tmp/ckpt_sock/<run id>/``), and a
    saver that died leaves its socket files behind, so a later job with the same id fails to connect
    (``ConnectionRefusedError``, seen here with a shared id). ``run_id``: reuse a job's id (a restart of
    that job, as torchelastic keeps it)."""
    port = free_port()
    run_id = run_id or f"bench-{tag}-{port}"    # unique per job, as `torchrun --rdzv-id=<unique>` gives
    procs = []
    t_spawn = time.time()
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1", NODE_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads),
                   BENCH_T_SPAWN=repr(t_spawn), TORCHELASTIC_RUN_ID=run_id,
                   PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
        log = open(logdir / f"{tag}.rank{r}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.compare_ckpt.worker", *args],
                                      cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def wait(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Exit codes (``None``: still running at the deadline, then killed)."""
    end = time.time() + timeout
    for p in procs:
        try:
            p.wait(max(1.0, end - time.time()))
        except subprocess.TimeoutExpired:
            pass
    codes = [p.poll() for p in procs]
    kill(procs)
    return codes


def kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each rank's process group (its own children die too; a process that started its own
    session, like torchloom's saver, is not in it)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()


def tail(logdir: Path, tag: str, nproc: int, n: int = 2500) -> str:
    return "\n".join(f"--- rank {r} ---\n" + (logdir / f"{tag}.rank{r}.log").read_text()[-n:]
                     for r in range(nproc))


def leftovers(pids: list[int]) -> list[str]:
    """Shared-memory and socket files a killed run left behind that belong to this benchmark: DCP
    process mode's ``/dev/shm/torch_<pid>_*`` of the given (killed) ranks, DLRover's machine-wide
    ``/dev/shm/<run id>_ckpt_shm_*`` and its ``/tmp/ckpt_sock/bench-*`` sockets
    (run ids set by :func:`start`)."""
    shm = Path("/dev/shm")
    found = [p for pid in pids for p in shm.glob(f"torch_{pid}_*")]
    found += list(shm.glob("*ckpt_shm_*")) + list(Path("/tmp/ckpt_sock").glob("bench-*"))
    return [str(p) for p in found]


def remove(paths: list[str]) -> None:
    import shutil

    for p in paths:
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
