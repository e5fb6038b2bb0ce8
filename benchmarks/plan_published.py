"""``loom plan``'s predictions for published GPU training runs, each priced with its published plan.

The rows live in ``benchmarks/published_runs.yaml`` (sources cited per row; parsed by ``benchmarks/published.py``).
No constant of the cost model is fitted to them: another set of published runs is kept back and checked
independently. For every row: the model (a preset or its sizes), the row's cluster (the accelerator table with
what the row publishes about its hosts), its plan (TP/SP, PP with its schedule, CP, EP, FSDP/ZeRO/DDP, bf16/fp8,
activation checkpointing, fused kernels for Megatron/NeMo rows) -> predicted tokens/s per GPU and peak memory,
against the published ones.

Published throughput: tokens/s per GPU when given; else TFLOP/s per GPU converted with the source's own FLOP
count (``published.flops_convention``: ``megatron`` = Narayanan et al. 2021 eq. 3 with recomputation
``96 B s l h^2 (1 + s/6h + V/16lh)``, ``megatron_no_recompute`` = the same with 72, ``6n`` = 6 x parameters,
``palm`` = 6 N + 12 l h s, ``6n_causal`` = 6 N + 6 l h s), or MFU x the bf16 peak over the ``palm`` count.

Run:  .venv/bin/python benchmarks/plan_published.py [--json] [--only ID,...] [--search ID,...]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.published import GiB, PublishedRun, candidate, hardware, load_runs, model_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "plan_published.json"

#: what the numbers show and what is not modelled (kept with the generator so the page stays whole)
KNOWN_MISSES = """## Where it misses, and why (not fixed by fitting)

- **torchtitan rows (Meta's Grand Teton hosts) are predicted ~40% fast**, every one of them, while Megatron,
  NeMo and MPT rows on H100 land within about +-20%. The hosts are H100s with 96 GB HBM2e at 2.4 TB/s and a
  500 W power limit; torchtitan's own page says their real peak lies between the SXM and NVL parts and is
  unknown. The table prices them at the SXM part's 989 TFLOP/s: a power-capped part runs its tensor cores at
  lower clocks. No published figure for that peak was found; the rows keep the SXM numbers and the miss.
- **Long sequences with context parallelism** (torchtitan's 32k-262k rows) are predicted 1.8-2.5x fast:
  attention dominates there and PyTorch's ring attention (per-chunk SDPA plus the online-softmax merge,
  load-balanced causal chunks) runs well below the plain SDPA rate priced here.
- **MoE**: balanced routing and TP-replicated dispatch are assumed; Mixtral on B200/GB200 comes out 30-60%
  slow (the all-to-all and the grouped GEMMs on Blackwell have no published efficiency here), Qwen3-30B-A3B's
  Megatron-Bridge FP8 row 2x fast. Qwen3-235B's published plan (EP 32 over DP 16 x TP 2) cannot be expressed:
  torchloom carves experts from the data-parallel ranks only.
- **Memory**: 7 published plans that ran are still predicted not to fit: the three Llama 3 paper rows
  (Meta's own kernels and pipeline schedule, priced as eager Hugging Face layers with 1F1B in-flight
  activations), MPT-1B on 40 GB (40.3 GiB: the GPT-2 stand-in's eager blocks keep more than MPT's low-precision
  LayerNorm and Triton attention), and the Qwen3 MoE rows (balanced routing, expert buffers). Modelled since
  2026-12-05 (each from the framework's source, not fitted): FSDP reducing every micro-batch (torchtitan,
  Composer, AutoModel, Megatron-FSDP: `accumulate_sharded`); Transformer Engine keeping FP8 GEMM inputs for
  backward and Megatron-Bridge's `fp8_param_gather` (FP8 weights gathered); llm-foundry's fused cross-entropy
  and torchtitan's compiled loss (2025 rows); the rest's transient as lines in the micro-batch (state-sized
  weight gradients no longer multiplied by it); and compile no longer shrinking the block inputs that full
  checkpointing keeps. Not-fit rows 14 -> 7, memory median error 20.3% -> 12.9%.
- **Llama 3 paper rows**: the paper's TFLOP/s convention is not restated in the stored sources, so they are
  priced but not scored.
"""
_ANALYSES: dict = {}


def analyse(run: PublishedRun):
    """The model's analysis at the row's sequence length, attention traced as a GPU flash kernel (memoised)."""
    from torchloom.cost import analysis
    from torchloom.cost.presets import resolve_model

    cfg = model_config(run)
    seq = int(run.batch["seq_len"])
    key = (json.dumps(cfg, sort_keys=True), seq)
    if key not in _ANALYSES:
        if isinstance(cfg, str):
            _ANALYSES[key] = resolve_model(cfg).analyze(seq, attention="flash")
        else:
            _ANALYSES[key] = analysis.analyze_config(dict(cfg), seq_len=seq, name=run.model.get("name"),
                                                     attention="flash")
    return _ANALYSES[key]


def source_flops_per_token(run: PublishedRun, info) -> float | None:
    """FLOPs per token under the source's convention (see the module docstring), or None when unknown."""
    conv = (run.published.get("flops_convention") or "").lower()
    m, seq = run.model, int(run.batch["seq_len"])
    layers = int(m.get("layers") or info.dims.get("num_layers") or 0)
    h = int(m.get("hidden") or info.dims.get("hidden_size") or 0)
    vocab = int(m.get("vocab") or info.dims.get("vocab_size") or 0)
    n = float(m.get("active_params_b") or m.get("params_b") or 0) * 1e9 or float(info.n_params)
    if conv in ("megatron", "megatron_no_recompute"):
        k = 96 if conv == "megatron" else 72
        return k * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))
    if conv == "6n":
        return 6 * n
    if conv == "palm":
        return 6 * n + 12 * layers * h * seq
    if conv == "6n_causal":
        return 6 * n + 6 * layers * h * seq
    return None


