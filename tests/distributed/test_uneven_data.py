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


# ------------------------------------------------------------------------------------------ evaluation loader
def _check_eval(ranks, n, tag):
    ids = sorted(i for r in ranks for i in r["own"])
    assert ids == list(range(n)), f"{tag}: samples not seen exactly once: {ids}"
    for r in ranks:
        assert sorted(r["gathered"]) == list(range(n)), f"{tag}: gather_for_metrics {r['gathered']}"
        assert r["steps"] == ranks[0]["steps"], f"{tag}: ranks ran different numbers of steps (a forward would hang)"
        exact = sum(W.metric_value(i) for i in range(n)) / n
        assert r["mean"] == exact, f"{tag}: reduce_metrics {r['mean']!r} != single-process mean {exact!r}"


@pytest.mark.distributed
@pytest.mark.parametrize("world,shards", [(2, [5, 3]), (4, [4, 0, 6, 3])])
def test_eval_loader_counts_every_sample_once(world, shards):
    """13 samples, batch 2: 4 ranks x 2 does not divide 13 (last step 2/1/1/1), 2 ranks x 2 leaves 1 (1/0)."""
    ranks = run_ranks(W.eval_runs, world, 13, 2, shards, timeout=300)
    _check_eval([r["map"] for r in ranks], 13, "map")
    assert [r["map"]["gathered"] for r in ranks] == [list(range(13))] * world, "not in dataset order"
    if world == 2:
        assert [r["map"]["fillers"] for r in ranks] == [0, 1], "rank 1 has no sample in the last step"
    _check_eval([r["iterable"] for r in ranks], sum(shards), "iterable")
    # the longest shard sets the steps: 6 samples / batch 2 = 3 (4 ranks); the empty shard runs 3 filler batches
    assert ranks[0]["iterable"]["steps"] == -(-max(shards) // 2)


@pytest.mark.distributed
def test_eval_loader_pads_pipeline_microbatches_and_splits_only_dp():
    ranks = run_ranks(W.eval_runs, 2, 13, 3, [13, 0], 2, timeout=300)  # rows rounded up to a multiple of 2
    _check_eval([r["map"] for r in ranks], 13, "map multiple 2")
    ranks = run_ranks(W.eval_on_mesh, 4, 13, 2, timeout=300)
    assert ranks[0]["own"] == ranks[1]["own"] and ranks[2]["own"] == ranks[3]["own"], "tp peers read other samples"
    _check_eval([ranks[0], ranks[2]], 13, "dp2 x tp2")
    exact = sum(W.metric_value(i) for i in range(13)) / 13
    assert [r["mean"] for r in ranks] == [exact] * 4
    # a gather over the world (4 ranks) instead of the dp group would return every sample twice
    assert [r["gathered"] for r in ranks] == [list(range(13))] * 4


# ------------------------------------------------------------------------------------------ iterable training
# DDP vs one-process SGD on the same micro-batches: fp32, a 4-8-1 MLP, 3 steps -> ~1e-7; one step more or less
# moves the parameters by ~1e-2 (lr 0.1), so atol 1e-6 tells the number of steps apart.
PARAM_ATOL = 1e-6


def _check_params(ranks, ref):
    for r in ranks:
        for k, v in ref.items():
            torch.testing.assert_close(r["params"][k], v, atol=PARAM_ATOL, rtol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.distributed
def test_iterable_uneven_batches_stop_together_2ranks():
    """Rank 0 holds 5 micro-batches, rank 1 holds 3 (micro batch 2): every rank trains 3 steps, the surplus is
    dropped with a warning that names the counts; a second epoch behaves the same. With gradient accumulation
    (2 micro-batches per step) both stop after 1 full step + the 3rd micro-batch (as many as rank 1 has)."""
    ranks = run_ranks(W.train_iterable, 2, [10, 6], 2, 1, epochs=2, timeout=300)
    assert [r["error"] for r in ranks] == [None, None]
    assert [r["batches"] for r in ranks] == [6, 6], "ranks trained different numbers of steps"
    assert len(ranks[0]["warnings"]) == 2 and not ranks[1]["warnings"], ranks[0]["warnings"]
    assert "rank(s) [1] ran out" in ranks[0]["warnings"][0] and "{0: '4+', 1: '3'}" in ranks[0]["warnings"][0]
    assert "stopped after 3 batches" in ranks[0]["warnings"][0]
    assert [r["state"]["epoch"] for r in ranks] == [2, 2]
    ref = W.train_reference([10, 6], 2, 1, steps=3)  # the reference of one epoch (3 steps)
    ranks1 = run_ranks(W.train_iterable, 2, [10, 6], 2, 1, timeout=300)
    _check_params(ranks1, ref)
    accum = run_ranks(W.train_iterable, 2, [10, 6], 2, 2, timeout=300)
    assert [r["batches"] for r in accum] == [3, 3] and [r["micro_steps"] for r in accum] == [3, 3]


@pytest.mark.distributed
def test_iterable_uneven_error_mode_and_failed_resume_raise_on_every_rank_2ranks():
    ranks = run_ranks(W.train_iterable, 2, [10, 6], 2, 1, uneven="error", timeout=300)
    assert all(r["error"] and "DataError" in r["error"] and "rank(s) [1] ran out" in r["error"] for r in ranks)
    assert [r["batches"] for r in ranks] == [3, 3]
    # resuming at batch 4 of epoch 0: rank 1 has only 3 batches, so it cannot restore; rank 0 must not wait
    ranks = run_ranks(W.train_iterable, 2, [10, 6], 2, 1, resume_batches=4, timeout=300)
    assert "needs to skip 4 batches" in ranks[1]["error"], ranks[1]["error"]
    assert "ranks [1] could not restore" in ranks[0]["error"], ranks[0]["error"]


@pytest.mark.distributed
def test_iterable_one_empty_rank_4ranks():
    """4 ranks, rank 2's shard is empty: nobody trains (and nobody hangs); the warning names rank 2."""
    ranks = run_ranks(W.train_iterable, 4, [8, 8, 0, 6], 2, 1, timeout=300)
    assert [r["batches"] for r in ranks] == [0] * 4 and [r["error"] for r in ranks] == [None] * 4
    assert "rank(s) [2] ran out" in ranks[0]["warnings"][0], ranks[0]["warnings"]
    ref = W.train_reference([8, 8, 0, 6], 2, 1, steps=0)
    _check_params(ranks, ref)
    late = run_ranks(W.train_iterable, 4, [6, 6, 6, 8], 2, 1, timeout=300)  # 3/3/3/4 batches
    assert [r["batches"] for r in late] == [3] * 4 and "rank(s) [0, 1, 2] ran out" in late[0]["warnings"][0]
    _check_params(late, W.train_reference([6, 6, 6, 8], 2, 1, steps=3))


# ------------------------------------------------------------------------------------------ gather shapes, TP mesh
# TP (tp=2) vs the one-process forward of the same sequences: fp32, another reduction order -> ~1e-7 relative.
# Tensor-parallel peers reading different samples (eval_loader without mesh= before the fix) gave 4.8735 vs
# 4.8431 (6e-3 relative); rtol 1e-5 separates them.
TP_EVAL_RTOL = 1e-5


@pytest.mark.distributed
def test_gather_shapes_and_structures_and_current_mesh_2ranks():
    """13 samples, batch 3. dp 2: rank r gathers (3, 2 + r) tensors (before: gloo EnforceNotMet, SIGABRT), nested
    structures, mismatches; then tp 2 without mesh= (before: tp peers read different samples, mean 4.8735 vs
    4.8431)."""
    ranks = run_ranks(W.eval_gather_and_current_mesh, 2, 13, 3, timeout=600)
    for r in ranks:  # every rank raises the same error (none aborts or hangs), naming each rank's shape
        assert r["varlen_error"] and r["varlen_error"].startswith("DataError") and "pad_value" in r["varlen_error"]
        assert "0: ('rows', 2)" in r["varlen_error"] and "1: ('rows', 3)" in r["varlen_error"], r["varlen_error"]
        assert "another structure" in r["structure_error"], r["structure_error"]
        assert "dtypes differ" in r["dtype_error"], r["dtype_error"]
    assert "3 rows in dim 0" in ranks[0]["one_rank_error"], ranks[0]["one_rank_error"]
    assert "rank(s) [0] passed values" in ranks[1]["one_rank_error"], ranks[1]["one_rank_error"]
    # step 0: rank 0 has ids 0..2 (2 columns, padded to 3 with -1), rank 1 has ids 3..5 (3 columns)
    want = [[i + 1] * 2 + [-1] for i in range(3)] + [[i + 1] * 3 for i in range(3, 6)]
    assert [r["padded"] for r in ranks] == [want, want]
    ids = list(range(6))
    nested = [ids, [2 * i for i in ids], [float(i) for i in ids], "tuple", True, [[i] * 3 for i in ids]]
    assert [r["nested"] for r in ranks] == [nested, nested]

    ref = W.tp_eval_reference(13)
    assert ranks[0]["own"] == ranks[1]["own"] == list(range(13)), "tp peers read other samples"
    for r in ranks:
        assert r["gathered"] == list(range(13))
        assert r["mean"] == pytest.approx(ref, rel=TP_EVAL_RTOL) and r["free_mean"] == r["mean"], (r["mean"], ref)
        for key in ("world_group_error", "dp_rank_error", "reduce_world_error"):
            assert r[key] and r[key].startswith("DataError") and "current torchloom mesh" in r[key], (key, r[key])
