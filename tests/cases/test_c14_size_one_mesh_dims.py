"""C14 — size-1 mesh dimensions [pytorch/pytorch 154888].

2 ranks on a (dp_replicate=2, dp_shard=1) mesh: HSDP whose shard dimension has one rank. FSDP1 clamped
this to NO_SHARD but reduced gradients over the size-1 shard group only, so the replicas never averaged
and silently diverged. A search over strategies produces such shapes, so every method must handle degree 1.

Checks, for FSDP (also with accumulation and clipping), DDP and ZeRO-1 on the 2x1 mesh and FSDP on 1x2:
the gradient the optimizer sees is identical on both ranks (bit for bit) and equals the single-process
full-batch gradient, i.e. it was averaged; parameters are identical across ranks (bit for bit) and equal
plain DDP's (rtol 1e-6 / atol 1e-7: the same 2-rank average, reduced by another collective) and the
reference's (rtol 1e-5 / atol 1e-6: the batch mean is split over 2 ranks).
"""
from __future__ import annotations

import pytest
import torch

from tests.cases import _workers as W
from torchloom.testing import run_ranks

RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.distributed
def test_size_one_mesh_dims_still_average_gradients():
    refs = {clip: W.c14_reference(clip) for clip in {c for _, _, c in W.C14_CONFIGS.values()}}
    r0, r1 = run_ranks(W.c14_size_one, 2)
    for tag, (strategy, micro, clip) in W.C14_CONFIGS.items():
        ref_losses, ref_grads, ref_params = refs[clip]
        a, b = r0[tag], r1[tag]
        assert a["accum"] == W.C14_GBS // 2 // micro
        if "2x1" in tag:
            assert (a["mesh"]["dp_replicate"], a["mesh"]["dp_shard"]) == (2, 1)
        assert len(a["grads"]) == W.C14_STEPS
        for step, (ga, gb, gr) in enumerate(zip(a["grads"], b["grads"], ref_grads)):
            for n, g in gr.items():
                assert torch.equal(ga[n], gb[n]), f"{tag} step {step}: {n} not averaged across replicas"
                torch.testing.assert_close(ga[n], g, rtol=RTOL, atol=ATOL, msg=lambda m: f"{tag} {step} {n}: {m}")
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
        for n, p in ref_params.items():
            assert torch.equal(a["params"][n], b["params"][n]), f"{tag}: {n} differs across ranks"
            torch.testing.assert_close(a["params"][n], p, rtol=RTOL, atol=ATOL, msg=lambda m: f"{tag} {n}: {m}")
            if clip is None:
                torch.testing.assert_close(a["params"][n], r0["ddp"]["params"][n], rtol=1e-6, atol=1e-7)