def published_tps(run: PublishedRun, info, peak_bf16: float) -> tuple[float | None, str]:
    """(published tokens/s per GPU, how it was obtained)."""
    if run.published_tps:
        return run.published_tps, "tokens/s"
    tfl = run.published.get("tflops_per_gpu")
    fpt = source_flops_per_token(run, info)
    if tfl and fpt:
        return float(tfl) * 1e12 / fpt, f"TFLOP/s ({run.published.get('flops_convention')})"
    mfu = run.published.get("mfu")
    if mfu:
        m = run.model
        n = float(m.get("active_params_b") or m.get("params_b") or 0) * 1e9 or float(info.n_params)
        layers, h = info.dims.get("num_layers", 0), info.dims.get("hidden_size", 0)
        palm = 6 * n + 12 * layers * h * int(run.batch["seq_len"])
        return float(mfu) * peak_bf16 / palm, "MFU (palm count)"
    return None, "no convention to convert its TFLOP/s"


def price(run: PublishedRun) -> dict:
    from torchloom.search.pricing import predict

    t0 = time.perf_counter()
    info = analyse(run)
    hw = hardware(run)
    cand = candidate(run)
    p = predict(cand, info, hw)
    pub, how = published_tps(run, info, hw.peak_flops.get("bfloat16", 0.0))
    pred = p.tokens_per_s_per_device
    gib = run.published.get("memory_gib")
    return {
        "id": run.id, "source": run.source.get("name"), "gpu": run.hardware["gpu"], "gpus": run.gpus,
        "model": run.model.get("name"), "plan": cand.label(), "seq_len": cand.seq_len,
        "published_tps_per_gpu": pub, "published_from": how, "predicted_tps_per_gpu": pred,
        "tps_rel_error": pred / pub - 1.0 if pub else None,
        "published_gib": gib, "predicted_gib": p.peak_memory_bytes / GiB,
        "memory_rel_error": p.peak_memory_bytes / GiB / float(gib) - 1.0 if gib else None,
        "fits": p.fits, "memory_limit_gib": p.memory_limit_bytes / GiB,
        "predicted_mfu": p.mfu, "predicted_hfu": p.hfu, "step_time_s": p.step_time_s,
        "time": p.time, "memory_gib": {k: v / GiB for k, v in p.memory.items()}, "notes": p.notes,
        "kernels": "fused" if run.fused else "eager", "attention_kernel": hw.attention_kernel,
        "wall_s": time.perf_counter() - t0,
    }


def search_best(run: PublishedRun) -> dict:
    """The planner's own best plan for the row's cluster, batch and sequence (bf16, the default kernels)."""
    from torchloom.search.plan_cli import plan

    name = model_config(run)
    if not isinstance(name, str):
        return {"id": run.id, "skipped": "not a preset"}
    rep = plan(name, gpu=str(run.hardware["gpu"]), gpus=run.gpus,
               gpus_per_node=int(run.hardware.get("gpus_per_node") or 8), seq_len=int(run.batch["seq_len"]),
               global_batch=int(run.batch["global_batch"]))
    best = rep.rows[0]
    return {"id": run.id, "best": best.candidate.label(), "best_tps_per_gpu": best.prediction.tokens_per_s_per_device,
            "search_s": rep.elapsed_s if hasattr(rep, "elapsed_s") else None}


