"""Step time and per-rank memory of the default `loom train` model under DDP, ZeRO-1, ZeRO-2, ZeRO-3 and
ZeRO-3 + activation checkpointing, measured side by side in one run (ratios vs DDP).

    .venv/bin/python benchmarks/strategies.py [--nproc 2] [--steps 8] [--warmup 2]

Memory on CPU (``torch.cuda.max_memory_allocated`` is 0 there), three views per rank: peak RSS (VmHWM,
reset before training; dominated by the ~0.5 GiB PyTorch runtime), the peak of live tensor bytes during
one step from PyTorch's MemTracker/FSDPMemTracker (parameters, gradients, optimizer state, activations),
and the bytes of parameters, gradients and optimizer state held after a step (local shards).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STRATEGIES = {
    "ddp": ["ddp"],
    "zero1": ["zero1"],
    "zero2": ["zero2"],
    "zero3": ["zero3"],
    "zero3+ac": ["zero3", "checkpoint"],
}


def _model_config():
    from torchloom.train.config import TrainConfig, read_yaml, resolve_config_path

    return TrainConfig.from_dict(read_yaml(resolve_config_path("default.yaml")))


def run_strategy(strategy, steps: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist

    import torchloom
    from _memory import model_state_bytes, reset_peak_rss, rss_bytes
    from torchloom.train.job import build_model

    cfg = _model_config()
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.model.vocab_size, eos_id=0, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    res = torchloom.auto_accelerate(
        model, torch.optim.AdamW, None, lambda b, o: o.loss, strategy=strategy, optim_args={"lr": 1e-4},
        dataloader_args={"batch_size": cfg.train.global_batch}, model_input_format="unpack_dict",
    )
    mb, seq, vocab = res.micro_batch_size, cfg.model.seq_len, cfg.model.vocab_size
    g = torch.Generator().manual_seed(dist.get_rank())
    batch = torch.randint(0, vocab, (mb, seq), generator=g)
    times = []
    reset_peak_rss()
    base = rss_bytes("VmRSS")
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        for _ in range(res.grad_accum_steps):
            res.train_step({"input_ids": batch, "labels": batch})
        times.append(time.perf_counter() - t0)
    peak = rss_bytes("VmHWM")
    tracked = tracked_peak_bytes(res, {"input_ids": batch, "labels": batch})
    # one more forward/backward without the step so gradients are present for the byte count
    out = res.model(input_ids=batch, labels=batch)
    out.loss.backward()
    state = model_state_bytes(res.model, res.optimizer)
    res.optimizer.zero_grad()
    return {"step_s": statistics.median(times[warmup:]), "peak_rss": peak, "rss_growth": peak - base,
            "tracked_peak": tracked,
            "n_params": n_params, "tokens_per_step": cfg.train.global_batch * seq, **state}


def tracked_peak_bytes(res, batch) -> int:
    """Peak bytes of live tensors during one optimizer step, from PyTorch's MemTracker (FSDPMemTracker
    for FSDP models): parameters, gradients, optimizer state, activations and temporaries. -1 if the
    tracker cannot follow this model."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    try:
        if isinstance(res.model, FSDPModule):
            mt = FSDPMemTracker(res.model, res.optimizer)
        else:
            mt = MemTracker()
            mt.track_external(res.model, res.optimizer)
        with mt:
            for _ in range(res.grad_accum_steps):
                res.train_step(batch)
                mt.reset_mod_stats()
        snap = mt.get_tracker_snapshot("peak")
        return max(v.get("Total", 0) for v in snap.values())
    except Exception as e:  # noqa: BLE001 - a benchmark column, not a failure
        print(f"MemTracker failed: {type(e).__name__}: {e}", file=sys.stderr)
        return -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=list(STRATEGIES))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.nproc)))
    from torchloom.testing import run_ranks

    rows = {}
    for name in args.only:
        per_rank = run_ranks(run_strategy, args.nproc, STRATEGIES[name], args.steps, args.warmup, timeout=1800)
        rows[name] = per_rank
    base = rows[args.only[0]]
    b_step = max(r["step_s"] for r in base)
    b_state = max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in base)
    b_tracked = max(r["tracked_peak"] for r in base)
    n = base[0]["n_params"]
    print(f"\nmodel: {n / 1e6:.2f} M parameters, {base[0]['tokens_per_step']} tokens/step, {args.nproc} processes, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    hdr = (f"{'strategy':10} {'step s':>8} {'x ' + args.only[0]:>8} {'tok/s':>9} {'peak RSS MiB/rank':>18} "
           f"{'tracked peak MiB':>17} {'x ' + args.only[0]:>8} {'params+grads+optim MiB':>23} {'x ' + args.only[0]:>8}")
    print(hdr)
    print("-" * len(hdr))
    for name, per_rank in rows.items():
        step = max(r["step_s"] for r in per_rank)
        state = max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in per_rank)
        rss = "/".join(f"{r['peak_rss'] / 2**20:.0f}" for r in per_rank)
        tracked = max(r["tracked_peak"] for r in per_rank)
        print(f"{name:10} {step:8.3f} {step / b_step:8.2f} {per_rank[0]['tokens_per_step'] / step:9.0f} {rss:>18} "
              f"{tracked / 2**20:17.1f} {tracked / b_tracked:8.2f} {state / 2**20:23.1f} {state / b_state:8.2f}")


if __name__ == "__main__":
    main()
