"""The flash-checkpoint saver: one process per rank that persists shared-memory snapshots to disk.

Started by :class:`torchloom.checkpoint.flash.FlashCheckpointer` as ``python -m
torchloom.checkpoint.saver '<json args>'`` in its own session (so it survives the death of its training
process and the launcher's SIGTERM of the worker group). The savers of all ranks form their own gloo
process group and write each snapshot with ``torch.distributed.checkpoint.save``, committing through
:mod:`torchloom.checkpoint.commit` (every rank durable -> atomic rename -> ``COMPLETE`` marker last).

Protocol on stdin (one JSON object per line): ``{"op": "persist", "slot": i, "step": s}`` and
``{"op": "exit"}``. Replies on stdout: ``{"step": s, "ok": true, "path": ...}`` or ``{"step": s, "ok":
false, "error": ...}``. End of input without ``exit`` means the training process died: the savers then
agree on the newest snapshot every rank holds and persist it if it is newer than the newest complete
checkpoint on disk, and exit.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

_CRASH_ENV = "TORCHLOOM_FLASH_TEST_KILL_SAVER_AT_STEP"  # fault injection for tests (rank 0's saver)
_GATE_ENV = "TORCHLOOM_FLASH_TEST_GATE"  # tests: a persist starts only once this file exists


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def persist(slot_dir: Path, slot_index: int, step: int, root: Path, keep_last: int | None) -> Path:
    """Collective over the savers: write the snapshot in ``slot_index`` as ``<root>/step_XXXXXXXX``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from torchloom.checkpoint import commit
    from torchloom.checkpoint import trainer_state as ts
    from torchloom.checkpoint.flash import rebuild_state
    from torchloom.checkpoint.shm import Slot
    from torchloom.checkpoint.state import unwrap_checkpoint_exception
    from torchloom.errors import CheckpointError

    slot = Slot(slot_dir, slot_index)
    gate = os.environ.get(_GATE_ENV)
    while gate and not os.path.exists(gate):  # test hook: hold the saver busy until the test opens it
        time.sleep(0.01)

    def _check() -> dict:
        h = slot.header()
        if h is None or int(h["step"]) != step:
            raise CheckpointError(f"flash snapshot {slot.header_path} does not hold step {step}")
        return h

    header = commit.run_everywhere(_check, f"reading the flash snapshots of step {step}")
    rank = dist.get_rank()
    tmp = commit.begin_save(root, step)
    try:
        state = rebuild_state(slot.read_tensors(header), header)
        dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True))
    except (Exception, dcp.api.CheckpointException) as e:
        raise unwrap_checkpoint_exception(e, tmp, "saving") from e
    if os.environ.get(_CRASH_ENV) == str(step) and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # test hook: the writer dies after its shard landed

    # the snapshot holds the rank's files as the disk tier writes them (trainer_state encodes both)
    commit.run_everywhere(lambda: ts.write_rank_file(tmp, ts.rng_file(rank), slot.rng_path.read_bytes()),
                          "writing the RNG state")
    del state

    def _rank0(d: Path) -> None:
        commit.write_file_durably(d / ts.TRAINER_STATE, header["trainer_state_text"])

    return commit.finish_save(tmp, root, step=step, rank0_write=_rank0, keep_last=keep_last)


def _on_trainer_death(slot_dir: Path, root: Path, keep_last: int | None) -> None:
    """Persist the newest snapshot that every rank holds, if it is newer than the newest on disk."""
    import torch.distributed as dist

    from torchloom.checkpoint import commit
    from torchloom.checkpoint.shm import complete_steps

    mine = complete_steps(slot_dir)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(mine))
    common = set(everyone[0]).intersection(*map(set, everyone[1:]))

    def _disk() -> int:
        p = commit.latest_complete(root)
        return -1 if p is None else commit.parse_step(p)

    disk = commit.broadcast_from_rank0(_disk)
    if not common or max(common) <= disk:
        return
    step = max(common)
    print(f"[loom] flash saver rank {dist.get_rank()}: training process gone; persisting the in-memory "
          f"snapshot of step {step}", file=sys.stderr, flush=True)
    persist(slot_dir, mine[step], step, root, keep_last)


def main(argv: list[str]) -> int:
    args = json.loads(argv[0])
    import torch.distributed as dist

    slot_dir, root = Path(args["slot_dir"]), Path(args["root"])
    keep_last = args.get("keep_last")
    slot_dir.mkdir(parents=True, exist_ok=True)
    (slot_dir / "saver.pid").write_text(str(os.getpid()))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a group SIGTERM must not interrupt a save
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{args['host']}:{args['port']}", rank=args["rank"],
                                world_size=args["world"], timeout=timedelta(seconds=args.get("timeout_s", 300)))
        clean = False
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["op"] == "exit":
                clean = True
                break
            step = int(msg["step"])
            try:
                path = persist(slot_dir, int(msg["slot"]), step, root, keep_last)
                _reply({"step": step, "ok": True, "path": str(path)})
            except Exception as e:  # noqa: BLE001 - reported to the trainer
                _reply({"step": step, "ok": False, "error": f"{type(e).__name__}: {e}"})
        if not clean:
            _on_trainer_death(slot_dir, root, keep_last)
        return 0
    finally:
        try:
            if (slot_dir / "saver.pid").read_text() == str(os.getpid()):
                (slot_dir / "saver.pid").unlink()
        except OSError:
            pass


if __name__ == "__main__":
    from torchloom.elastic.shutdown import clean_exit

    code = 1
    try:
        code = main(sys.argv[1:])
    except BaseException as e:  # noqa: BLE001
        print(f"[loom] flash saver failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    clean_exit(code)