def summary(rows: list[dict]) -> dict:
    errs = [abs(r["tps_rel_error"]) for r in rows if r["tps_rel_error"] is not None]
    mems = [abs(r["memory_rel_error"]) for r in rows if r["memory_rel_error"] is not None]
    return {
        "rows": len(rows), "rows_with_throughput": len(errs),
        "median_abs_tps_error": statistics.median(errs) if errs else None,
        "mean_abs_tps_error": statistics.fmean(errs) if errs else None,
        "max_abs_tps_error": max(errs) if errs else None,
        "within_10pct": sum(e <= 0.10 for e in errs), "within_20pct": sum(e <= 0.20 for e in errs),
        "signed_median_tps_error": statistics.median([r["tps_rel_error"] for r in rows
                                                      if r["tps_rel_error"] is not None]) if errs else None,
        "memory_rows": len(mems), "median_abs_memory_error": statistics.median(mems) if mems else None,
        "max_abs_memory_error": max(mems) if mems else None,
        "published_plans_predicted_not_to_fit": [r["id"] for r in rows if not r["fits"]],
    }


DOC = Path(__file__).resolve().parent.parent / "docs" / "published_runs.md"
DOC_HEAD = """# Published training runs, priced with their plans

Generated by `benchmarks/plan_published.py --write` (do not edit by hand: rerun it). Every row of
`benchmarks/published_runs.yaml` (a public training run: model, hardware, GPU count, parallel plan, batch,
sequence, precision, checkpointing, and its published tokens/s or TFLOP/s per GPU and memory, with its source)
is priced by `loom plan`'s cost model with the row's own plan; nothing in the cost model is fitted to these rows
(another set of published runs is kept back and checked independently). How a row becomes planner input
(`benchmarks/published.py`):

- **Kernels**: Megatron-LM / NeMo / Megatron-Bridge rows run Transformer Engine's fused kernels: priced with
  fused op chains (the `compile` rule: `PassCost.fused_bytes`, chain-internal activations not saved) and the
  `flash3` attention kernel (cuDNN fused attention, FlashAttention-3 class); torchtitan/MPT/AutoModel rows run
  PyTorch SDPA (`flash2`) and fuse only where the row says `compile`.
- **Plan**: TP with sequence parallelism and vocabulary-parallel cross-entropy (`loss_parallel`: Megatron's
  `vocab_parallel_cross_entropy`, torchtitan's default); PP with the row's schedule (interleaved when it has
  virtual stages); CP with FSDP over `dp_shard x cp`; Megatron's distributed optimizer as FSDP ZeRO-2 (the same
  bytes per parameter, 2 + 4 + 12/dp under mixed precision, and the same two overlapped collectives); FSDP rows
  as ZeRO-3 (HSDP where the row has replicas); fp8 as the `float8` method on bf16 amp.
- **Hardware**: the accelerator table entry with what the row publishes about its hosts (memory size,
  HBM bandwidth, NVLink; H800 = H100 with 400 GB/s NVLink).
- **Published throughput**: tokens/s per GPU where given; else TFLOP/s per GPU converted with the source's own
  FLOP count (`flops_convention`); rows without a convertible number are priced but not scored.
"""


