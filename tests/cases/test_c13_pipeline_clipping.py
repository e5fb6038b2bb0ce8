"""C13 (pipeline part) — global gradient-norm clipping across pipeline stages [pytorch/torchtitan 596].

Pipeline stages hold disjoint parameters, so the norm must be summed (as squares) over the pipeline group;
a weight tied across stages (GPT-2's embedding and head) has a copy on two stages and must be counted once,
as in the unsplit model. 2 ranks: Llama (1F1B) and tied GPT-2 (interleaved 1F1B, 4 stages), clipping at 0.5
(every step is clipped: the reference norms are 1.5-2.2).

Checks: ``train_step.last_grad_norm`` is bitwise the same on every rank and equals
``torch.nn.utils.clip_grad_norm_``'s total norm on the unsplit model (rtol 1e-5: squares summed per stage);
the clipped gradients applied at the last step equal the reference's (atol 1e-6); parameters atol 2e-5.
Control: counting the tied weight twice would give a norm more than 1e-3 (relative) away, so the check can
fail.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import _pp_workers as W
from torchloom.testing import run_ranks

MAX_NORM = 0.5


@pytest.mark.distributed
def test_pipeline_grad_norm_is_global_and_counts_tied_weights_once():
    data = W.token_data(3, 8, 4)
    configs = [
        dict(tag="llama", model="llama", strategy=[("pipeline_parallel", {"size": 2})]),
        dict(tag="gpt2_tied", model="gpt2",
             strategy=[("pipeline_parallel", {"size": 2, "schedule": "interleaved_1f1b"})]),
    ]
    outs = run_ranks(W.pp_train_many, 2, [dict(data=data, max_grad_norm=MAX_NORM, **c) for c in configs], timeout=600)
    for i, cfg in enumerate(configs):
        ranks = [o[i] for o in outs]
        atoms = 4 if cfg["tag"] == "gpt2_tied" else 2
        ref = W.reference(cfg["model"], data, atoms, max_grad_norm=MAX_NORM)
        assert min(ref["norms"]) > 2 * MAX_NORM
        for r in ranks:
            assert r["norms"] == ranks[0]["norms"], "ranks clipped with different norms"
        torch.testing.assert_close(torch.tensor(ranks[0]["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
        grads = W.merge_grads(ranks)
        for n, g in ref["clipped"].items():
            torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=0, msg=lambda m: f"{cfg['tag']} {n}: {m}")
        params = W.merge_params(ranks)
        for k, v in ref["params"].items():
            torch.testing.assert_close(params[k], v, atol=2e-5, rtol=0, msg=lambda m: f"{cfg['tag']} {k}: {m}")
        if cfg["tag"] == "gpt2_tied":  # control: the tied gradient counted twice
            g = ref["grads"]["lm_head.weight"]
            twice = math.sqrt(ref["norms"][-1] ** 2 + g.pow(2).sum().item())
            assert abs(twice - ranks[0]["norms"][-1]) / twice > 1e-3
