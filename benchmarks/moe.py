"""Expert parallelism on the MoE variant of the default `loom train` model: ep=1 vs ep=2 vs ep=4 on 4 processes
at equal global batch, measured side by side in one run (ratios vs ep=1).

    .venv/bin/python benchmarks/moe.py [--nproc 4] [--experts 8] [--steps 4] [--warmup 1] [--out benchmarks/results]

The model is the default config with ``model.moe.num_experts`` experts (``MixtralForCausalLM``, top-2, the
job's loss with the load-balancing term); every contender trains a copy of it with the job's AdamW under
``[parallel_mode {ep}, expert_parallel, ddp]`` (ep=1: plain ddp) on dp = nproc ranks, the same per-rank
batches (random tokens, the default global batch of 16 x 128). One process group holds all contenders, and
their steps are interleaved (round r: one timed step of each), so a slow phase of the shared machine hits all
of them alike. Per contender:

* step time: median over the rounds of the slowest rank's step (``torchloom.search.measure.measure_steps``,
  the repo's one step measurement), and tokens/s = global tokens / step time;
* all-to-all share: seconds this rank spent in the expert dispatch/combine all-to-alls
  (``torchloom.parallel.expert.dispatch.alltoall_seconds``, forward and backward) over its step time, the
  largest rank's (0 for ep=1: no all-to-all);
* peak memory per rank: the peak of live tensor bytes during one extra step (``measure_steps``' MemTracker on
  CPU, CUDA's max_memory_allocated on a GPU) and the parameter + gradient + optimizer-state bytes each rank
  holds (local shards: what ep divides), the largest rank's.

On a 2-core machine 4 processes oversubscribe the CPU, so step times compare the work and communication
per step, not speed-ups; read the ratios. Results: ``<out>/moe.json`` and ``<out>/moe.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _config(experts: int, seq_len: int | None):
    from torchloom.train.config import TrainConfig

    over = [f"model.moe.num_experts={experts}"] + ([f"model.seq_len={seq_len}"] if seq_len else [])
    return TrainConfig.load("default", over)


def _strategy(ep: int) -> list:
    return ["ddp"] if ep == 1 else [{"parallel_mode": {"ep": ep}}, "expert_parallel", "ddp"]


def run_contenders(eps: list[int], experts: int, steps: int, warmup: int, seq_len: int | None) -> dict:
    """On every rank: build one accelerated copy of the model per ep, interleave their steps, measure."""
    import torch
    import torch.distributed as dist

    import torchloom
    from torchloom.parallel.expert.dispatch import alltoall_seconds, reset_alltoall_seconds
    from torchloom.search.measure import measure_steps
    from torchloom.train.job import CausalLMLoss, adamw, build_model

    cfg = _config(experts, seq_len)
    mc, t = cfg.model, cfg.train
    runs = {}
    for ep in eps:
        model = build_model(mc, mc.vocab_size, eos_id=0, seed=0)  # the same initial weights for every contender
        n_params = sum(p.numel() for p in model.parameters())
        res = torchloom.auto_accelerate(
            model, adamw, None, CausalLMLoss(mc.moe.aux_loss_weight), strategy=_strategy(ep),
            optim_args={"lr": t.lr, "weight_decay": t.weight_decay, "betas": (t.beta1, t.beta2)},
            dataloader_args={"batch_size": t.global_batch}, model_input_format="unpack_dict",
            max_grad_norm=t.max_grad_norm, seed=0)
        g = torch.Generator().manual_seed(res.mesh.dp_rank)  # each data-parallel rank its own tokens, same for all ep
        ids = torch.randint(0, mc.vocab_size, (res.micro_batch_size, mc.seq_len), generator=g)
        runs[ep] = {"res": res, "batch": {"input_ids": ids, "labels": ids.clone()}, "times": [], "a2a": [],
                    "n_params": n_params}
    for ep in eps:  # warm-up (untimed) of every contender first
        r = runs[ep]
        measure_steps(r["res"], [r["batch"]], steps=1, warmup=max(0, warmup - 1), track_memory=False)
    for _ in range(steps):  # interleaved: one timed step of each contender per round
        for ep in eps:
            r = runs[ep]
            reset_alltoall_seconds()
            m = measure_steps(r["res"], [r["batch"]], steps=1, warmup=0, track_memory=False)
            mine = m.rank_step_times[dist.get_rank()][0]
            r["times"].append(m.step_time_s)
            r["a2a"].append(alltoall_seconds() / mine if mine > 0 else 0.0)
    out = {}
    for ep in eps:
        r = runs[ep]
        mem = measure_steps(r["res"], [r["batch"]], steps=1, warmup=0, track_memory=True)
        state = [None] * dist.get_world_size()
        from torchloom.search.measure import model_state_bytes

        dist.all_gather_object(state, model_state_bytes(r["res"]))
        a2a = [None] * dist.get_world_size()
        dist.all_gather_object(a2a, statistics.median(r["a2a"]))
        out[ep] = {"step_s": statistics.median(r["times"]), "step_times": r["times"],
                   "tokens_per_step": r["res"].global_batch_size * mc.seq_len,
                   "alltoall_share_per_rank": a2a, "peak_bytes_per_rank": mem.rank_peak_bytes,
                   "memory_method": mem.memory_method, "memory_error": mem.memory_error,
                   "state_bytes_per_rank": [s["params"] + s["optimizer"] for s in state],
                   "n_params": r["n_params"], "micro_batch": r["res"].micro_batch_size,
                   "dp": r["res"].mesh.dp_size, "ep": r["res"].mesh.dims.ep}
    return out


def table(results: dict, meta: dict) -> str:
    base = results[min(results)]
    lines = [f"model: MoE default ({meta['experts']} experts, top-2), {base['n_params'] / 1e6:.2f} M parameters, "
             f"{base['tokens_per_step']} tokens/step, {meta['nproc']} processes (dp={base['dp']}), median of "
             f"{meta['steps']} interleaved steps after {meta['warmup']} warm-up", "",
             "| ep | step s | x ep1 | tokens/s | all-to-all share (max rank) | peak tensor MiB (max rank) | x ep1 "
             "| params+optim MiB (max rank) | x ep1 |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    b_peak, b_state = max(base["peak_bytes_per_rank"]), max(base["state_bytes_per_rank"])
    for ep, r in sorted(results.items()):
        peak, state = max(r["peak_bytes_per_rank"]), max(r["state_bytes_per_rank"])
        peak_s = f"{peak / 2**20:.1f}" if peak > 0 else "n/a"
        ratio = f"{peak / b_peak:.2f}" if peak > 0 and b_peak > 0 else "n/a"
        lines.append(f"| {ep} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} | "
                     f"{r['tokens_per_step'] / r['step_s']:,.0f} | {max(r['alltoall_share_per_rank']):.1%} | "
                     f"{peak_s} | {ratio} | {state / 2**20:.1f} | {state / b_state:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--eps", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per contender (interleaved rounds)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=None, help="override model.seq_len (default: the config's)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--name", default="moe", help="results file stem")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // args.nproc)))
    from torchloom.testing import run_ranks

    per_rank = run_ranks(run_contenders, args.nproc, args.eps, args.experts, args.steps, args.warmup, args.seq_len,
                         timeout=3600)
    results = per_rank[0]  # every rank holds the gathered numbers
    meta = {"nproc": args.nproc, "experts": args.experts, "steps": args.steps, "warmup": args.warmup,
            "seq_len": args.seq_len, "cpu_count": os.cpu_count(), "omp_threads": os.environ["OMP_NUM_THREADS"]}
    text = table(results, meta)
    print("\n" + text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "results": {str(k): v for k, v in
                                                                                 results.items()}}, indent=1))
    (out / f"{args.name}.md").write_text(f"# benchmarks/moe.py\n\n```\n{' '.join(sys.argv)}\n```\n\n{text}\n")
    print(f"\nsaved {out / (args.name + '.json')} and {out / (args.name + '.md')}")


if __name__ == "__main__":
    main()
