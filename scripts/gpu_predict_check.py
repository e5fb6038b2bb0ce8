"""The cost model's step-time, throughput and memory predictions against one real GPU (issue [12]).

On one CUDA device, a ~125M-parameter Hugging Face ``LlamaForCausalLM`` built from a config (nothing is
downloaded: hidden 768, 12 layers, 12 heads, 4 KV heads, FFN 2048, vocabulary 32,000; sequence 2,048,
micro-batch 8, no accumulation, AdamW) is trained with ``torchloom.auto_accelerate`` in these variants:

  * ``bf16_eager``   ``[{amp: {dtype: bfloat16}}]``
  * ``bf16_compile`` ``+ compile`` (Inductor, per block)
  * ``fp8``          ``+ float8`` (torchao ``Float8Linear`` in the blocks; compute capability >= 8.9 and torchao)
  * ``fp8_compile``  ``+ float8 + compile`` (run last, only while the time budget lasts)

Each variant: ``--warmup`` steps (compilation happens there), then about ``--measure-s`` seconds of steps timed
in three synchronised chunks (``torch.cuda.synchronize``); measured step time (total / steps), tokens/s and peak
memory (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` after the warm-up). Beside it, the cost
model's prediction for the same plan (``torchloom.search.drift.plan_candidate``: the mesh, methods, micro-batch
and accumulation the run applied) on the unchanged model's meta-device analysis
(``analyze_model(..., attention="flash")``) with two hardware descriptions:

  * ``calibration``: this machine calibrated (``torchloom.cost.calibrate.local_hardware(1)``; the cache in
    ``--cache-dir`` when ``loom calibrate --cache-dir`` wrote one, else measured now, ~20 s);
  * ``table``: the accelerator table's entry for ``torch.cuda.get_device_name()``
    (``accelerators.match_device_name`` + ``cluster(acc, 1, 1)``).

Errors are signed: ``predicted / measured - 1``. Memory is compared twice: allocated peak with the prediction
less its allocator ``headroom``, reserved peak with the whole prediction. Everything goes to
``OUT/gpu_predict_check.json`` (rewritten after every variant, so a timeout keeps what finished); a table is
printed at the end. A variant that fails or is skipped is recorded with its reason and the others still run.

``--device cpu --tiny`` runs the same code on the CPU with a tiny Llama in seconds (``compile`` with the
``aot_eager`` backend; the float8 variants are skipped: no FP8 on a CPU, and no table entry): the check of this
script itself on a machine without a GPU.

Usage:
  python scripts/gpu_predict_check.py --out benchmarks/results/gpu_check [--cache-dir DIR]
  python scripts/gpu_predict_check.py --device cpu --tiny --out /tmp/gpc
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

VARIANTS = ("bf16_eager", "bf16_compile", "fp8", "fp8_compile")
FULL = dict(vocab=32000, hidden=768, ffn=2048, layers=12, heads=12, kv_heads=4, seq=2048, micro_batch=8)
TINY = dict(vocab=512, hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, seq=64, micro_batch=2)
#: seconds a variant may still need when it starts (build, warm-up with compilation, measurement); one that would
#: end past --budget-s is skipped (named in the results), so the step's timeout is not what stops it
START_MARGIN_S = {"bf16_eager": 35.0, "fp8": 35.0, "bf16_compile": 70.0, "fp8_compile": 90.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/gpu_check", help="output directory (created)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama (seconds on a CPU)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5; 2 with --tiny)")
    p.add_argument("--measure-s", type=float, default=None,
                   help="seconds of timed steps per variant (default 15; 2 with --tiny)")
    p.add_argument("--min-steps", type=int, default=6, help="timed steps at least")
    p.add_argument("--max-steps", type=int, default=1000, help="timed steps at most")
    p.add_argument("--budget-s", type=float, default=225.0,
                   help="a variant is not started when it would end after this many seconds from the start")
    p.add_argument("--cache-dir", default=None, help="calibration cache directory (as loom calibrate --cache-dir)")
    p.add_argument("--calibration-budget", type=float, default=None,
                   help="seconds of measurement when no cached calibration is usable (default 10; 3 with --tiny)")
    for k, v in FULL.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"default {v} ({TINY[k]} with --tiny)")
    args = p.parse_args(argv)
    shape = dict(TINY if args.tiny else FULL)
    for k in shape:
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    args.shape = shape
    args.warmup = max(1, args.warmup if args.warmup is not None else (2 if args.tiny else 5))
    args.measure_s = args.measure_s if args.measure_s is not None else (2.0 if args.tiny else 15.0)
    args.calibration_budget = args.calibration_budget if args.calibration_budget is not None else (
        3.0 if args.tiny else 10.0)
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variant_list if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    return args


# ------------------------------------------------------------------------------------------------ model and data
def llama_config(s):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], max_position_embeddings=s["seq"],
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"  # what torchloom runs on GPUs (flash kernel under SDPA)
    return cfg


def build_model(cfg, device: str = "cpu"):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


class RandomTokens:
    """A map-style dataset of ``length`` rows cycling over 64 fixed random rows (no generation per step)."""

    def __init__(self, vocab: int, seq: int, length: int):
        import torch

        g = torch.Generator().manual_seed(1)
        self.pool = torch.randint(0, vocab, (64, seq), generator=g)
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        r = self.pool[i % len(self.pool)]
        return {"input_ids": r, "labels": r}


def loss_func(batch, out):
    return out.loss


# ------------------------------------------------------------------------------------------------ hardware
def hardware(args, device_name: str | None):
    """``{"calibration": Hardware | None, "table": Hardware | None}`` and a record of each (source or why none)."""
    hws, record = {}, {}
    t = time.perf_counter()
    try:
        from torchloom.cost.calibrate import local_hardware

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hw = local_hardware(1, cache_dir=args.cache_dir, budget_s=args.calibration_budget)
        hws["calibration"] = hw
        record["calibration"] = {
            "name": hw.name, "source": hw.sources.get("matmul_flops"), "cache": hw.sources.get("cache"),
            "provisional": hw.provisional, "seconds": round(time.perf_counter() - t, 2),
            "matmul_tflops": {dt: round(max(r for _, r in pts) / 1e12, 2) for dt, pts in hw.matmul_flops.items()},
            "mem_bw_gbs": round(hw.mem_bw / 1e9, 1), "op_overhead_us": round(hw.op_overhead_s * 1e6, 2),
            "has_float8_peak": "float8" in hw.peak_flops, "warnings": [str(w.message)[:400] for w in caught]}
    except Exception as e:  # noqa: BLE001 - reported; the table may still predict
        hws["calibration"] = None
        record["calibration"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
    if device_name is None:
        hws["table"] = None
        record["table"] = {"skipped": "no CUDA device: the accelerator table describes GPUs only"}
    else:
        try:
            from torchloom.cost.accelerators import cluster, match_device_name

            acc = match_device_name(device_name)
            if acc is None:
                hws["table"] = None
                record["table"] = {"skipped": f"the accelerator table has no entry for {device_name!r}"}
            else:
                hws["table"] = cluster(acc, 1, 1)
                record["table"] = {"name": acc.name, "peak_tflops": {k: v / 1e12 for k, v in acc.peak_flops.items()},
                                   "memory_gib": round(hws["table"].memory_bytes / 2 ** 30, 1)}
        except Exception as e:  # noqa: BLE001
            hws["table"] = None
            record["table"] = {"error": f"{type(e).__name__}: {e}"}
    return hws, record


# ------------------------------------------------------------------------------------------------ variants
def strategy_for(name: str, device: str) -> list:
    compile_item = "compile" if device == "cuda" else {"compile": {"backend": "aot_eager"}}
    s: list = [{"amp": {"dtype": "bfloat16"}}]
    if name.startswith("fp8"):
        s.append("float8")
    if name.endswith("compile"):
        s.append(compile_item)
    return s


def fp8_unavailable(device: str) -> str | None:
    """Why the float8 variants cannot run here (None when they can)."""
    import torch

    if device != "cuda":
        return "float8 needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9); this run is on the CPU"
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        return (f"float8 needs compute capability >= 8.9 (H100, H200, L40S, B200); "
                f"{torch.cuda.get_device_name()} is {cap[0]}.{cap[1]}")
    try:
        import torchao  # noqa: F401
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except ImportError as e:
        return f"float8 needs torchao (pip install torchao), not importable here: {e}"
    return None


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def run_variant(name, args, cfg, info, hws, device):
    """Train ``name``, time it and price it; returns the variant's record."""
    import torch

    import torchloom
    from torchloom.search.drift import plan_candidate
    from torchloom.search.pricing import predict

    s = args.shape
    strategy = strategy_for(name, device)
    rec: dict = {"strategy": strategy}
    if device == "cuda":  # what earlier variants left allocated (it counts in this variant's peak)
        rec["allocated_before_bytes"] = float(torch.cuda.memory_allocated())
    t0 = time.perf_counter()
    model = build_model(cfg)
    res = torchloom.auto_accelerate(
        model, torch.optim.AdamW, RandomTokens(s["vocab"], s["seq"], s["micro_batch"] * 100_000), loss_func,
        strategy, optim_args={"lr": 1e-4}, dataloader_args={"batch_size": s["micro_batch"], "shuffle": False},
        model_input_format="unpack_dict", seed=0)
    rec["setup_s"] = round(time.perf_counter() - t0, 2)
    rec["notes"] = [str(n) for n in res.notes][:20]
    it = iter(res.dataloader)

    def step():
        loss = None
        for _ in range(res.grad_accum_steps):
            loss = res.train_step(next(it))
        return loss

    # -- warm-up (compilation happens here); the last warm-up step's time sizes the measurement
    t = time.perf_counter()
    last = t
    for _ in range(args.warmup):
        step()
        sync(device)
        now = time.perf_counter()
        est, last = now - last, now
    rec["warmup_s"] = round(time.perf_counter() - t, 2)
    n = int(min(args.max_steps, max(args.min_steps, math.ceil(args.measure_s / max(est, 1e-6)))))
    n = max(3, n - n % 3)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    # -- timed: three synchronised chunks
    chunks, loss = [], None
    for _ in range(3):
        sync(device)
        t = time.perf_counter()
        for _ in range(n // 3):
            loss = step()
        sync(device)
        chunks.append((time.perf_counter() - t) / (n // 3))
    step_s = sum(chunks) / len(chunks)
    tokens = res.global_batch_size * s["seq"]
    measured = {"steps": n, "step_time_s": step_s, "chunk_step_s": chunks, "tokens_per_s": tokens / step_s,
                "final_loss": float(loss), "loss_finite": math.isfinite(float(loss))}
    if device == "cuda":
        measured["peak_allocated_bytes"] = float(torch.cuda.max_memory_allocated())
        measured["peak_reserved_bytes"] = float(torch.cuda.max_memory_reserved())
    rec["measured"] = measured

    # -- predicted, for the plan that ran
    cand = plan_candidate(res, s["seq"])
    rec["plan"] = cand.label()
    rec["candidate"] = cand.to_dict()
    rec["predicted"], rec["errors"] = {}, {}
    for hw_name, hw in hws.items():
        if hw is None:
            continue
        try:
            p = predict(cand, info, hw)
        except Exception as e:  # noqa: BLE001 - one hardware's failure does not hide the other's
            rec["predicted"][hw_name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        alloc = p.peak_memory_bytes - p.memory.get("headroom", 0.0)
        rec["predicted"][hw_name] = {
            "hardware": hw.name, "step_time_s": p.step_time_s, "tokens_per_s": p.tokens_per_s,
            "peak_memory_bytes": p.peak_memory_bytes, "allocated_bytes": alloc, "mfu": p.mfu, "hfu": p.hfu,
            "peak_flops": p.peak_flops, "model_flops_per_token": p.model_flops_per_token,
            "time": p.time, "memory": p.memory, "notes": p.notes[:10]}
        err = {"step_time": p.step_time_s / step_s - 1, "tokens_per_s": p.tokens_per_s / measured["tokens_per_s"] - 1}
        if "peak_allocated_bytes" in measured:
            err["memory_allocated"] = alloc / measured["peak_allocated_bytes"] - 1
            err["memory_reserved"] = p.peak_memory_bytes / measured["peak_reserved_bytes"] - 1
        rec["errors"][hw_name] = err
        if p.peak_flops and p.model_flops_per_token:
            measured.setdefault("mfu", {})[hw_name] = p.model_flops_per_token * measured["tokens_per_s"] / p.peak_flops
    del res, model, it
    return rec


def cleanup(device: str) -> None:
    import torch

    gc.collect()
    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001
        pass
    if device == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ report
def _pct(x) -> str:
    return "-" if x is None else f"{x:+.0%}"


def table(results: dict) -> str:
    rows = [f"{'variant':<13} {'measured ms':>11} {'tok/s':>9} {'alloc GiB':>9} | "
            f"{'hardware':<11} {'pred ms':>8} {'err':>6} {'pred tok/s':>10} {'pred GiB':>8} {'mem err':>7}"]
    for name, r in results["variants"].items():
        if "measured" not in r:
            why = r.get("skipped") or r.get("error", "?")
            rows.append(f"{name:<13} {'skipped' if 'skipped' in r else 'FAILED'}: {why[:110]}")
            continue
        m = r["measured"]
        alloc = m.get("peak_allocated_bytes")
        head = (f"{name:<13} {m['step_time_s'] * 1e3:>11.1f} {m['tokens_per_s']:>9.0f} "
                f"{alloc / 2 ** 30 if alloc else float('nan'):>9.2f} | ")
        preds = r.get("predicted") or {"-": {"error": "no hardware to price with"}}
        for i, (hw_name, p) in enumerate(preds.items()):
            lead = head if i == 0 else " " * len(head.rstrip("| ")) + " | "
            if "error" in p:
                rows.append(f"{lead}{hw_name:<11} error: {p['error'][:80]}")
                continue
            e = r["errors"][hw_name]
            rows.append(f"{lead}{hw_name:<11} {p['step_time_s'] * 1e3:>8.1f} {_pct(e['step_time']):>6} "
                        f"{p['tokens_per_s']:>10.0f} {p['allocated_bytes'] / 2 ** 30:>8.2f} "
                        f"{_pct(e.get('memory_allocated')):>7}")
    return "\n".join(rows)


def git_rev() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch: the whole run (auto_accelerate too) on the CPU
    start = time.perf_counter()
    import torch

    import torchloom  # noqa: F401

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device (use --device cpu --tiny to check this script on a CPU)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_predict_check.json"
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else None
    results: dict = {
        "device": device_name or "cpu", "torch": torch.__version__, "git": git_rev(),
        "capability": list(torch.cuda.get_device_capability()) if device_name else None,
        "shape": args.shape, "warmup": args.warmup, "measure_s": args.measure_s, "variants": {}}

    def save():
        results["wall_s"] = round(time.perf_counter() - start, 1)
        path.write_text(json.dumps(results, indent=1, default=str))

    print(f"device {results['device']} torch {torch.__version__}; model {args.shape}", flush=True)
    hws, results["hardware"] = hardware(args, device_name)
    print(f"hardware: {json.dumps({k: {kk: vv for kk, vv in v.items() if kk != 'trace'} for k, v in results['hardware'].items()})[:800]}",
          flush=True)
    cfg = llama_config(args.shape)
    try:
        from torchloom.cost.analysis import analyze_model

        t = time.perf_counter()
        meta = build_model(cfg, "meta")
        results["params"] = sum(p.numel() for p in meta.parameters())
        info = analyze_model(meta, seq_len=args.shape["seq"], attention="flash" if args.device == "cuda" else "native")
        results["analysis_s"] = round(time.perf_counter() - t, 2)
        del meta
    except Exception as e:  # noqa: BLE001
        info = None
        results["analysis_error"] = f"{type(e).__name__}: {e}"
        hws = {}
    print(f"model: {results.get('params', 0) / 1e6:.1f} M parameters; analysis "
          f"{results.get('analysis_s', results.get('analysis_error'))}", flush=True)
    save()

    no_fp8 = fp8_unavailable(args.device)
    for name in args.variant_list:
        elapsed = time.perf_counter() - start
        need = START_MARGIN_S[name] * (0.1 if args.tiny else 1.0) + args.measure_s
        if name.startswith("fp8") and no_fp8:
            results["variants"][name] = {"skipped": no_fp8}
        elif elapsed + need > args.budget_s:
            results["variants"][name] = {"skipped": f"time budget: {elapsed:.0f} s spent, ~{need:.0f} s needed, "
                                                    f"--budget-s {args.budget_s:.0f}"}
        else:
            t = time.perf_counter()
            try:
                results["variants"][name] = run_variant(name, args, cfg, info, hws, args.device)
            except Exception as e:  # noqa: BLE001 - every variant reports, the script goes on
                results["variants"][name] = {"strategy": strategy_for(name, args.device),
                                             "error": f"{type(e).__name__}: {e}"[:2000],
                                             "trace": traceback.format_exc()[-3000:]}
            results["variants"][name]["wall_s"] = round(time.perf_counter() - t, 1)
            cleanup(args.device)
        r = results["variants"][name]
        state = ("skipped: " + r["skipped"]) if "skipped" in r else ("FAILED: " + r["error"]) if "error" in r else (
            f"{r['measured']['step_time_s'] * 1e3:.1f} ms/step, " + ", ".join(
                f"{k} {_pct(v['step_time'])}" for k, v in r["errors"].items()))
        print(f"{name}: {state[:400]}", flush=True)
        save()

    print(table(results))
    print(f"wrote {path} ({results['wall_s']:.0f} s)")
    ran = [r for r in results["variants"].values() if "measured" in r]
    return 0 if ran and not any("error" in r for r in results["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
