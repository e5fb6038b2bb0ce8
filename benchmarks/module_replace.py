"""Step time of a Llama-style model with Hugging Face's eager attention and RMSNorm vs after
``module_replace`` (PyTorch SDPA + fused ``torch.nn.RMSNorm``), measured side by side in one process.

    .venv/bin/python benchmarks/module_replace.py [--hidden 256] [--layers 4] [--seq 256] [--batch 4] [--steps 10]
        [--device cuda] [--dtype bfloat16]

The two variants alternate step by step (same weights, same batch) so machine noise hits both alike;
printed: median forward+backward time of each, and the ratio eager / replaced (> 1: replaced is faster),
also for the RMSNorm alone and attention alone.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def build(hidden: int, layers: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 64, 1),
                      max_position_embeddings=seq, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def step(model, batch) -> float:
    sync = torch.cuda.synchronize if batch.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    model(input_ids=batch, labels=batch).loss.backward()
    model.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - t0


def main() -> None:
    from torchloom.replace import replace_modules, select_pairs

    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    eager = build(a.hidden, a.layers, a.seq).to(a.device, getattr(torch, a.dtype))
    variants = {"eager": eager}
    for pairs in (["sdpa"], ["rms_norm"], ["sdpa", "rms_norm"]):
        variants["+".join(pairs)], _ = replace_modules(copy.deepcopy(eager), select_pairs(pairs))
    batch = torch.randint(0, 4096, (a.batch, a.seq), generator=torch.Generator().manual_seed(0)).to(a.device)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(a.warmup + a.steps):
        for name, model in variants.items():
            t = step(model, batch)
            if i >= a.warmup:
                times[name].append(t)
    print(f"Llama hidden={a.hidden} layers={a.layers} seq={a.seq} batch={a.batch}, {a.dtype} on {a.device}, "
          f"{torch.get_num_threads()} threads, {a.steps} steps (median forward+backward)")
    base = statistics.median(times["eager"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:16s} {med * 1e3:8.1f} ms   eager/this = {base / med:5.2f}x")


if __name__ == "__main__":
    main()
