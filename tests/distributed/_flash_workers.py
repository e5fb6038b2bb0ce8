"""Rank functions for tests/distributed/test_flash_checkpoint.py and tests/cases/test_c18_torn_checkpoint.py
(imported by qualified name in spawned ranks)."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed._ckpt_workers import Cursor, fsdp, seed_all, tiny_llama, train_llama


def setup(wrap: str, seed: int = 0, lr: float = 1e-2):
    model = tiny_llama(seed)
    if wrap == "fsdp":
        model = fsdp(model)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return model, opt, sched, Cursor(dist.get_rank())


def flash(root, model, opt, sched, cursor, **kw):
    from torchloom.checkpoint.flash import FlashCheckpointer

    kw.setdefault("saver_timeout_s", 60.0)
    return FlashCheckpointer(root, model=model, optimizer=opt, lr_scheduler=sched, dataloader=cursor, **kw)


def full(model) -> dict:
    from torchloom.checkpoint.state import full_model_state

    return {k: v.clone() for k, v in full_model_state(model).items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def resume_rank(tmp: str, wrap: str) -> dict:
    """Train 4 steps with a persisted flash save at 2 and a memory-only one at 3; then resume from memory
    (step 3) and from disk (step 2) in fresh objects and redo the rest: bitwise equal."""
    from torchloom import checkpoint

    root, shm = Path(tmp) / "ckpt", Path(tmp) / "shm"
    rank = dist.get_rank()
    out: dict = {}
    seed_all(100 + rank)
    objs = setup(wrap)
    model, opt, sched, cursor = objs
    fc = flash(root, *objs, keep_last=2, shm_dir=shm)
    train_llama(model, opt, sched, cursor, 2)
    out["saved2"] = fc.save(2, extra={"note": "two"})
    losses = train_llama(model, opt, sched, cursor, 1)
    out["saved3"] = fc.save(3, persist=False)
    losses += train_llama(model, opt, sched, cursor, 1)
    ref = full(model)
    fc.finalize(unlink=False)
    out["complete"] = [p.name for _s, p in checkpoint.commit.list_checkpoints(root) if checkpoint.is_complete(p)]
    out["blocking_s"] = fc.blocking_s

    # from memory: the step-3 snapshot (newer than the disk's step 2)
    seed_all(7)
    objs2 = setup(wrap, seed=5, lr=0.5)
    fc2 = flash(root, *objs2, shm_dir=shm)
    info = fc2.load()
    out["mem"] = {"source": info["source"], "step": info["step"], "cursor": objs2[3].index}
    out["mem_losses"] = train_llama(*objs2, 1)
    out["mem_equal"] = same(full(objs2[0]), ref)
    fc2.finalize(unlink=True)

    # from disk: step 2, written by the savers in the background, read by the ordinary loader
    seed_all(8)
    objs3 = setup(wrap, seed=6, lr=0.5)
    info = checkpoint.load(root, model=objs3[0], optimizer=objs3[1], lr_scheduler=objs3[2], dataloader=objs3[3])
    out["disk"] = {"step": info["step"], "extra": info["extra"], "cursor": objs3[3].index}
    out["disk_losses"] = train_llama(*objs3, 2)
    out["disk_equal"] = same(full(objs3[0]), ref)
    out["losses"] = losses
    return out


def reference_state(wrap: str, steps: int) -> dict:
    seed_all(100 + dist.get_rank())
    objs = setup(wrap)
    train_llama(*objs, steps)
    return full(objs[0])


def killed_trainer_rank(tmp: str) -> None:
    """Persist step 2, snapshot step 3 in memory only, then the trainer is SIGKILLed."""
    root, shm = Path(tmp) / "ckpt", Path(tmp) / "shm"
    seed_all(100 + dist.get_rank())
    objs = setup("fsdp")
    fc = flash(root, *objs, shm_dir=shm)
    train_llama(*objs, 2)
    fc.save(2)
    fc.wait()
    train_llama(*objs, 1)
    fc.save(3, persist=False)
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def after_kill_rank(tmp: str) -> dict:
    """The next run: the savers of the killed run have persisted step 3 (memory -> disk)."""
    from torchloom import checkpoint

    root, shm = Path(tmp) / "ckpt", Path(tmp) / "shm"
    ref = reference_state("fsdp", 3)
    objs = setup("fsdp", seed=9, lr=0.5)
    fc = flash(root, *objs, shm_dir=shm)  # waits for the previous run's savers to finish
    latest = checkpoint.latest_complete(root)
    info = fc.load()
    mem_equal = same(full(objs[0]), ref)
    fc.finalize()
    objs2 = setup("fsdp", seed=10, lr=0.5)
    dinfo = checkpoint.load(root, model=objs2[0], optimizer=objs2[1], lr_scheduler=objs2[2], dataloader=objs2[3])
    return {"latest": latest.name if latest else None, "source": info["source"], "step": info["step"],
            "mem_equal": mem_equal, "disk_step": dinfo["step"], "disk_equal": same(full(objs2[0]), ref)}


def busy_rank(tmp: str, gate: str) -> dict:
    """on_busy='skip': a save while the saver is held busy is skipped (on every rank), then works again."""
    from torchloom import checkpoint

    root, shm = Path(tmp) / "ckpt", Path(tmp) / "shm"
    seed_all(1)
    objs = setup("ddp")
    fc = flash(root, *objs, shm_dir=shm, on_busy="skip")
    train_llama(*objs, 1)
    first = fc.save(1)
    train_llama(*objs, 1)
    second = fc.save(2)  # the saver is held at the gate: busy -> skipped
    dist.barrier()
    if dist.get_rank() == 0:
        Path(gate).touch()
    fc.wait()
    third = fc.save(3, persist=False)  # memory-only into the free slot
    fourth = fc.save(4)
    fc.finalize()
    done = [p.name for _s, p in checkpoint.commit.list_checkpoints(root) if checkpoint.is_complete(p)]
    return {"results": [first, second, third, fourth], "skipped": fc.skipped, "complete": done}


def torn_rank(tmp: str) -> dict:
    """C18 first run: step 2 is committed; the writer (rank 0's saver) dies after its shard of step 4
    landed. The trainers see the failure."""
    from torchloom.errors import CheckpointError

    root, shm = Path(tmp) / "ckpt", Path(tmp) / "shm"
    seed_all(100 + dist.get_rank())
    objs = setup("fsdp")
    fc = flash(root, *objs, shm_dir=shm, keep_last=1)
    train_llama(*objs, 2)
    fc.save(2)
    fc.wait()
    train_llama(*objs, 2)
    fc.save(4)
    err = None
    try:
        fc.wait()
    except CheckpointError as e:
        err = str(e)
    try:
        fc.finalize(unlink=False)
    except CheckpointError:
        pass
    return {"error": err, "entries": sorted(p.name for p in root.iterdir())}


def torn_resume_rank(tmp: str) -> dict:
    """C18 restart with auto-resume on another node (no in-memory snapshot): every rank loads step 2."""
    from torchloom import checkpoint

    root = Path(tmp) / "ckpt"
    ref = reference_state("fsdp", 2)
    objs = setup("fsdp", seed=3, lr=0.5)
    fc = flash(root, *objs, shm_dir=Path(tmp) / "shm-new-node", keep_last=1)
    info = fc.load()
    paths = [None] * dist.get_world_size()
    dist.all_gather_object(paths, str(info["path"]))
    equal = same(full(objs[0]), ref)
    entries_before = sorted(p.name for p in root.iterdir())
    train_llama(*objs, 2)
    fc.save(4)
    fc.finalize()
    complete = [p.name for _s, p in checkpoint.commit.list_checkpoints(root) if checkpoint.is_complete(p)]
    return {"source": info["source"], "step": info["step"], "paths": paths, "equal": equal,
            "entries_before": entries_before, "complete_after": complete}


def _tp_fsdp_state(res) -> dict:
    """Full (gathered) params and optimizer state of an auto_accelerate result, for bitwise comparison."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True)
    msd, osd = get_state_dict(res.model, res.optimizer, options=opts)
    flat = {f"model.{k}": v for k, v in msd.items()}
    for pk, st in osd["state"].items():
        for sk, v in st.items():
            flat[f"optim.{pk}.{sk}"] = v
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in flat.items() if isinstance(v, torch.Tensor)}


