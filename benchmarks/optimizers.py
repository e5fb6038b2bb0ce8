"""Held-out loss of the default `loom train` job after N steps with AdamW, AGD and WSAM(AdamW), run one
after the other on the same data, model init and schedule (ratios of wall time vs AdamW).

    .venv/bin/python benchmarks/optimizers.py [--steps 400] [--nproc 2] [--agd-lr 3e-4]

AdamW and WSAM use the default lr (3e-3); AGD uses ``--agd-lr`` (the AGD paper: about a tenth of AdamW's lr
and delta 1e-14 for Transformers) and also runs at AdamW's lr for comparison. The losses are deterministic
(seeded); wall times depend on the machine's load.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOOM = [sys.executable, "-m", "torchloom.cli"]


def run(name: str, out: Path, steps: int, nproc: int, cache: Path, *sets: str) -> dict:
    args = [*LOOM, "train", "--nproc", str(nproc), "--output-dir", str(out / name), "--set", f"train.steps={steps}",
            "--set", f"eval.interval={steps}", "--set", f"checkpoint.interval={steps}", "--set", "log.progress=false",
            "--set", f"data.cache_dir={cache}", "--set", "sample.max_new_tokens=0"]
    for s in sets:
        args += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((out / name / "summary.json").read_text())
    return {"wall_s": wall, "train_s": summary["train_time_s"], "initial": summary["initial_eval_loss"],
            "final": summary["final_eval_loss"], "tok_s": summary["tokens_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--agd-lr", type=float, default=3e-4)
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="loom_optim_bench_"))
    cache = out / "cache"
    runs = {
        "adamw": (),
        f"agd lr={args.agd_lr:g}": ("train.optimizer=agd", f"train.lr={args.agd_lr}"),
        "agd lr=3e-3": ("train.optimizer=agd",),
        "wsam(adamw)": ("train.optimizer=wsam",),
    }
    rows = {}
    for name, sets in runs.items():
        rows[name] = run(name.replace(" ", "_").replace("(", "_").replace(")", ""), out, args.steps, args.nproc,
                         cache, *sets)
        print(f"{name}: {rows[name]}", flush=True)
    base = rows["adamw"]
    print(f"\ndefault job, {args.steps} steps x 16 x 128 tokens, {args.nproc} processes (outputs in {out})")
    hdr = f"{'optimizer':16} {'held-out loss':>13} {'- adamw':>8} {'train s':>8} {'x adamw':>8} {'tok/s':>7}"
    print(hdr)
    print("-" * len(hdr))
    for name, r in rows.items():
        print(f"{name:16} {r['final']:13.4f} {r['final'] - base['final']:8.4f} {r['train_s']:8.1f} "
              f"{r['train_s'] / base['train_s']:8.2f} {r['tok_s']:7.0f}")


if __name__ == "__main__":
    main()
