"""C10 — gradient accumulation with variable token counts [huggingface/transformers PR 34191].

8 sequences of 10-128 tokens (padding labels -100), run as 1 batch of 8 (the reference: the token losses
summed over all 446 valid targets, divided by 446), as 8 micro-batches of 1 through torchloom's
``TrainStep`` and as 2 ranks x 4 micro-batches through ``auto_accelerate`` (DDP and FSDP). The two ranks
hold 239 and 215 tokens, every micro-batch a different count.

torchloom's answer is a ``loss_func`` returning ``torchloom.SumLoss(total, count)``: the gradient of the
sums is divided by the count summed over accumulation steps and ranks. Checks: all splits give the
reference gradient (rtol 1e-5 / atol 1e-7: the token sum is formed per micro-batch and per rank instead
of in one batch). Control: the usual mean-loss accumulation (each micro-batch's mean, averaged) differs from
the reference by far more than the tolerance, so the comparison can fail.
"""
from __future__ import annotations

import pytest
import torch

from tests.cases import _workers as W
from tests.models import lm_loss
from torchloom.testing import run_ranks

RTOL, ATOL = 1e-5, 1e-7


def _assert_matches(grads, ref, what):
    assert sorted(grads) == sorted(ref), what
    for n, g in grads.items():
        torch.testing.assert_close(g, ref[n], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {n}: {m}")


def _max_rel_err(grads, ref):
    return max(((g - ref[n]).abs().max() / ref[n].abs().max()).item() for n, g in grads.items())


def test_one_process_accumulation_matches_one_batch():
    ref, count = W.c10_reference()
    assert count == sum(n - 1 for n in W.C10_LENGTHS)
    _assert_matches(W.c10_accumulate(micro=8), ref, "1 x 8 SumLoss")
    _assert_matches(W.c10_accumulate(micro=1), ref, "8 x 1 SumLoss")
    assert _max_rel_err(W.c10_accumulate(micro=1, loss_func=lm_loss), ref) > 1e-2  # mean loss: wrong weights


@pytest.mark.distributed
def test_two_ranks_by_four_micro_batches_match_one_batch():
    ref, _ = W.c10_reference()
    for rank, r in enumerate(run_ranks(W.c10_ranks, 2)):
        _assert_matches(r["ddp_sum"], ref, f"rank {rank} ddp 2x4 SumLoss")
        _assert_matches(r["fsdp_sum"], ref, f"rank {rank} fsdp 2x4 SumLoss")
        assert _max_rel_err(r["ddp_mean"], ref) > 1e-2
