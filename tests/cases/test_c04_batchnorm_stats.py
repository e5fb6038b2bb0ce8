"""C04 — BatchNorm statistics under data parallel and hybrid sharding [pytorch/pytorch PR 178569].

A small CNN with BatchNorm on 4 ranks: HSDP on a 2x2 (replicate x shard) mesh, and DDP with gradient
accumulation (2 micro-batches per rank). FSDP never synchronises buffers and DDP's ``broadcast_buffers``
only copies rank 0's before a synchronised training forward, so after training every rank holds different
running statistics and evaluation depends on the rank.

torchloom (``torchloom.parallel.buffers``, on by default as ``sync_buffers`` of ``fsdp`` and ``ddp``)
averages the running statistics over the data-parallel ranks after every optimizer step. Checks: running
mean/var identical across ranks (bit for bit) and equal to a one-process reference that plays the 4 ranks
and averages their updates; eval outputs identical across ranks (bit for bit) and equal to the reference's;
parameters equal the reference's. A run with ``sync_buffers=False`` shows the check can fail.

Tolerance: rtol 1e-5 / atol 1e-6. The 4-way average is a gloo all-reduce and each rank's 2-sample batch
statistics are summed in another order than the reference's shards.
"""
from __future__ import annotations

import pytest
import torch

from tests.cases import _workers as W
from torchloom.testing import run_ranks

RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.distributed
def test_batchnorm_running_stats_synchronised_under_hsdp_and_ddp():
    results = run_ranks(W.c04_batchnorm, 4)
    for tag, (_, micro) in W.C04_CONFIGS.items():
        ref_buffers, ref_params, ref_eval = W.c04_reference(dp=4, micro=micro)
        rank0 = results[0][tag]
        assert rank0["dp"] == 4 and rank0["accum"] == W.C04_GBS // 4 // micro
        if tag == "fsdp_nosync":  # the fault: statistics and evaluation differ from rank to rank
            assert not any("running-statistic" in n for n in rank0["notes"])
            assert not all(torch.equal(r[tag]["buffers"]["blocks.0.bn.running_mean"],
                                       rank0["buffers"]["blocks.0.bn.running_mean"]) for r in results[1:])
            assert not all(torch.equal(r[tag]["eval"], rank0["eval"]) for r in results[1:])
            continue
        assert any("running-statistic buffers averaged over dp=4" in n for n in rank0["notes"]), rank0["notes"]
        for r in results:
            got = r[tag]
            for n, b in got["buffers"].items():
                assert torch.equal(b, rank0["buffers"][n]), f"{tag}: {n} differs between rank 0 and {got['rank']}"
                torch.testing.assert_close(b, ref_buffers[n].to(b.dtype), rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{tag} {n}: {m}")
            assert torch.equal(got["eval"], rank0["eval"]), f"{tag}: eval output of rank {got['rank']} differs"
            for n, p in ref_params.items():
                torch.testing.assert_close(got["params"][n], p, rtol=RTOL, atol=ATOL, msg=lambda m: f"{tag} {n}: {m}")
        torch.testing.assert_close(rank0["eval"], ref_eval, rtol=RTOL, atol=ATOL)
