"""CUDA paths the CPU test suite cannot reach, on one GPU (NCCL group of one).

Run with ``loom run --nproc 1 scripts/cuda_smoke.py [OUT_DIR]`` (or ``torchrun --nproc-per-node 1``) on a
machine with a CUDA device. Each check prints one ``PASS``/``FAIL`` line with its numbers; the script exits 1
if any check failed, and writes every result to ``OUT_DIR/cuda_smoke.json`` when given. Nothing is downloaded:
the models are tiny Hugging Face Llamas built from a config.

Checks (references are plain single-device PyTorch loops on the same GPU):
  * ``ddp`` / ``fsdp`` in fp32 with SGD equal the reference losses and parameters (rtol 1e-5; cuBLAS may pick
    another kernel for another layout, so not bitwise); ``fsdp + amp`` (bf16) within 3e-2 of the fp32 losses;
    ``zero2 + amp + checkpoint`` and ``fsdp + compile`` finite and within 3e-2; fused AdamW under FSDP equals
    the foreach one (rtol 1e-5).
  * ``SumLoss`` token-exact loss: the count all-reduce runs on the device.
  * ``set_global_batch_size`` changes the accumulation between steps on the device.
  * ``torchloom.checkpoint`` save/load and the flash tier (shared-memory snapshot of CUDA tensors) restore
    bitwise into a fresh FSDP model.
  * ``torchloom.hf.save_pretrained`` from FSDP on CUDA: ``from_pretrained`` gives the same logits.
  * ``TorchloomTrainer`` on CUDA (``use_cpu=False``) with ``compute_metrics``: trains, evaluates, saves.
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import torchloom

RESULTS: dict[str, dict] = {}
# CUDA_SMOKE_ALLOW_CPU=1 dry-runs the checks on the CPU (gloo), to test the script itself without a GPU
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SEQ, VOCAB, N = 64, 512, 64


def check(name):
    def deco(fn):
        only = os.environ.get("CUDA_SMOKE_ONLY")  # comma-separated check names (all by default)
        if only and name not in only.split(","):
            return fn
        t = time.perf_counter()
        try:
            detail = fn() or {}
            RESULTS[name] = {"ok": True, **detail}
        except Exception as e:  # noqa: BLE001 - every check reports, the script goes on
            RESULTS[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        RESULTS[name]["seconds"] = round(time.perf_counter() - t, 2)
        r = RESULTS[name]
        shown = {k: v for k, v in r.items() if k not in ("ok", "trace")}
        print(f"{'PASS' if r['ok'] else 'FAIL'} {name}: {json.dumps(shown)[:600]}", flush=True)
        return fn
    return deco


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(cfg)


def dataset():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (N, SEQ), generator=g)
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def loss_func(batch, out):
    return out.loss


def reference_losses(steps: int, lr: float = 0.1):
    """Plain PyTorch on the GPU: global batch 8 as 2 micro-batches of 4 (mean of the two means)."""
    dev = DEV
    model = tiny_llama().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = dataset()
    losses = []
    for s in range(steps):
        opt.zero_grad()
        total = 0.0
        for m in range(2):
            rows = data[s * 8 + m * 4: s * 8 + (m + 1) * 4]
            batch = {k: torch.stack([r[k] for r in rows]).to(dev) for k in rows[0]}
            loss = model(**batch).loss / 2
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def accelerate(strategy, optim=torch.optim.SGD, optim_args=None, lf=loss_func, **kw):
    return torchloom.auto_accelerate(
        tiny_llama(), optim, dataset(), lf, strategy, optim_args=optim_args or {"lr": 0.1},
        dataloader_args={"batch_size": 8, "micro_batch_size": 4, "shuffle": False}, model_input_format="unpack_dict",
        seed=0, **kw)


def run_steps(res, steps):
    losses, it = [], iter(res.dataloader)
    for _ in range(steps):
        total = 0.0
        for _ in range(res.grad_accum_steps):
            total += float(res.train_step(next(it))) / res.grad_accum_steps
        losses.append(total)
    return losses


def full_params(res):
    from torchloom.checkpoint.state import full_model_state

    return {k: v.float().cpu() for k, v in full_model_state(res.model).items()}


STEPS = 4
REF, REF_PARAMS = None, None


def main(out_dir: str | None) -> int:
    global REF, REF_PARAMS
    assert DEV.type == "cuda" or os.environ.get("CUDA_SMOKE_ALLOW_CPU") == "1", "no CUDA device"
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
    print(f"device {name} torch {torch.__version__}", flush=True)
    REF, REF_PARAMS = reference_losses(STEPS)

    for strategy, tol, compare_params in ((["ddp"], 1e-5, True), (["fsdp"], 1e-5, True),
                                          (["fsdp", "amp"], 3e-2, False),
                                          (["zero2", "amp", "checkpoint"], 3e-2, False),
                                          (["fsdp", "compile"], 3e-2, False)):
        @check("+".join(strategy))
        def _():
            res = accelerate(list(strategy))
            assert next(res.model.parameters()).device.type == DEV.type
            losses = run_steps(res, STEPS)
            err = max(abs(a - b) / abs(b) for a, b in zip(losses, REF))
            assert all(math.isfinite(x) for x in losses), losses
            assert err <= tol, f"losses {losses} vs reference {REF}: rel {err:.2e} > {tol}"
            detail = {"losses": [round(x, 6) for x in losses], "max_rel_err": err}
            if compare_params:
                got = full_params(res)
                worst = max(float((got[k] - REF_PARAMS[k]).abs().max()) for k in REF_PARAMS if k in got)
                assert worst <= 1e-4, f"parameters differ by {worst:.2e}"
                detail["max_param_diff"] = worst
            if DEV.type == "cuda":
                detail["peak_mem_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            return detail

    @check("fsdp+fused_adamw")
    def _():
        runs = {}
        for fused in (False, True):
            res = accelerate(["fsdp"], torch.optim.AdamW, {"lr": 1e-3, "fused": fused, "foreach": not fused})
            runs[fused] = run_steps(res, STEPS)
        err = max(abs(a - b) / abs(b) for a, b in zip(runs[True], runs[False]))
        assert err <= 1e-5, f"fused {runs[True]} vs foreach {runs[False]}"
        return {"losses": [round(x, 6) for x in runs[True]], "max_rel_err_vs_foreach": err}

    @check("sumloss_token_count_on_device")
    def _():
        res = accelerate(["fsdp"], lf=lambda b, o: torchloom.SumLoss.from_hf(o, b["labels"]))
        losses = run_steps(res, STEPS)
        err = max(abs(a - b) / abs(b) for a, b in zip(losses, REF))
        assert err <= 1e-5, (losses, REF)  # equal-length rows: the token mean equals the mean of means
        return {"max_rel_err": err}

    @check("set_global_batch_size")
    def _():
        res = accelerate(["fsdp"])
        run_steps(res, 2)  # 16 samples of 64: the new global batch 16 divides the position
        accum = res.set_global_batch_size(16)
        assert (accum, res.train_step.grad_accum_steps, res.dataloader.grad_accum_steps) == (4, 4, 4)
        losses = run_steps(res, 1)
        return {"accum": accum, "loss": losses[0]}

    @check("checkpoint_disk_and_flash_roundtrip")
    def _():
        from torchloom.checkpoint import FlashCheckpointer, load, save

        with tempfile.TemporaryDirectory() as d:
            res = accelerate(["fsdp", "amp"], torch.optim.AdamW, {"lr": 1e-3})
            run_steps(res, 2)
            save(Path(d) / "disk", step=2, model=res.model, optimizer=res.optimizer, dataloader=res.dataloader,
                 train_step=res.train_step)
            ck = FlashCheckpointer(Path(d) / "flash", model=res.model, optimizer=res.optimizer,
                                   dataloader=res.dataloader, train_step=res.train_step)
            ck.save(2, persist=True)
            want = full_params(res)
            ck.finalize(unlink=False)
            out = {}
            for tier in ("disk", "flash"):
                fresh = accelerate(["fsdp", "amp"], torch.optim.AdamW, {"lr": 1e-3})
                if tier == "disk":
                    info = load(Path(d) / "disk", model=fresh.model, optimizer=fresh.optimizer,
                                dataloader=fresh.dataloader, train_step=fresh.train_step)
                else:
                    ck2 = FlashCheckpointer(Path(d) / "flash", model=fresh.model, optimizer=fresh.optimizer,
                                            dataloader=fresh.dataloader, train_step=fresh.train_step)
                    info = ck2.load()
                    ck2.finalize()
                got = full_params(fresh)
                assert all(torch.equal(got[k], want[k]) for k in want), f"{tier}: restored parameters differ"
                out[tier] = {"step": int(info["step"]), "source": str(info.get("source", "disk"))}
            return out

    @check("hf_save_pretrained_from_fsdp")
    def _():
        from transformers import LlamaForCausalLM

        import torchloom.hf

        with tempfile.TemporaryDirectory() as d:
            res = accelerate(["fsdp"])
            run_steps(res, 1)
            torchloom.hf.save_pretrained(res.model, d)
            back = LlamaForCausalLM.from_pretrained(d).to(DEV).eval()
            ids = torch.arange(SEQ, device=DEV).remainder(VOCAB)[None]
            with torch.no_grad():
                a = back(input_ids=ids).logits
                res.model.eval()
                b = res.model(input_ids=ids).logits
            diff = float((a - b).abs().max())
            assert diff <= 1e-4, diff
            return {"max_logit_diff": diff, "files": sorted(p.name for p in Path(d).iterdir())}

    @check("torchloom_trainer_cuda")
    def _():
        import numpy as np
        from transformers import TrainingArguments

        from torchloom.hf import TorchloomTrainer

        def metrics(p):
            preds = np.argmax(p.predictions, -1)[:, :-1]
            return {"acc": float((preds == p.label_ids[:, 1:]).mean())}

        with tempfile.TemporaryDirectory() as d:
            args = TrainingArguments(output_dir=d, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                     max_steps=4, learning_rate=1e-3, report_to="none", disable_tqdm=True,
                                     save_strategy="steps", save_steps=2, logging_steps=1,
                                     per_device_eval_batch_size=4)
            tr = TorchloomTrainer(model=tiny_llama(), args=args, train_dataset=dataset(), eval_dataset=dataset()[:10],
                                  compute_metrics=metrics, torchloom_strategy=["fsdp", "amp"])
            tr.train()
            ev = tr.evaluate()
            tr.save_model(str(Path(d) / "final"))
            dev = next(tr.torchloom.model.parameters()).device
            assert dev.type == DEV.type, dev
            assert tr.state.global_step == 4 and "eval_acc" in ev, (tr.state.global_step, ev)
            return {"global_step": tr.state.global_step, "eval": {k: ev[k] for k in ("eval_loss", "eval_acc")}}

    failed = [k for k, v in RESULTS.items() if not v["ok"]]
    print(f"{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed" + (f"; failed: {failed}" if failed else ""))
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, "cuda_smoke.json").write_text(json.dumps(
            {"device": name, "torch": torch.__version__, "results": RESULTS}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    code = main(sys.argv[1] if len(sys.argv) > 1 else None)
    from torchloom.elastic.shutdown import clean_exit

    clean_exit(code)
