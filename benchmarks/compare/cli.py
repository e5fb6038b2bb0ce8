"""``python -m benchmarks compare``: options, the run over models x world sizes, and the output files."""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys

DEFAULT = ["torch_native:torch_ddp", "loom:loom_ddp", "accelerate_:accel_ddp", "fabric:fabric_ddp",
           "torch_native:torch_ddp_zero1", "loom:loom_zero1", "deepspeed_:ds_zero1", "deepspeed_:ds_zero2", "torch_native:torch_fsdp2_zero2", "loom:loom_zero2",
           "torch_native:torch_fsdp2_zero3", "loom:loom_zero3", "accelerate_:accel_fsdp2_zero3",
           "deepspeed_:ds_zero3", "fabric:fabric_fsdp", "fabric:fabric_fsdp2",
           "torch_native:torch_fsdp2_zero3_ac_bf16", "loom:loom_zero3_ac_bf16",
           "accelerate_:accel_fsdp2_zero3_ac_bf16"]
SMOKE = ["torch_native:torch_ddp", "loom:loom_ddp"]
FAMILIES = {"torch": "torch_native", "loom": "loom", "accel": "accelerate_", "ds": "deepspeed_", "fabric": "fabric"}


def _qualify(name: str) -> str:
    if ":" in name:
        return name
    return f"{FAMILIES[name.split('_')[0]]}:{name}"


def _validate(ap, args) -> None:
    """Bad input is an error that names the valid values (not a traceback, not a silently smaller batch)."""
    from .common import MODELS
    from .summary import contender_spec

    for m in (args.models or "").split(","):
        if m and m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {sorted(MODELS)}")
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        ap.error(f"--worlds must be a comma list of integers, got {args.worlds!r}")
    for w in worlds:
        if w < 1:
            ap.error(f"--worlds: a process count must be >= 1, got {w}")
        if args.global_batch % w:
            ap.error(f"--global-batch {args.global_batch} is not divisible by {w} processes: every rank must get "
                     "the same number of sequences (or the run would train fewer tokens than it reports)")
    if args.contenders:
        for c in args.contenders.split(","):
            try:
                contender_spec(_qualify(c))
            except (KeyError, ModuleNotFoundError, AttributeError):
                ap.error(f"unknown contender {c!r}; choose from {', '.join(sorted(_known()))}")


def _known() -> list[str]:
    import importlib

    names = []
    for mod in FAMILIES.values():
        names += list(importlib.import_module(f"benchmarks.compare.{mod}").CONTENDERS)
    return names


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks compare", description=__doc__)
    ap.add_argument("--models", default="default,llama36m", help="comma list of benchmarks.compare.common.MODELS")
    ap.add_argument("--worlds", default="2,4", help="comma list of process counts")
    ap.add_argument("--contenders", default=None, help="comma list (e.g. torch_ddp,loom_ddp); default: all")
    ap.add_argument("--auto", action="store_true", help="add loom_auto (strategy='auto'; the search is setup time)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (each contender once per round)")
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps per launch")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per launch before the timed ones")
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step over all ranks")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cores // world, >= 1)")
    ap.add_argument("--no-track", action="store_true", help="skip the MemTracker step (tracked tensor peak)")
    ap.add_argument("--out", default="benchmarks/results/compare", help="output stem (.md, .json, _*.png)")
    ap.add_argument("--smoke", action="store_true",
                    help="CI smoke: tiny model, 2 ranks, torch_ddp vs loom_ddp, 2 steps, 1 round (< 60 s)")
    args = ap.parse_args(argv)
    _validate(ap, args)
    if args.smoke:
        args.models, args.worlds, args.rounds, args.steps, args.warmup = "tiny", "2", 1, 2, 1
        args.contenders = args.contenders or ",".join(SMOKE)
        args.no_track = True
        if args.out == "benchmarks/results/compare":
            args.out = "benchmarks/results/compare_smoke"
    return args


def main(argv=None) -> int:
    """Runs the comparison; returns 0, or 1 when a contender failed or a check flagged one (the report says)."""
    from .common import MODELS, build_model
    from .report import environment, write
    from .runner import interleave
    from .summary import headlines, loss_checks, row

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    contenders = [_qualify(c) for c in args.contenders.split(",")] if args.contenders else list(DEFAULT)
    if args.auto:
        contenders.append("loom:loom_auto")
    load_start = list(os.getloadavg())
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    sections = []
    for model in args.models.split(","):
        n_params = sum(p.numel() for p in build_model(model, meta=True).parameters())
        for world in (int(w) for w in args.worlds.split(",")):
            threads = args.threads or max(1, (os.cpu_count() or 2) // world)
            cfg = dict(model=model, global_batch=args.global_batch, steps=args.steps, warmup=args.warmup,
                       threads=threads, track=not args.no_track)
            print(f"== {model} ({n_params / 1e6:.2f} M), {world} ranks, {threads} thread(s) each", flush=True)
            results = interleave(contenders, args.rounds, cfg, world, log=lambda m: print(m, flush=True))
            rows = [row(c, results[c], cfg, world) for c in contenders]
            loss_checks(rows)
            sections.append({"model": model, "n_params": n_params, "world": world, "threads": threads,
                             "global_batch": args.global_batch, "seq_len": MODELS[model]["seq_len"],
                             "tokens_per_step": args.global_batch * MODELS[model]["seq_len"],
                             "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "rows": rows,
                             "headlines": headlines(rows)})
    result = {"command": "python -m benchmarks compare " + shlex.join(argv), "started": started,
              "finished": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
              "environment": {**environment(), "loadavg_at_start": load_start}, "sections": sections}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    paths = write(result, args.out)
    print("wrote " + ", ".join(paths))
    bad = [r["contender"] for s in sections for r in s["rows"] if "error" in r or r.get("checks")]
    if bad:
        print("failed or flagged: " + ", ".join(sorted(set(bad))))
    return 1 if bad else 0
