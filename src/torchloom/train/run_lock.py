"""One ``loom train`` run per output directory at a time, on this machine.

Two lock files in ``<output_dir>/.loom-lock/``, both taken with ``flock(2)``:

* ``launcher.lock``: the launcher of a run holds it **exclusively** for the job's life (:func:`claim`): ``loom
  train``'s launcher process, or, for a run without one (``loom train --no-launch``, ``python -m
  torchloom.train.job``, the job under ``loom run``/torchrun), the job's local rank 0. Elastic restarts of the
  worker group under one launcher never touch it. The launchers of one multi-node job that share a machine
  (the same rendezvous endpoint and id) hold it **shared** instead.
* ``workers.lock``: every training process holds it **shared** while it runs (:func:`hold_worker`).

A new run needs ``launcher.lock`` exclusively *and* ``workers.lock`` unheld, so it is refused while another
launcher lives and also while training processes of a killed launcher still run (torchrun starts workers in
sessions of their own: SIGKILL of the launcher's process group leaves them training; the job also asks Linux to
stop them when their launcher dies, :func:`torchloom.elastic.launcher.die_with_agent`, but a worker started by
another tool may not).

The kernel releases a flock when its holder dies, so a lock file left behind by a dead process never blocks; the
files' content (one JSON line per holder: pid, host, role, command) only names the holders in the refusal.
``flock`` is node-local: on a file system shared by several machines a run on another machine may not see the
lock (NFS emulates it with byte-range locks that may be global, Lustre only with ``-o flock``), so a
multi-node job's output dir is protected per node only.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from .config import ConfigError

LOCK_DIR = ".loom-lock"
LAUNCHER_FILE = "launcher.lock"
WORKERS_FILE = "workers.lock"
#: set by ``loom train``'s launcher to the output dir it claimed (resolved); its workers then only
#: :func:`hold_worker` (a run without that launcher claims the dir itself: ``Job.lock_output_dir``)
CLAIMED_ENV = "TORCHLOOM_TRAIN_CLAIMED"
#: seconds a process retries a lock another launcher holds only for a moment (its probe, a shared -> exclusive
#: conversion) before refusing
SETTLE_S = 5.0
#: seconds a new launcher waits for training processes that are exiting (their launcher just stopped or was
#: killed: they get SIGTERM) before it calls them orphans
DYING_S = 2.0


class OutputDirBusy(ConfigError):
    """Another run trains in this output directory (its launcher or its training processes hold the lock)."""


def lock_paths(output_dir: str | os.PathLike) -> tuple[Path, Path]:
    """``(launcher.lock, workers.lock)`` of ``output_dir``."""
    d = Path(output_dir) / LOCK_DIR
    return d / LAUNCHER_FILE, d / WORKERS_FILE


def _open(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # not inherited by the processes this one starts (PEP 446; torchrun's Popen closes fds too)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as e:
        raise ConfigError(f"cannot create the lock file {path} of output dir {path.parent.parent}: {e}. "
                          "Pass an --output-dir this user can write.") from e


def _try(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _try_for(fd: int, op: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not _try(fd, op):
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)
    return True


def _record(fd: int, role: str, **extra) -> None:
    rec = {"pid": os.getpid(), "host": socket.gethostname(), "role": role, "since": time.time(),
           "command": " ".join(sys.argv)[:300], **extra}
    os.write(fd, (json.dumps(rec) + "\n").encode())  # O_APPEND: one write per line, holders never interleave


def _alive(rec: dict) -> bool:
    from ..utils import process_running

    if rec.get("host") != socket.gethostname():
        return True  # another machine's process: cannot check, count it
    return process_running(rec["pid"])


def holders(path: Path) -> list[dict]:
    """The live holders recorded in lock file ``path`` (records of dead processes on this machine skipped)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("pid"), int) and _alive(rec):
            out.append(rec)
    return out


def _describe(recs: list[dict], path: Path) -> tuple[str, str]:
    """``("pid 12 (launcher on host h since 21:03:04 UTC: loom train ...)", "kill 12")`` for a message."""
    if not recs:
        return (f"a process whose record is missing (`fuser {path}` names it)", f"stop it (`fuser -k {path}`)")
    parts = []
    for r in recs:
        since = time.strftime("%H:%M:%S UTC", time.gmtime(r["since"])) if isinstance(r.get("since"), float) else "?"
        what = r.get("role", "?") + (f" rank {r['rank']}" if r.get("rank") is not None else "")
        parts.append(f"pid {r['pid']} ({what} on host {r.get('host', '?')} since {since}: {r.get('command', '?')})")
    here = [str(r["pid"]) for r in recs if r.get("host") == socket.gethostname()]
    kill = (f"stop {'them' if len(here) > 1 else 'it'} (kill {' '.join(here)})" if here else "stop it on its host")
    return "; ".join(parts), kill


