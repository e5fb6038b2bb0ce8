"""C13 — global gradient-norm clipping, FSDP and HSDP [pytorch/torchtitan 596; pytorch/pytorch 170862].

Every rank must clip with the norm of the *whole* gradient: sharded gradients hold 1/shard of it, and under
HSDP the shard-local norms must be reduced over the shard dimension only (reducing over the replicas too
would count every shard twice). Pipeline and tensor-parallel parts come with those methods.

4 ranks, FSDP over 4 and HSDP 2x2. Checks with fixed gradients (scales over 3 decades):
``torchloom.parallel.grad_norm.clip_grad_norm_`` returns the same total norm on every rank (bit for bit),
equal to ``torch.nn.utils.clip_grad_norm_`` on the unsharded model, for the 2-norm and the inf-norm, and
the clipped gradients equal the reference's. Through ``auto_accelerate(max_grad_norm=...)``:
``train_step.last_grad_norm`` equals the reference norm at every step and the parameters after 2 clipped
SGD steps equal the reference's.

Tolerance: fixed gradients rtol 1e-6 / atol 1e-9 (sums of squares in a different order); training rtol 1e-5 /
atol 1e-6 (the batch mean is also split over ranks).
"""
from __future__ import annotations

import pytest
import torch

from tests.cases import _workers as W
from torchloom.testing import run_ranks


@pytest.mark.distributed
def test_clip_grad_norm_global_under_fsdp_and_hsdp():
    ref = W.c13_reference()
    results = run_ranks(W.c13_clipping, 4)
    for tag in W.C13_MESHES:
        assert results[0][tag]["mesh"]["dp_shard"] == (4 if tag == "fsdp4" else 2)
        for rank, r in enumerate(results):
            got = r[tag]
            for norm_type in (2.0, float("inf")):
                total, grads = got[norm_type]
                ref_total, ref_grads = ref[norm_type]
                assert torch.equal(total, results[0][tag][norm_type][0]), f"{tag} rank {rank}: norm differs"
                torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
                assert ref_total > 5 * W.C13_MAX_NORM  # the fixed gradients are really clipped
                for n, g in ref_grads.items():
                    torch.testing.assert_close(grads[n], g, rtol=1e-6, atol=1e-9,
                                               msg=lambda m: f"{tag} {norm_type} {n}: {m}")
            norms, params = got["train"]
            ref_norms, ref_params = ref["train"]
            assert torch.equal(norms, results[0][tag]["train"][0])
            torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
            for n, p in ref_params.items():
                torch.testing.assert_close(params[n], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{tag} {n}: {m}")