def tp_ranks(tmp: str, strategies: list) -> list[dict]:
    """:func:`tp_rank` for several strategies in one launch (a launch costs seconds)."""
    return [tp_rank(str(Path(tmp) / str(i)), s) for i, s in enumerate(strategies)]


def tp_rank(tmp: str, strategy) -> dict:
    """Flash save of tensor-parallel state (FSDP x TP: DTensors with _StridedShard; pp x tp: a different tp
    sub-mesh per stage): persisted by the savers and restored from memory, both bitwise equal to the live state (params and AdamW state)."""
    import torchloom
    from torchloom import checkpoint
    from tests.distributed._train_workers import lm_loss, token_batches

    def build(seed):
        seed_all(seed)
        return torchloom.auto_accelerate(
            tiny_llama(seed), torch.optim.AdamW, None, lm_loss, strategy=strategy, optim_args={"lr": 1e-2},
            dataloader_args={"batch_size": 4, "micro_batch_size": 2}, model_input_format="unpack_dict")

    root, shm = Path(tmp) / "ckpt", Path(tmp) / "shm"
    res = build(0)
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    xs = token_batches(8, seq=16)
    for s in range(2):
        x = xs[s * 4:(s + 1) * 4][r * (4 // dp):(r + 1) * (4 // dp)]
        for k in range(res.grad_accum_steps):
            res.train_step({"input_ids": x[k * 2:(k + 1) * 2], "labels": x[k * 2:(k + 1) * 2]})
    ref = _tp_fsdp_state(res)
    fc = flash(root, res.model, res.optimizer, None, None, shm_dir=shm)
    fc.save(2)
    fc.finalize(unlink=False)
    mem = build(5)
    info = flash(root, mem.model, mem.optimizer, None, None, shm_dir=shm).load()
    mem_equal = same(_tp_fsdp_state(mem), ref)
    disk = build(6)
    dinfo = checkpoint.load(root, model=disk.model, optimizer=disk.optimizer)
    return {"mem": (info["source"], info["step"]), "mem_equal": mem_equal, "disk_step": dinfo["step"],
            "disk_equal": same(_tp_fsdp_state(disk), ref), "n": len(ref)}
