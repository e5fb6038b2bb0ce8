"""One class per checkpointing library, each used the way its documentation shows. Every contender
offers ``save(step)`` (what the training loop calls; its wall time is the stall), ``wait()`` (blocks until
that save is durable on disk, for measuring the background persist), ``load() -> (step, source)``
(restores model + optimizer from the newest complete checkpoint in a fresh process) and ``close()``.
All calls are collective (every rank calls them).
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from benchmarks.compare_ckpt.state import State

NAMES = ("torchloom flash", "dcp async thread", "dcp async cached", "dcp async process", "dcp sync", "dlrover flash")


def make(name: str, root: Path, st: State):
    """The contender ``name`` writing under ``root``."""
    return {"torchloom flash": TorchloomFlash, "dcp async thread": DcpAsyncThread,
            "dcp async cached": DcpAsyncCached, "dcp async process": DcpAsyncProcess, "dcp sync": DcpSync,
            "dlrover flash": DlroverFlash}[name](root, st)


class TorchloomFlash:
    """``torchloom.checkpoint.FlashCheckpointer`` (shared-memory snapshot + background saver process
    per rank, which survives a crash of the training process)."""

    def __init__(self, root: Path, st: State):
        from torchloom.checkpoint import FlashCheckpointer

        self.fc = FlashCheckpointer(root, model=st.model, optimizer=st.optimizer, keep_last=2)

    def save(self, step: int) -> None:
        self.fc.save(step)

    def wait(self) -> None:
        self.fc.wait()

    def load(self) -> tuple[int | None, str]:
        info = self.fc.load()
        return (info["step"], info["source"]) if info else (None, "none")

    def close(self) -> None:
        self.fc.finalize()


class _Dcp:
    """PyTorch Distributed Checkpoint on ``get_state_dict(model, optimizer)``, one directory per step;
    a checkpoint is complete once DCP has written its ``.metadata`` (DCP writes it last)."""

    def __init__(self, root: Path, st: State):
        self.root, self.st = Path(root), st

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.st.model, self.st.optimizer)
        return {"model": msd, "optim": osd}

    def _dir(self, step: int) -> str:
        return str(self.root / f"step_{step:08d}")

    def wait(self) -> None:
        self.prune()

    def prune(self, keep: int = 2) -> None:
        """Rank 0 deletes all but the ``keep`` newest complete step directories (what a user's retention
        does; torchloom and DLRover are configured to keep 2 as well)."""
        if dist.get_rank() == 0:
            done = sorted(p for p in self.root.glob("step_*") if (p / ".metadata").exists())
            for p in done[:-keep]:
                shutil.rmtree(p, ignore_errors=True)

    def load(self) -> tuple[int | None, str]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        done = sorted(p for p in self.root.glob("step_*") if (p / ".metadata").exists())
        if not done:
            return None, "none"
        sd = self._state()
        dcp.load(sd, checkpoint_id=str(done[-1]))
        set_state_dict(self.st.model, self.st.optimizer, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        return int(done[-1].name.split("_")[1]), "disk"

    def close(self) -> None:
        self.wait()


class DcpSync(_Dcp):
    """``torch.distributed.checkpoint.save``: blocks until every rank's files are written."""

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=self._dir(step))


class DcpAsyncThread(_Dcp):
    """``torch.distributed.checkpoint.async_save`` (default stager: a CPU copy of the state, then the
    write in a thread). As its docs show, the loop waits for the previous save's future before the next.
    The write runs on its own gloo group, as torchtitan does: on the default group (the only group on a
    CPU/gloo job) its collectives, issued from the background thread, interleave with the training
    loop's DDP all-reduces and gloo aborts ("Received data size doesn't match expected size"), seen here."""

    kind = "THREAD"

    def __init__(self, root: Path, st: State):
        super().__init__(root, st)
        self.fut = None
        self.pg = dist.new_group(backend="gloo") if self.kind == "THREAD" else None

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self.fut is not None:
            self.fut.result()
        self.fut = dcp.async_save(self._state(), checkpoint_id=self._dir(step), process_group=self.pg,
                                  async_checkpointer_type=getattr(AsyncCheckpointerType, self.kind))

    def wait(self) -> None:
        if self.fut is not None:
            self.fut.result()
            self.fut = None
        self.prune()


class DcpAsyncCached(DcpAsyncThread):
    """DCP ``async_save`` in thread mode, tuned: one persistent ``DefaultStager`` passed as ``async_stager`` to
    every save, so the CPU staging buffers are allocated (and their pages faulted) once and reused, as
    torchloom's slots are. Staging stays synchronous (``use_async_staging=False``: the training loop must not
    change the state while it is copied; CPU tensors, so pinned memory and non-blocking copies do not apply)."""

    def __init__(self, root: Path, st: State):
        super().__init__(root, st)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=False))

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if self.fut is not None:
            self.fut.result()
        self.fut = dcp.async_save(self._state(), checkpoint_id=self._dir(step), process_group=self.pg,
                                  async_stager=self.stager)

    def close(self) -> None:
        super().close()
        self.stager.close()


class DcpAsyncProcess(DcpAsyncThread):
    """``async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``: the write runs in a
    background process per rank (started by the first save, with its own process group, so no extra
    group is needed here)."""

    kind = "PROCESS"


class DlroverFlash:
    """DLRover's ``DdpCheckpointer`` (``dlrover.trainer.torch.flash_checkpoint.ddp``): local rank 0
    copies ``{"model", "optimizer"}`` state dicts into shared memory; a saver process writes them with
    ``torch.save``; the step of the newest persisted checkpoint is in ``dlrover_latest.txt``. Launched
    without ``dlrover-run`` (this machine runs no DLRover master/agent), so the saver is a daemon child of
    local rank 0, as DLRover documents for that case."""

    def __init__(self, root: Path, st: State):
        from dlrover.python.common.storage import KeepLatestStepStrategy
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

        self.root, self.st = Path(root), st
        self.ck = DdpCheckpointer(str(root), deletion_strategy=KeepLatestStepStrategy(2, str(root)))
        self.step = None

    def save(self, step: int) -> None:
        from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType

        sd = {"model": self.st.model.module.state_dict(), "optimizer": self.st.optimizer.state_dict(),
              "step": step}
        self.ck.save_checkpoint(step, sd, storage_type=StorageType.DISK)
        self.step = step

    def _persisted(self) -> int | None:
        try:
            return int((self.root / "dlrover_latest.txt").read_text().strip())
        except (OSError, ValueError):
            return None

    def wait(self, timeout: float = 600.0) -> None:
        """Polls the tracker file every 20 ms until it names the last saved step (rank 0 writes)."""
        t = time.perf_counter()
        if dist.get_rank() == 0:
            while self._persisted() != self.step:
                if time.perf_counter() - t > timeout:
                    raise TimeoutError(f"dlrover did not persist step {self.step} in {timeout} s")
                time.sleep(0.02)
        dist.barrier()

    def load(self) -> tuple[int | None, str]:
        sd = self.ck.load_checkpoint()
        if not sd:
            return None, "none"
        self.st.model.module.load_state_dict(sd["model"])
        self.st.optimizer.load_state_dict(sd["optimizer"])
        return int(sd["step"]), "memory or disk (see log)"

    def close(self) -> None:
        if self.step is not None:
            self.wait()
        self.ck._engine.close()


def os_env_summary() -> dict:
    """Threads and process-group facts the report records (silent-fallback checks)."""
    import torch

    return {"world_size": dist.get_world_size(), "backend": dist.get_backend(),
            "torch_threads": torch.get_num_threads(), "pid": os.getpid()}
