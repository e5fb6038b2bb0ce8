"""Step time and per-rank memory of the default `loom train` model under data, tensor, pipeline and 2D
parallelism on 4 processes, measured side by side in one run (ratios vs the first strategy, DDP).

    .venv/bin/python benchmarks/hybrid.py [--nproc 4] [--steps 6] [--warmup 2] [--only dp tp pp ...]

Every strategy trains the same model on the same global batch (16 x 128 tokens) with AdamW. Memory on
CPU, per rank: peak RSS (VmHWM, reset before training; includes the ~0.5 GiB PyTorch runtime) and the
bytes of parameters + gradients + optimizer state this rank holds (local shards: what TP/PP/FSDP divide).
On a 2-core machine 4 processes oversubscribe the CPU, so step times measure relative communication and
scheduling overheads, not speed-ups; read the ratios, not the absolute numbers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STRATEGIES = {
    "dp": ["ddp"],
    "zero3": ["fsdp"],
    "tp": [("parallel_mode", {"tp": 4}), "tensor_parallel"],
    "tp+sp": [("parallel_mode", {"tp": 4}), "tensor_parallel", "sequence_parallel", "loss_parallel"],
    "pp": [("parallel_mode", {"pp": 4}), ("pipeline_parallel", {"schedule": "1f1b"})],
    "dp2xtp2": [("parallel_mode", {"dp_shard": 2, "tp": 2}), "tensor_parallel", "fsdp"],
    "pp2xdp2": [("parallel_mode", {"pp": 2, "dp_replicate": 2}), ("pipeline_parallel", {"schedule": "1f1b"}), "ddp"],
    "pp2xtp2": [("parallel_mode", {"pp": 2, "tp": 2}), ("pipeline_parallel", {"schedule": "1f1b"}),
                "tensor_parallel"],
}


def _config():
    from torchloom.train.config import TrainConfig, read_yaml, resolve_config_path

    return TrainConfig.from_dict(read_yaml(resolve_config_path("default.yaml")))


def run_strategy(strategy, steps: int, warmup: int) -> dict:
    import torch

    import torchloom
    from _memory import model_state_bytes, reset_peak_rss, rss_bytes
    from torchloom.train.job import build_model

    cfg = _config()
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.model.vocab_size, eos_id=0, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    res = torchloom.auto_accelerate(
        model, torch.optim.AdamW, None, lambda b, o: o.loss, strategy=strategy, optim_args={"lr": 1e-4},
        dataloader_args={"batch_size": cfg.train.global_batch}, model_input_format="unpack_dict",
    )
    mb, seq, vocab = res.micro_batch_size, cfg.model.seq_len, cfg.model.vocab_size
    # tensor/pipeline peers must read the same batch: seed by the data-parallel rank
    g = torch.Generator().manual_seed(res.mesh.dp_rank)
    batch = torch.randint(0, vocab, (mb, seq), generator=g)
    times, losses = [], []
    reset_peak_rss()
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        for _ in range(res.grad_accum_steps):
            losses.append(float(res.train_step({"input_ids": batch, "labels": batch})))
        times.append(time.perf_counter() - t0)
    state = model_state_bytes(res.model, res.optimizer)
    # gradients are freed after each step (set_to_none): a gradient is the size of its trainable parameter
    state["grad_bytes"] = state["param_bytes"]
    return {"step_s": statistics.median(times[warmup:]), "peak_rss": rss_bytes("VmHWM"), "n_params": n_params,
            "tokens_per_step": cfg.train.global_batch * seq, "last_loss": losses[-1], **state}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=list(STRATEGIES))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.nproc)))
    from torchloom.testing import run_ranks

    rows = {name: run_ranks(run_strategy, args.nproc, STRATEGIES[name], args.steps, args.warmup, timeout=1800)
            for name in args.only}
    base = rows[args.only[0]]
    b_step = max(r["step_s"] for r in base)
    b_state = max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in base)
    print(f"\nmodel: {base[0]['n_params'] / 1e6:.2f} M parameters, {base[0]['tokens_per_step']} tokens/step, "
          f"{args.nproc} processes, median of {args.steps} steps after {args.warmup} warm-up")
    hdr = (f"{'strategy':9} {'step s':>7} {'x ' + args.only[0]:>6} {'tok/s':>7} {'peak RSS MiB per rank':>22} "
           f"{'model state MiB (max rank)':>27} {'x ' + args.only[0]:>6} {'loss after':>10}")
    print(hdr)
    print("-" * len(hdr))
    for name, per_rank in rows.items():
        step = max(r["step_s"] for r in per_rank)
        state = max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in per_rank)
        rss = "/".join(f"{r['peak_rss'] / 2**20:.0f}" for r in per_rank)
        print(f"{name:9} {step:7.3f} {step / b_step:6.2f} {per_rank[0]['tokens_per_step'] / step:7.0f} {rss:>22} "
              f"{state / 2**20:27.1f} {state / b_state:6.2f} {per_rank[-1]['last_loss']:10.4f}")


if __name__ == "__main__":
    main()
