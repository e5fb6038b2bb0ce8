"""One rank of one contender: ``python -m benchmarks.compare.worker JSON_CFG OUT_JSON`` with torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Builds the seeded model, lets the
contender set it up, times ``warmup + steps`` optimizer steps and writes this rank's measurements as JSON.

Measured per rank: wall time of each step (s), the global-batch mean loss (all ranks averaged, outside the
clock), peak RSS (bytes; VmHWM over setup, then reset and
read again over the timed steps), the bytes of parameters / optimizer state / optimizer-owned parameter copies
this rank holds after the steps, the peak of live tensor bytes in one extra step (PyTorch MemTracker), and what
the contender reports about itself (world size, wrapper, threads) for the silent-fallback checks.
No torchloom import here: the contender module imports what it needs.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def state_bytes(prep) -> dict[str, int]:
    """Bytes this rank holds: ``param_bytes`` (model parameters, local shards), ``optim_state_bytes`` (tensors in
    the innermost optimizer's state, e.g. AdamW moments), ``optim_param_copy_bytes`` (tensors the optimizer
    steps that are not the model's parameters: master/flat partitions such as DeepSpeed's fp32 groups)."""
    import torch

    params = list(prep.module.parameters())
    pbytes = prep.param_bytes if prep.param_bytes is not None else sum(_nbytes(p) for p in params)
    model_ptrs = {_local(p).untyped_storage().data_ptr() for p in params if _local(p).numel()}
    opt_state = copies = 0
    seen = set()
    for group in getattr(prep.optimizer, "param_groups", []):
        for p in group["params"]:
            loc = _local(p)
            ptr = loc.untyped_storage().data_ptr() if loc.numel() else None
            if ptr is not None and ptr not in model_ptrs and ptr not in seen:
                seen.add(ptr)
                copies += loc.untyped_storage().nbytes()
    for st in getattr(prep.optimizer, "state", {}).values():
        opt_state += sum(_nbytes(v) for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"param_bytes": int(pbytes), "optim_state_bytes": int(opt_state), "optim_param_copy_bytes": int(copies)}


def tracked_peak(prep, x) -> dict:
    """Peak live tensor bytes during one more step, by category, from ``torch.distributed._tools`` (FSDPMemTracker
    for FSDP2 models, MemTracker otherwise), or the error when the tracker cannot follow the contender."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    try:
        roots = [m for m in prep.module.modules() if isinstance(m, FSDPModule)]
        if roots:
            mt = FSDPMemTracker(roots[0], prep.optimizer)
        else:
            mt = MemTracker()
            mt.track_external(prep.module, prep.optimizer)
        with mt:
            prep.step(x)
        peak = mt.get_tracker_snapshot("peak")
        dev = max(peak.values(), key=lambda v: v.get("Total", 0))
        return {"total": int(dev.get("Total", 0)), **{str(k).split(".")[-1].lower(): int(v)
                                                        for k, v in dev.items() if k != "Total"}}
    except Exception as e:  # noqa: BLE001 - a report column, not a failure of the run
        return {"error": f"{type(e).__name__}: {e}"[:400]}


def param_digest(prep) -> str:
    """SHA-256 of this rank's local parameter bytes after the steps, in ``module.parameters()`` order: equal on
    every rank of a replicated strategy, unless the replicas diverged (a gradient that was not all-reduced)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for p in prep.module.parameters():
        t = _local(p).detach().contiguous().cpu()
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def global_mean(loss) -> float:
    """The global batch's mean loss: the average over all ranks of each rank's reported loss. Each rank
    reports the mean over the rows it read (its data-parallel slice; pipeline and tensor-parallel peers report
    their slice's), so the average is the global mean for every strategy: comparable across contenders."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(loss)], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return float(t)


def run(cfg: dict) -> dict:
    import torch

    from benchmarks._memory import reset_peak_rss, rss_bytes
    from benchmarks.compare.common import build_model, global_batches, rank_slice

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(cfg["threads"])
    mod, name = cfg["contender"].split(":")
    contender = getattr(importlib.import_module(f"benchmarks.compare.{mod}"), "CONTENDERS")[name]
    total = cfg["warmup"] + cfg["steps"]
    data = global_batches(cfg["model"], cfg["global_batch"], total + 1)
    model = build_model(cfg["model"], seed=0, meta=contender.meta)
    full_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # meta tensors have sizes
    n_params = sum(p.numel() for p in model.parameters())  # before setup: wrappers may shard or replace them
    t0 = time.perf_counter()
    prep = contender.setup(model, {**cfg, "rank": rank, "world": world})
    setup_s = time.perf_counter() - t0
    import torch.distributed as dist

    seen_world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    setup_peak_rss = rss_bytes("VmHWM")
    reset_peak_rss()
    times, losses = [], []
    local = prep.batch_slice or (lambda b: rank_slice(b, rank, world))
    for i in range(total):
        x = local(data[i])
        t = time.perf_counter()
        loss = prep.step(x)
        times.append(time.perf_counter() - t)
        losses.append(global_mean(loss))  # after the clock stops: the check's all-reduce is not step time
    train_peak_rss = rss_bytes("VmHWM")
    out = {
        "rank": rank, "world": world, "setup_s": setup_s, "step_s": times, "loss": losses,
        "setup_peak_rss": setup_peak_rss, "train_peak_rss": train_peak_rss, "full_param_bytes": full_param_bytes,
        "n_params": n_params,
        "dist_world_size": seen_world, "contender_world_size": prep.world_size, "wrapper": prep.wrapper,
        "threads": torch.get_num_threads(), "notes": prep.notes, "precision": prep.precision, **state_bytes(prep),
        "param_digest": param_digest(prep),
    }
    if cfg.get("track", True):
        out["tracked_peak"] = tracked_peak(prep, local(data[total]))
    return out


def main() -> None:
    cfg, out_path = json.loads(sys.argv[1]), sys.argv[2]
    try:
        result = {"status": "ok", **run(cfg)}
    except BaseException as e:  # noqa: BLE001 - reported per contender, exactly
        result = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    with open(out_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".tmp", out_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["status"] == "ok" else 1)  # skip framework teardown (gloo/atexit hangs are not ours)


if __name__ == "__main__":
    main()
