"""How long a checkpoint save blocks the training loop: flash save (copy to shared memory, persisted by
a background saver) vs a synchronous DCP save (``torchloom.checkpoint.save``) vs ``torch.save`` of the
same state, measured side by side in one run, for a state of about ``--gb`` GB (fp32 MLP weights + AdamW
moments, one process). Prints medians over ``--repeats`` saves and the ratios.

    .venv/bin/python benchmarks/checkpoint_save.py [--gb 1.0] [--repeats 3] [--dir /tmp/loom_bench_ckpt]

The flash numbers: ``first`` includes starting the saver and allocating the shared memory (once per
run); ``steady`` is a later save with the saver idle (the normal case); ``persist`` is the background
time from the call to the committed checkpoint (for context; the training loop does not wait for it).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def build(gb: float):
    import torch
    import torch.nn as nn

    width = 4096
    n_layers = max(1, round(gb * 1e9 / 3 / 4 / (width * width)))  # params + exp_avg + exp_avg_sq, fp32
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(n_layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    return model, opt, nbytes


def main() -> None:
    import torch

    from torchloom import checkpoint
    from torchloom.checkpoint.flash import FlashCheckpointer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="state size in GB (1e9 bytes)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="loom_bench_ckpt_"))
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    model, opt, nbytes = build(args.gb)
    print(f"state: {nbytes / 1e9:.2f} GB ({sum(p.numel() for p in model.parameters()) / 1e6:.0f} M fp32 params + "
          f"AdamW moments); {torch.get_num_threads()} threads; writing under {base}")

    times: dict[str, list[float]] = {"torch.save": [], "dcp sync": [], "flash steady": [], "flash persist": []}
    fc = FlashCheckpointer(base / "flash", model=model, optimizer=opt, keep_last=1, shm_dir=base / "shm")
    t = time.perf_counter()
    fc.save(0)
    first = time.perf_counter() - t
    fc.wait()
    for i in range(1, args.repeats + 1):
        t = time.perf_counter()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, base / "torch_save.pt")
        os.sync()
        times["torch.save"].append(time.perf_counter() - t)

        t = time.perf_counter()
        checkpoint.save(base / "dcp", step=i, model=model, optimizer=opt, keep_last=1)
        times["dcp sync"].append(time.perf_counter() - t)

        t = time.perf_counter()
        fc.save(i)
        times["flash steady"].append(time.perf_counter() - t)
        fc.wait()
        times["flash persist"].append(time.perf_counter() - t)
    fc.finalize()
    for k, v in times.items():
        print(f"  {k}: " + ", ".join(f"{x:.3f}" for x in v) + " s")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'method':<16}{'blocks (s, median)':>20}{'ratio vs flash':>16}")
    for k in ("torch.save", "dcp sync", "flash steady"):
        print(f"{k:<16}{med[k]:>20.3f}{med[k] / med['flash steady']:>15.1f}x")
    print(f"flash first save (starts the saver, allocates shared memory): {first:.3f} s")
    print(f"flash background persist (call -> committed on disk): {med['flash persist']:.3f} s")
    print(f"blocking ratio synchronous DCP / flash: {med['dcp sync'] / med['flash steady']:.1f}x "
          f"(target >= 10x); torch.save / flash: {med['torch.save'] / med['flash steady']:.1f}x")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