class OutputDirLock:
    """The locks this process holds on an output directory, kept until :meth:`release` or this process ends
    (a lock dropped by the garbage collector is released too: keep the object)."""

    def __init__(self, output_dir: str | os.PathLike):
        self.output_dir = Path(output_dir)
        self.launcher_path, self.workers_path = lock_paths(output_dir)
        self._fds: list[int] = []

    def release(self) -> None:
        """Drop every lock this object holds (idempotent)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            try:
                os.close(fd)  # closing the only descriptor of the open file releases its flock
            except Exception:  # noqa: BLE001 - also from __del__ at interpreter exit (the kernel releases then)
                pass

    def __del__(self) -> None:
        self.release()

    def __enter__(self) -> "OutputDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def claim(output_dir: str | os.PathLike, *, job: str | None = None, role: str = "launcher") -> OutputDirLock:
    """Claim ``output_dir`` for a run launched by this process, before anything of the run is written.

    ``job``: None for a single-node run (the claim is exclusive); for a multi-node job, a key that is the same
    for its launchers (rendezvous endpoint and id): the launchers of that job on this machine share the claim,
    another job is refused. ``role`` names this process in the lock file (``launcher``; ``run`` for a run without
    a launcher). The first claimer checks that no training process of an earlier run still holds
    ``workers.lock`` (a multi-node launcher joining a live one of its job cannot tell those from its job's own).

    Raises:
        OutputDirBusy: (a :class:`ConfigError`: ``loom train`` exits 2) another launcher holds the dir, or
            training processes of a launcher that is gone still run there; the message names their pids and
            host and what to do (wait, stop them, or another ``--output-dir``).
        ConfigError: the lock file cannot be created.
    """
    lock = OutputDirLock(output_dir)
    out, path = lock.output_dir, lock.launcher_path
    fd = _open(path)
    lock._fds.append(fd)
    try:
        first, shared = _try(fd, fcntl.LOCK_EX), False
        end = time.monotonic() + SETTLE_S
        while job is not None and not first and not shared:  # join this job's launchers (one may be converting)
            shared = _try(fd, fcntl.LOCK_SH)
            first = not shared and _try(fd, fcntl.LOCK_EX)
            if first or shared or time.monotonic() >= end:
                break
            time.sleep(0.05)
        if not first and not shared:
            desc, kill = _describe(holders(path), path)
            raise OutputDirBusy(
                f"output dir {out} is in use by another run: {desc}. Two runs in one output dir would write the "
                f"same metrics and checkpoints. Wait for it to finish, {kill}, or pass another --output-dir. "
                f"(The lock {path} is held only while that process lives.)")
        if first:
            _check_no_workers(out, lock.workers_path)
            os.ftruncate(fd, 0)  # records of launchers that are gone
            _record(fd, role, job=job)
            # a multi-node launcher converts to shared so that its job's other launchers here can join
            if job is not None and not _try_for(fd, fcntl.LOCK_SH, SETTLE_S):
                raise OutputDirBusy(f"output dir {out}: another run took {path} while this one started; retry.")
            return lock
        _record(fd, role, job=job)  # a multi-node launcher next to others holding it shared
        others = [r for r in holders(path) if r.get("job") != job]
        if others:
            desc, kill = _describe(others, path)
            raise OutputDirBusy(
                f"output dir {out} is in use by another multi-node job on this machine (rendezvous "
                f"{others[0].get('job')}; this one: {job}): {desc}. Wait for it to finish, {kill}, or pass another "
                "--output-dir.")
        return lock
    except BaseException:
        lock.release()
        raise


def _check_no_workers(out: Path, workers_path: Path) -> None:
    wfd = _open(workers_path)
    try:
        if not _try_for(wfd, fcntl.LOCK_EX, DYING_S):  # workers of a launcher just stopped may still be exiting
            desc, kill = _describe([r for r in holders(workers_path) if r.get("role") == "worker"], workers_path)
            raise OutputDirBusy(
                f"output dir {out} is in use by training processes whose launcher is gone: {desc}. They are "
                "workers of an earlier run whose launcher was killed (torchrun starts workers in sessions of their "
                f"own, so killing the launcher's process group leaves them running). Wait for them to finish, "
                f"{kill} and re-run to resume from the newest checkpoint, or pass another --output-dir.")
        os.ftruncate(wfd, 0)  # no worker runs: drop the records of dead ones
    finally:
        os.close(wfd)  # the probe's exclusive lock goes with it


def hold_worker(output_dir: str | os.PathLike, rank: int | None = None) -> OutputDirLock:
    """As a training process of a claimed run: hold ``workers.lock`` shared until this process ends (or
    :meth:`OutputDirLock.release`), so that a new launcher sees the run while this process lives, also after its
    own launcher died. Waits up to :data:`SETTLE_S` seconds for a launcher's momentary probe.

    Raises:
        OutputDirBusy: a launcher holds ``workers.lock`` exclusively for longer than a probe.
        ConfigError: the lock file cannot be created.
    """
    lock = OutputDirLock(output_dir)
    fd = _open(lock.workers_path)
    lock._fds.append(fd)
    if not _try_for(fd, fcntl.LOCK_SH, SETTLE_S):
        lock.release()
        raise OutputDirBusy(f"output dir {lock.output_dir}: {lock.workers_path} is held exclusively by another "
                            f"process for more than {SETTLE_S:.0f} s; another run is starting there. Wait for it "
                            "or pass another --output-dir.")
    _record(fd, "worker", rank=rank)
    return lock
