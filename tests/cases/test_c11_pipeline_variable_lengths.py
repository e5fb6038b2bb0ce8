"""C11 — pipeline micro-batches of different lengths [NVIDIA-NeMo/Automodel PR 3530].

2-stage Llama; each optimizer step is 4 ``train_step`` calls (grad_accum_steps=4) of sequence lengths
32/64/48/128, each call cut into 2 pipeline micro-batches. Pipeline stages size their send/receive buffers
from the first micro-batch they see, so every new length needs its own stage set (torchloom caches one
schedule per input shape); a pipeline that reused the buffers of another length, or kept only the last call's
gradient (the schedule's default gradient scaling at the end of each step), would be wrong.

Checks: the gradient the optimizer applies at the last step equals the reference sum over all four
micro-batches (atol 1e-6), losses rtol 1e-5, parameters atol 2e-5; the same with ``SumLoss`` (global token
normalisation; the count travels from the last stage to the first). 4 schedules were built (one per
length). Control: the last micro-batch's gradient alone differs from the sum by far more than the tolerance.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed import _pp_workers as W
from torchloom.testing import run_ranks

LENGTHS = (32, 64, 48, 128)


def _data(steps: int = 2) -> list[list[dict]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        step = []
        for n in LENGTHS:
            x = torch.randint(0, 128, (2, n), generator=g)
            step.append({"input_ids": x, "labels": x})
        out.append(step)
    return out


@pytest.mark.distributed
def test_accumulated_gradient_over_different_lengths_equals_reference_sum():
    data = _data()
    configs = [dict(tag="mean", strategy=[("pipeline_parallel", {"size": 2})], data=data),
               dict(tag="sum", strategy=[("pipeline_parallel", {"size": 2})], data=data, loss="sum")]
    outs = run_ranks(W.pp_train_many, 2, configs, timeout=600)
    for i, cfg in enumerate(configs):
        ranks = [o[i] for o in outs]
        ref = W.reference("llama", data, 2, loss=cfg.get("loss", "mean"))
        grads = W.merge_grads(ranks)
        assert set(grads) == set(ref["grads"])
        for n, g in ref["grads"].items():
            torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=0, msg=lambda m: f"{cfg['tag']} {n}: {m}")
        params = W.merge_params(ranks)
        for k, v in ref["params"].items():
            torch.testing.assert_close(params[k], v, atol=2e-5, rtol=0, msg=lambda m: f"{cfg['tag']} {k}: {m}")
        if cfg["tag"] == "mean":
            torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        assert all(r["schedules"] == len(LENGTHS) for r in ranks)
    # control: only the last micro-batch's contribution is far from the accumulated gradient
    last_only = W.reference("llama", [[data[-1][-1]]], 2)["grads"]
    first_step_sum = W.reference("llama", data[:1], 2)["grads"]
    gap = max((last_only[n] / len(LENGTHS) - first_step_sum[n]).abs().max().item() for n in last_only)
    assert gap > 1e-3, gap
