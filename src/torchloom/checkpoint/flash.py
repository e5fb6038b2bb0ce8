"""Flash checkpoints: the training process copies its (sharded) state into preallocated shared memory
and returns; a saver process per rank persists it to disk in the background (DCP format, same layout
and commit protocol as :func:`torchloom.checkpoint.save`). See ``docs/flash_checkpoint.md``.

Two tiers: every ``save(step)`` takes an in-memory snapshot (double-buffered, reused); ``save(step,
persist=True)`` also has the savers write it to ``<root>/step_XXXXXXXX``. The savers run in their own
sessions: if the training process dies, they persist the newest snapshot every rank holds. On restart
:meth:`FlashCheckpointer.load` prefers the newest in-memory snapshot (all ranks hold it, same world size,
newer than the disk), else the newest complete disk checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from torchloom.checkpoint import commit, layout
from torchloom.checkpoint import trainer_state as ts
from torchloom.checkpoint.shm import Slot, complete_steps
from torchloom.checkpoint.state import from_json, is_zero_optimizer, to_json
from torchloom.errors import CheckpointError

log = logging.getLogger("torchloom.checkpoint.flash")
ON_BUSY = ("wait", "skip")


# --------------------------------------------------------------------------- flatten / rebuild state
# DTensor layouts (recorded per entry, rebuilt collectively, resharded in memory): torchloom.checkpoint.layout
_encode_layout = layout.encode


def flatten(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's flattening of a nested state dict: ``(flat, mapping)``."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)


def rebuild_state(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> dict[str, Any]:
    """The nested state dict of a snapshot: its tensors (DTensors rebuilt from their recorded layout, in
    the current process group) and non-tensor values. Collective when the state holds DTensors."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    flat: dict[str, Any] = dict(from_json(header["objects"]))
    layout.prepare_meshes([e["dtensor"] for e in header["entries"]])
    for e in header["entries"]:
        flat[e["key"]] = layout.decode(tensors[e["key"]], e["dtensor"])
    mapping = {k: tuple(v) for k, v in from_json(header["mapping"]).items()}
    return unflatten_state_dict(flat, mapping)


def _device_type(t: torch.Tensor) -> str:
    return t.device_mesh.device_type if hasattr(t, "device_mesh") else t.device.type


