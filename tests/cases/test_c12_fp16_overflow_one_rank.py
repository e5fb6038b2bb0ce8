"""C12 — fp16 overflow seen on one rank only [pytorch/pytorch PR 115710; facebookresearch/fairscale 754].

fp16 with dynamic loss scaling (``("amp", {"dtype": "float16"})``) under FSDP and DDP on 2 ranks. Before
the second optimizer step, rank 1 alone writes inf into its local shard of one gradient. With sharded
gradients a rank only sees its own shard, so an unsynchronised scaler would step on rank 0 and skip on
rank 1, and the replicas would diverge for good.

Checks: every rank skips exactly that step and halves the scale identically; the parameters do not move
on the skipped step (bit for bit) and are identical across ranks after every step (bit for bit); they
match a single-process fp16-autocast reference with the same skip (rtol 1e-3 / atol 2e-5: fp16 compute,
and FSDP's fp16 parameter casting is not autocast's per-op policy; measured max |diff| ~6e-6); when the
overflow repeats until the scale would drop below ``min_scale`` every rank raises ``LossScaleError`` at
the same step.
"""
from __future__ import annotations

import pytest
import torch

from tests.cases import _workers as W
from torchloom.testing import run_ranks

RTOL, ATOL = 1e-3, 2e-5


@pytest.mark.distributed
def test_overflow_on_one_rank_skips_everywhere_and_backs_off_identically():
    ref = W.c12_reference(skip={1})
    results = run_ranks(W.c12_fp16_overflow, 2)
    for tag in ("fsdp", "ddp"):
        for rank, r in enumerate(results):
            got = r[tag]
            s = W.C12_INIT_SCALE
            assert [(st["skipped"], st["scale"]) for st in got["steps"]] == [(False, s), (True, s / 2), (False, s / 2)]
            assert got["skipped_steps"] == 1
            for n, p in got["steps"][1]["params"].items():
                assert torch.equal(p, got["steps"][0]["params"][n]), f"{tag} rank {rank}: {n} moved on a skipped step"
            for i, st in enumerate(got["steps"]):
                for n, p in st["params"].items():
                    assert torch.equal(p, results[0][tag]["steps"][i]["params"][n]), f"{tag} step {i}: {n} differs"
                    torch.testing.assert_close(p, ref[i][n], rtol=RTOL, atol=ATOL, msg=lambda m: f"{tag} {i} {n}: {m}")
            floor = got["floor"]
            assert floor["at_step"] == 2 and floor["scale"] == 1.0, (tag, rank, floor)
            assert "min_scale=1" in floor["error"] and "bfloat16" in floor["error"]
