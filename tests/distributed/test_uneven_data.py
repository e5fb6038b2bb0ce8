"""Uneven data on 2 and 4 gloo ranks (issue [5] item 5).

* Evaluation counts every sample exactly once (dataset sizes that do not divide by ranks x batch), and the
  metric helpers equal the single-process mean exactly (values are multiples of 1/8, so float64 sums are exact
  in any order: tolerance 0).
* Iterable data with different numbers of batches per rank neither hangs (every launch has a timeout, so a
  hang fails) nor trains on unsynchronised gradients: all ranks stop at the same step (the documented
  "drop the remainder and warn"), or raise together with ``uneven="error"``.
* ``loom train``'s held-out loss (``Job.evaluate``) is the token-weighted mean over exactly the held-out
  windows under DDP, pipeline and tensor parallel.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed import _uneven_workers as W
from torchloom.testing import run_ranks

# Job.evaluate vs the one-process loop over the same windows: fp32 forwards of the same rows, summed in another
# order and batch shape -> ~1e-7 relative. Evaluating 12 of 13 windows (the remainder dropped) moves the mean by
# ~2e-4 (printed by the test), a double-counted window by a similar amount; rtol 2e-6 separates them.
EVAL_RTOL = 2e-6

PP2 = ("pipeline_parallel", {"size": 2, "num_microbatches": 2})


def _check_job_eval(got, configs):
    for c, value in zip(configs, got):
        subset = None
        if c.get("batches"):
            want = min(c["n"], c["batches"] * c["batch_size"])
            subset = torch.linspace(0, c["n"] - 1, want).round().long().tolist()
        ref = W.heldout_reference(c["n"], subset)
        dropped = W.heldout_reference(c["n"], (subset or list(range(c["n"])))[:-1])
        assert value == pytest.approx(ref, rel=EVAL_RTOL), (
            f"{c['tag']}: held-out loss {value!r} != reference {ref!r} (the last window dropped would give "
            f"{dropped!r})")


@pytest.mark.distributed
def test_job_evaluate_counts_every_heldout_window_once_2ranks():
    configs = [
        dict(tag="ddp", strategy=None, n=13, batch_size=4),
        dict(tag="ddp_subset", strategy=None, n=13, batch_size=3, batches=3),
        dict(tag="pp2", strategy=[PP2], n=13, batch_size=4),
    ]
    ranks = run_ranks(W.job_evaluate, 2, configs, timeout=600)
    assert ranks[0] == ranks[1], "ranks disagree on the held-out loss"
    _check_job_eval(ranks[0], configs)


@pytest.mark.distributed
def test_job_evaluate_counts_every_heldout_window_once_4ranks():
    configs = [
        dict(tag="ddp4", strategy=None, n=13, batch_size=8),
        dict(tag="dp2_pp2", strategy=[PP2], n=13, batch_size=4),
        dict(tag="dp2_tp2", strategy=[("tensor_parallel", {"size": 2})], n=13, batch_size=4),
    ]
    ranks = run_ranks(W.job_evaluate, 4, configs, timeout=600)
    assert all(r == ranks[0] for r in ranks), "ranks disagree on the held-out loss"
    _check_job_eval(ranks[0], configs)