# ------------------------------------------------------------------------------------- the object
def _default_shm_root() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is still a running saver (not a process that reused its pid)."""
    from torchloom.utils import process_running

    if not process_running(pid):
        return False
    try:
        return b"torchloom.checkpoint.saver" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True


class FlashCheckpointer:
    """Non-blocking two-tier checkpoints of one training state. Construct and use on every rank.

    Args:
        root: checkpoint root (the same as for :func:`torchloom.checkpoint.save`; shared by all ranks).
        model, optimizer, lr_scheduler, dataloader, train_step: as for :func:`~torchloom.checkpoint.save`
            (``ZeroRedundancyOptimizer`` is not supported: use the synchronous ``save``).
        keep_last: retention of complete disk checkpoints (the newest complete one is never deleted).
        on_busy: what :meth:`save` does when the slot it needs is still being persisted: ``"wait"``
            blocks until the saver is done, ``"skip"`` skips this save (logged; counted in ``skipped``).
        shm_dir: where the per-rank snapshot directories live (default ``/dev/shm/torchloom-<hash of
            root>``; node-local memory, so a restart on the same node finds them).
        saver_timeout_s: seconds the savers' process group waits for a peer, and the longest a new
            checkpointer waits for the savers of a previous (crashed) run to finish.
        trainable_only: snapshots (shared memory and disk) hold of the model only the trainable parameters
            and the buffers, as :func:`~torchloom.checkpoint.save` with ``trainable_only=True``; loading
            (memory or disk) checks the trainable set and the frozen base the same way.

    Raises:
        CheckpointError: invalid arguments, a ZeRO optimizer, or a saver that failed or died.
    """

    def __init__(self, root: str | os.PathLike, *, model: nn.Module, optimizer: Any = None,
                 lr_scheduler: Any = None, dataloader: Any = None, train_step: Any = None,
                 keep_last: int | None = None, on_busy: str = "wait", shm_dir: str | os.PathLike | None = None,
                 saver_timeout_s: float = 300.0, trainable_only: bool = False):
        if on_busy not in ON_BUSY:
            raise CheckpointError(f"on_busy must be one of {ON_BUSY}, got {on_busy!r}")
        if optimizer is not None and is_zero_optimizer(optimizer):
            raise CheckpointError("flash checkpoints do not support ZeroRedundancyOptimizer; use "
                                  "torchloom.checkpoint.save (blocking) or FSDP (zero2/zero3)")
        if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
            raise CheckpointError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
        if not isinstance(trainable_only, bool):
            raise CheckpointError(f"trainable_only must be a bool, got {trainable_only!r}")
        self.trainable_only = trainable_only
        self.root = Path(root).resolve()
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.dataloader, self.train_step = dataloader, train_step
        self.keep_last, self.on_busy, self.saver_timeout_s = keep_last, on_busy, saver_timeout_s
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        tag = hashlib.sha1(str(self.root).encode()).hexdigest()[:12]
        base = Path(shm_dir) if shm_dir is not None else _default_shm_root() / f"torchloom-{os.getuid()}-{tag}"
        self.slot_dir = base / f"rank{self.rank}"
        self.slots = [Slot(self.slot_dir, 0), Slot(self.slot_dir, 1)]
        self.skipped = 0
        self.blocking_s: list[float] = []  # seconds each save blocked the training loop
        self._newest_slot: int | None = None
        self._inflight: tuple[int, int] | None = None  # (slot, step) being persisted
        self._replies: queue.Queue = queue.Queue()
        self._errors: list[str] = []
        self._proc: subprocess.Popen | None = None
        self._reserver: threading.Thread | None = None  # faults in the other slot after the first save
        self._reserve_error: BaseException | None = None
        self._wait_for_old_saver()
        steps = complete_steps(self.slot_dir)
        if steps:
            self._newest_slot = steps[max(steps)]

    # -- the saver process ------------------------------------------------------------------------
    def _wait_for_old_saver(self) -> None:
        """A saver of a previous run may still be persisting this rank's snapshot: wait for it (bounded)."""
        pid_file = self.slot_dir / "saver.pid"
        deadline = time.monotonic() + self.saver_timeout_s
        while True:
            try:
                pid = int(pid_file.read_text())
            except (OSError, ValueError):
                return
            if not _pid_alive(pid):
                return
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"the flash saver of a previous run (pid {pid}, {pid_file}) is still running after "
                    f"{self.saver_timeout_s:.0f} s; kill it or raise saver_timeout_s")
            time.sleep(0.05)

    def _start_saver(self) -> None:
        if self._proc is not None:
            return
        port = [_free_port() if self.rank == 0 else None]
        if self.world > 1:
            dist.broadcast_object_list(port, src=0)
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        args = {"slot_dir": str(self.slot_dir), "root": str(self.root), "keep_last": self.keep_last,
                "rank": self.rank, "world": self.world, "host": host, "port": port[0],
                "timeout_s": self.saver_timeout_s}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "TORCH_NCCL"))}
        env.setdefault("OMP_NUM_THREADS", "1")
        src = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "torchloom.checkpoint.saver", json.dumps(args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        proc = self._proc

        def _read() -> None:
            for line in proc.stdout:
                try:
                    self._replies.put(json.loads(line))
                except ValueError:
                    pass
            self._replies.put(None)  # the saver is gone

        threading.Thread(target=_read, daemon=True, name="loom-flash-replies").start()

    def _send(self, msg: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(msg) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise CheckpointError(f"the flash saver of rank {self.rank} died (exit code {self._proc.poll()}); "
                                  f"see its stderr above") from e

    def _collect(self, block: bool, timeout: float | None = None) -> None:
        """Take the saver's reply to the in-flight persist (waiting if ``block``)."""
        while self._inflight is not None:
            try:
                r = self._replies.get(block=block, timeout=timeout)
            except queue.Empty:
                if block:
                    raise CheckpointError(f"the flash saver of rank {self.rank} did not finish step "
                                          f"{self._inflight[1]} within {timeout} s") from None
                return
            step = self._inflight[1]
            self._inflight = None
            if r is None:
                raise CheckpointError(f"the flash saver of rank {self.rank} died while persisting step {step} "
                                      f"(exit code {self._proc.poll()}); the previous complete checkpoint "
                                      f"under {self.root} stays the newest")
            if not r.get("ok"):
                self._errors.append(r.get("error", "?"))
                raise CheckpointError(f"flash checkpoint of step {step} failed: {r.get('error')}")
            self.last_persisted = Path(r["path"])
            log.info("flash checkpoint step %d persisted to %s", step, r["path"])

    def _busy(self, slot: int, persist: bool) -> bool:
        """Whether this save must wait (agreed across ranks, so all ranks decide the same)."""
        self._collect(block=False)
        busy = self._inflight is not None and (persist or self._inflight[0] == slot)
        if self.world > 1:
            t = torch.tensor([int(busy)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            busy = bool(t.item())
        return busy

    # -- saving -----------------------------------------------------------------------------------
    def save(self, step: int, *, persist: bool = True, extra: dict | None = None,
             scaler_state: dict | None = None) -> bool:
        """Snapshot the state of ``step`` into host memory and return; with ``persist`` the savers also
        write it to ``<root>/step_XXXXXXXX`` in the background. Collective.

        Returns ``False`` if the save was skipped (``on_busy="skip"`` while the saver was busy), else
        ``True``. The time this call blocked (seconds) is appended to ``blocking_s``.

        Raises:
            CheckpointError: a previous background save failed, or the saver died.
        """
        commit.step_dirname(step)
        t0 = time.perf_counter()
        self._join_reserver()
        if persist:
            self._start_saver()
        slot = 0 if self._newest_slot is None else 1 - self._newest_slot
        if self._busy(slot, persist):
            if self.on_busy == "skip":
                self.skipped += 1
                msg = (f"flash checkpoint of step {step} skipped: step {self._inflight[1] if self._inflight else '?'} "
                       f"is still being persisted (on_busy='skip')")
                log.warning(msg)
                if self.rank == 0:
                    print(f"[loom] {msg}", flush=True)
                return False
            self._collect(block=True, timeout=self.saver_timeout_s)
            if self.world > 1:  # every rank's previous persist is done before the slot is reused
                dist.barrier()
        self._snapshot(self.slots[slot], step, extra, scaler_state)
        self._newest_slot = slot
        if persist:
            self._send({"op": "persist", "slot": slot, "step": step})
            self._inflight = (slot, step)
        self.blocking_s.append(time.perf_counter() - t0)
        return True

    def _live(self) -> ts.Live:
        return ts.Live(self.model, self.optimizer, self.lr_scheduler, self.dataloader, self.train_step,
                       trainable_only=self.trainable_only)

    def _snapshot(self, slot: Slot, step: int, extra: dict | None, scaler_state: dict | None) -> None:
        live = self._live()
        doc = ts.encode_document(live, step=step, extra=extra, scaler_state=scaler_state)
        flat, mapping = flatten(ts.encode_tensors(live))
        tensors, objects = [], {}
        for k, v in flat.items():
            if isinstance(v, torch.Tensor):
                layout = _encode_layout(v)
                local = v.to_local() if layout is not None else v
                tensors.append((k, local, layout))  # copied straight into shared memory (device -> host)
            else:
                objects[k] = v
        header = {"step": step, "rank": self.rank, "world_size": self.world, "time": time.time(),
                  "objects": to_json(objects, "optimizer/model non-tensor state"),
                  "mapping": to_json({k: list(v) for k, v in mapping.items()}),
                  "trainer_state_text": ts.document_text(doc)}
        slot.write(tensors, header, ts.encode_rng())
        other = self.slots[1 - slot.index]
        persisting = self._inflight is not None and self._inflight[0] == other.index
        if not other.holds(slot.last_nbytes) and not persisting:
            # Allocate the other buffer now, so the next save only copies. Growing zero-fills it: never while
            # the saver still reads it (a state that grew, e.g. AdamW's moments after the first step, would
            # persist zeros); it then grows at its own next write. Faulting in ~1 s/GB of pages runs in a
            # thread: the training loop does not wait for it (joined by the next save/load/finalize).
            self._reserver = threading.Thread(target=self._reserve, args=(other, slot.last_nbytes), daemon=True,
                                              name="loom-flash-reserve")
            self._reserver.start()

    def _reserve(self, slot: Slot, nbytes: int) -> None:
        try:
            slot.reserve(nbytes)
        except BaseException as e:  # noqa: BLE001 - raised by the next save, in the training thread
            self._reserve_error = e

    def _join_reserver(self) -> None:
        if self._reserver is not None:
            self._reserver.join()
            self._reserver = None
        if self._reserve_error is not None:
            e, self._reserve_error = self._reserve_error, None
            raise CheckpointError(f"flash checkpoint: allocating the second shared-memory slot in "
                                  f"{self.slot_dir} failed ({type(e).__name__}: {e}); free space in it (or pass "
                                  "shm_dir=) and save again") from e

    def wait(self, timeout: float | None = None) -> None:
        """Block until the in-flight background save (if any) is committed. Raises CheckpointError if it
        failed. ``timeout`` in seconds (default ``saver_timeout_s``)."""
        self._collect(block=True, timeout=timeout or self.saver_timeout_s)

    def finalize(self, *, unlink: bool = True) -> None:
        """End of training: finish the in-flight save, stop the saver, and (``unlink``) free the shared
        memory. Collective. Call once, after the last :meth:`save`."""
        err = None
        try:
            self._join_reserver()
            self.wait()
        except CheckpointError as e:
            err = e
        if self._proc is not None:
            try:
                self._send({"op": "exit"})
                self._proc.stdin.close()
            except (CheckpointError, OSError):
                pass
            try:
                self._proc.wait(timeout=self.saver_timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None
        if self.world > 1:
            dist.barrier()
        if unlink and err is None:
            for s in self.slots:
                for p in (s.header_path, s.data_path, s.rng_path):
                    p.unlink(missing_ok=True)
            for d in (self.slot_dir, self.slot_dir.parent):
                try:
                    d.rmdir()  # only if empty (other ranks may still own the parent)
                except OSError:
                    pass
        if err is not None:
            raise err

    # -- loading ----------------------------------------------------------------------------------
    def load(self, *, strict: bool = True) -> dict | None:
        """Restore the newest state: the newest in-memory snapshot if every rank holds it for the same
        step, the world size matches and it is at least as new as the newest complete disk checkpoint;
        otherwise the newest complete disk checkpoint. Collective.

        Returns ``{"step", "extra", "scaler_state", "path", "source": "memory" | "disk"}``, or ``None``
        if there is nothing to resume from.

        Raises:
            CheckpointError: the snapshot does not match the live state (keys or local shapes), or the disk
                checkpoint cannot be loaded (see :func:`torchloom.checkpoint.load`).
        """
        from torchloom.checkpoint import api

        self._join_reserver()
        mine = {}
        for s in self.slots:
            h = s.header()
            if h is not None and h.get("world_size") == self.world and h.get("rank") == self.rank:
                mine[int(h["step"])] = s.index
        everyone: list[Any] = [sorted(mine)]
        if self.world > 1:
            everyone = [None] * self.world
            dist.all_gather_object(everyone, sorted(mine))
        common = set(everyone[0]).intersection(*map(set, everyone[1:]))

        def _disk() -> int:
            p = commit.latest_complete(self.root)
            return -1 if p is None else commit.parse_step(p)

        disk = commit.broadcast_from_rank0(_disk)
        if common and max(common) >= disk:
            step = max(common)
            info = self._load_memory(self.slots[mine[step]], strict)
            self._newest_slot = mine[step]
            return info
        if disk < 0:
            return None
        info = api.load(self.root, model=self.model, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                        dataloader=self.dataloader, train_step=self.train_step, strict=strict)
        info["source"] = "disk"
        return info

    def _load_memory(self, slot: Slot, strict: bool) -> dict:
        header = slot.header()
        where = str(slot.header_path)
        snap = slot.read_tensors(header)
        objects = from_json(header["objects"])
        mapping = from_json(header["mapping"])
        catalogue = {k: (tuple(v), k in snap) for k, v in mapping.items()}
        saved_layout = {e["key"]: e["dtensor"] for e in header["entries"]}

        def fill(target: dict[str, Any]) -> None:
            # A shard is copied as it is only where it is the live local shard (same global shape, placements
            # and sub-mesh); the others (another ep / dp_shard / tp split at this world size) are resharded.
            moved = [k for k, v in target.items() if isinstance(v, torch.Tensor)
                     and not layout.same_local_shard(saved_layout.get(k), _encode_layout(v))]
            held = [k for k, v in target.items() if isinstance(v, torch.Tensor) and k in snap
                    and saved_layout.get(k) is not None]
            gathered = layout.agree_reshard([k for k in moved if saved_layout.get(k) is not None], held,
                                            f"flash snapshot {where}")
            if gathered:
                layout.prepare_meshes([saved_layout[k] for k in gathered], _device_type(target[gathered[0]]))
            for k in gathered:  # collective (the saved DTensor is gathered): the same order on every rank
                layout.reshard_into(target[k], snap[k], saved_layout[k], k, f"flash snapshot {where}")
            for k, v in target.items():
                if not isinstance(v, torch.Tensor):
                    target[k] = objects[k]
                elif k in gathered:
                    continue
                elif k in moved:  # a plain saved value (a replica's full value) into a live DTensor shard
                    layout.reshard_into(v, snap[k], None, k, f"flash snapshot {where}")
                else:
                    local = v.to_local() if _encode_layout(v) is not None else v
                    if tuple(local.shape) != tuple(snap[k].shape):
                        raise CheckpointError(f"flash snapshot {where}: {k} has local shape "
                                              f"{tuple(snap[k].shape)}, the live state {tuple(local.shape)}")
                    with torch.no_grad():
                        local.copy_(snap[k])

        live = self._live()
        doc = ts.parse_document(header["trainer_state_text"], where)
        ts.restore_tensors(live, catalogue, fill, strict=strict, where=f"flash snapshot {where}", document=doc,
                           per_rank=True)
        info = ts.restore_document(live, doc, strict=strict, where=f"flash snapshot {where}")
        ts.restore_rng_file(slot.rng_path)
        if self.world > 1:
            dist.barrier()
        return {**info, "path": slot.header_path, "source": "memory"}


__all__ = ["FlashCheckpointer", "ON_BUSY", "rebuild_state"]