def markdown(out: dict) -> str:
    s = out["summary"]
    L = [DOC_HEAD, "## Results", ""]
    if s["median_abs_tps_error"] is not None:
        L.append(f"Throughput: {s['rows_with_throughput']} scored rows, median |error| "
                 f"{s['median_abs_tps_error']:.1%}, mean {s['mean_abs_tps_error']:.1%}, max "
                 f"{s['max_abs_tps_error']:.1%}, signed median {s['signed_median_tps_error']:+.1%} (positive: "
                 f"predicted faster than published); within 10%: {s['within_10pct']}, within 20%: "
                 f"{s['within_20pct']}. Targets (issue [12]): median <= 10%, every row within 20%.")
    if s["median_abs_memory_error"] is not None:
        L.append(f"Memory: {s['memory_rows']} rows publish it, median |error| {s['median_abs_memory_error']:.1%}, "
                 f"max {s['max_abs_memory_error']:.1%} (target 15%).")
    nf = s["published_plans_predicted_not_to_fit"]
    L.append(f"Published plans predicted not to fit: {len(nf)} ({', '.join(nf) or 'none'}).")
    fams: dict[str, list[float]] = {}
    for r in out["rows"]:
        if r.get("tps_rel_error") is not None:
            fams.setdefault(r["id"].split("-")[0], []).append(r["tps_rel_error"])
    L += ["", "| source family | rows | signed median error | median abs error |", "|---|---|---|---|"]
    for k, v in sorted(fams.items()):
        L.append(f"| {k} | {len(v)} | {statistics.median(v):+.1%} | {statistics.median(abs(e) for e in v):.1%} |")
    L += ["", "| id | GPUs | published tok/s/GPU | predicted | error | published GiB | predicted GiB | fits | plan |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        if "error" in r:
            L.append(f"| {r['id']} | | | cannot price: {r['error'][:160]} | | | | | |")
            continue
        pub = f"{r['published_tps_per_gpu']:,.0f}" if r["published_tps_per_gpu"] else "–"
        err = f"{r['tps_rel_error']:+.1%}" if r["tps_rel_error"] is not None else "–"
        gib = f"{r['published_gib']:.1f}" if r["published_gib"] else "–"
        L.append(f"| {r['id']} | {r['gpus']} {r['gpu']} | {pub} | {r['predicted_tps_per_gpu']:,.0f} | {err} | {gib} | "
                 f"{r['predicted_gib']:.1f} | {'yes' if r['fits'] else '**no**'} | `{r['plan'].replace('|', '/')}` |")
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the rows and the summary as JSON")
    ap.add_argument("--only", help="comma-separated row ids")
    ap.add_argument("--search", default="", help="comma-separated row ids to also search the planner's best plan for")
    ap.add_argument("--write", action="store_true",
                    help="write benchmarks/results/plan_published.json and docs/published_runs.md")
    args = ap.parse_args(argv)
    runs = load_runs()
    if args.only:
        want = set(args.only.split(","))
        unknown = sorted(want - {r.id for r in runs})
        if unknown:
            ap.error(f"--only: unknown id(s) {', '.join(unknown)}; the ids are in benchmarks/published_runs.yaml")
        runs = [r for r in runs if r.id in want]
    rows = []
    for run in runs:
        try:
            rows.append(price(run))
        except Exception as e:  # noqa: BLE001  (a row the planner cannot price is reported, never skipped silently)
            rows.append({"id": run.id, "error": f"{type(e).__name__}: {e}", "tps_rel_error": None,
                         "memory_rel_error": None, "fits": True})
    searched = [search_best(r) for r in runs if r.id in set(filter(None, args.search.split(",")))]
    out = {"rows": rows, "summary": summary([r for r in rows if "error" not in r]), "search": searched,
           "errors": [r for r in rows if "error" in r]}
    if args.write:
        RESULTS.write_text(json.dumps(out, indent=1, default=str) + "\n")
        DOC.write_text(markdown(out) + "\n" + KNOWN_MISSES)
    if args.json:
        print(json.dumps(out, indent=1, default=str))
        return 0
    head = (f"{'id':<34} {'gpu':<9} {'gpus':>6} {'tok/s/GPU pub':>13} {'pred':>8} {'err':>7}   {'GiB pub':>7} "
            f"{'pred':>6} {'err':>7} {'MFU':>5}  plan")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['id']:<34} cannot price: {r['error']}")
            continue
        pub = f"{r['published_tps_per_gpu']:13,.0f}" if r["published_tps_per_gpu"] else f"{'-':>13}"
        err = f"{r['tps_rel_error'] * 100:+6.1f}%" if r["tps_rel_error"] is not None else f"{'-':>7}"
        gib = f"{r['published_gib']:7.1f}" if r["published_gib"] else f"{'-':>7}"
        merr = f"{r['memory_rel_error'] * 100:+6.1f}%" if r["memory_rel_error"] is not None else f"{'-':>7}"
        fit = "" if r["fits"] else " DOES NOT FIT"
        print(f"{r['id']:<34} {r['gpu']:<9} {r['gpus']:>6} {pub} {r['predicted_tps_per_gpu']:8,.0f} {err}   {gib} "
              f"{r['predicted_gib']:6.1f} {merr} {r['predicted_mfu'] * 100:4.1f}%  {r['plan']}{fit}")
    s = out["summary"]
    print()
    if s["median_abs_tps_error"] is not None:
        print(f"throughput: {s['rows_with_throughput']} rows, median |error| {s['median_abs_tps_error']:.1%}, mean "
              f"{s['mean_abs_tps_error']:.1%}, max {s['max_abs_tps_error']:.1%}, signed median "
              f"{s['signed_median_tps_error']:+.1%}; within 10%: {s['within_10pct']}, within 20%: {s['within_20pct']}")
    if s["median_abs_memory_error"] is not None:
        print(f"memory: {s['memory_rows']} rows, median |error| {s['median_abs_memory_error']:.1%}, max "
              f"{s['max_abs_memory_error']:.1%}")
    print(f"published plans predicted not to fit: {s['published_plans_predicted_not_to_fit'] or 'none'}")
    for b in searched:
        print(f"search {b['id']}: {b.get('best', b.get('skipped'))} {b.get('best_tps_per_gpu', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
