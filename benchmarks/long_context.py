"""Long context: one long sample per step on one process vs split over 2 processes by context parallelism
(ring attention) and Ulysses, measured side by side in one run (ratios vs the single process).

    .venv/bin/python benchmarks/long_context.py [--seq 2048 8192] [--steps 3] [--warmup 1] [--only single cp2 ...]

The model is `loom train`'s default LlamaForCausalLM (SDPA attention) at ``--seq`` tokens, global batch 1,
AdamW, fp32. Per rank: median step time, activation memory = peak RSS during the steps minus the RSS before
them (VmHWM reset first; what the forward/backward add on top of weights, gradients and optimizer state),
tokens/s, the share of the step spent waiting for ring transfers (the exposed exchange; 0 without a ring), and
the loss (the same sample: the split must not change it beyond fp32 rounding). Last, the longest sequence each
row fits in a fixed per-rank activation budget, relative to the first row (bytes per token at the largest
``--seq``: activation memory is linear in the rank's tokens with a fused attention kernel). On a 2-core machine the two
ranks of a split run have one core each, the single process one core too: step-time ratios show what the
split costs or saves per sample, memory ratios what a rank needs for it. Four-process rows oversubscribe the 2
cores (two processes per core): their step times are not speed-ups.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROWS = {  # name: (processes, strategy)
    "single": (1, ["fsdp"]),
    "cp2": (2, [("parallel_mode", {"cp": 2}), "context_parallel", "fsdp"]),
    "ulysses2": (2, [("parallel_mode", {"cp": 2}), "ulysses", "fsdp"]),
    "cp4": (4, [("parallel_mode", {"cp": 4}), "context_parallel", "fsdp"]),
    "ulysses4": (4, [("parallel_mode", {"cp": 4}), "ulysses", "fsdp"]),
}


def run_row(strategy, seq: int, steps: int, warmup: int) -> dict:
    import torch

    import torchloom
    from _memory import reset_peak_rss, rss_bytes
    from torchloom.parallel.context.ring import RING_WAIT
    from torchloom.train.config import TrainConfig, read_yaml, resolve_config_path
    from torchloom.train.job import build_model

    cfg = TrainConfig.from_dict(read_yaml(resolve_config_path("default.yaml")))
    cfg.model.seq_len = seq
    model = build_model(cfg.model, cfg.model.vocab_size, eos_id=0, seed=0)
    res = torchloom.auto_accelerate(
        model, torch.optim.AdamW, None, lambda b, o: o.loss, strategy=strategy, optim_args={"lr": 1e-4},
        dataloader_args={"batch_size": 1}, model_input_format="unpack_dict")
    batch = torch.randint(0, cfg.model.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    times, losses = [], []
    res.train_step({"input_ids": batch, "labels": batch})  # optimizer state exists from here on
    before = rss_bytes("VmRSS")
    reset_peak_rss()
    waits = []
    for _ in range(warmup + steps):
        RING_WAIT["seconds"] = 0.0
        t0 = time.perf_counter()
        losses.append(float(res.train_step({"input_ids": batch, "labels": batch})))
        times.append(time.perf_counter() - t0)
        waits.append(RING_WAIT["seconds"])
    step = statistics.median(times[warmup:])
    return {"step_s": step, "act_bytes": rss_bytes("VmHWM") - before, "loss": losses[0],
            "ring_wait": statistics.median(waits[warmup:]) / step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=list(ROWS))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torchloom.testing import run_ranks

    print(f"{'seq':>6} {'row':9} {'step s':>7} {'x single':>8} {'tok/s':>7} {'act MiB/rank':>13} {'x single':>8} "
          f"{'ring wait':>9} {'loss':>8}")
    last = {}
    for seq in args.seq:
        rows = {n: run_ranks(run_row, ROWS[n][0], ROWS[n][1], seq, args.steps, args.warmup, timeout=3600)
                for n in args.only}
        base = rows[args.only[0]]
        b_step, b_act = max(r["step_s"] for r in base), max(r["act_bytes"] for r in base)
        for name, per_rank in rows.items():
            step, act = max(r["step_s"] for r in per_rank), max(r["act_bytes"] for r in per_rank)
            wait = max(r["ring_wait"] for r in per_rank)
            last[name] = act / seq
            print(f"{seq:6d} {name:9} {step:7.3f} {step / b_step:8.2f} {seq / step:7.0f} {act / 2**20:13.0f} "
                  f"{act / b_act:8.2f} {wait:9.1%} {per_rank[0]['loss']:8.4f}")
    # activation memory grows linearly with the tokens a rank holds (fused attention: no [S, S] scores), so at a
    # fixed per-rank budget the longest sequence scales as the inverse of the bytes per token at the largest seq
    base = last[args.only[0]]
    print(f"longest sequence at a fixed per-rank activation budget, x {args.only[0]} (bytes per token at "
          f"seq {args.seq[-1]}): " + ", ".join(f"{n} {base / b:.2f}x" for n, b in last.items()))


if __name__ == "__main__":
    main()
