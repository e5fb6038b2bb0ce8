"""torchloom.moe.MoE (aux and z losses on) under expert parallelism (ep=2 on 2 ranks: edp=1, with ddp and with
fsdp, dropless and capacity 1.0) and under pipeline parallelism (2 stages, 2 micro-batches), each against one
process running the same micro-batches with gradient accumulation (SGD, 2 steps).

Tolerance: fp32, only the order of sums differs (observed <= 4e-9): atol 1e-6. A run whose expert gradients
are halved or doubled (what FSDP2's size-1-mesh double division gave: torch 2.13 divides by the gradient
divide factor in its world-size-1 copy and again after it) lands ~1e-4 away; a pipeline run whose aux
gradient is not divided by the micro-batch count lands ~10 away. Both are asserted > 10x the tolerance.
"""
from __future__ import annotations

import pytest

from tests.distributed import _moe_layer_workers as W
from torchloom.testing import run_ranks

ATOL = 1e-6


def _diff(got: dict, ref: dict, only: str = "") -> float:
    return max(float((got[k] - ref[k]).abs().max()) for k in ref if only in k)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_moe_layer_expert_parallel_ddp_and_fsdp(capacity_factor):
    ref = W.ep_reference(capacity_factor)
    for wrong in (0.5, 2.0):
        assert _diff(W.ep_reference(capacity_factor, wrong), ref, ".experts.") > 10 * ATOL
    for dp_method in ("ddp", "fsdp"):
        strategy = [dp_method, "expert_parallel", ("parallel_mode", {"ep": 2})]
        outs = run_ranks(W.ep_worker, 2, strategy, capacity_factor, timeout=600)
        for rank, out in enumerate(outs):
            d = _diff(out["params"], ref)
            assert d <= ATOL, f"{dp_method} rank {rank} capacity {capacity_factor}: params differ by {d:.3g}"
            assert out["metrics"]["aux_loss"] > 0


def test_moe_layer_pipeline_parallel():
    ref, wrong = W.pp_reference(), W.pp_reference(aux_factor_one=True)
    assert _diff(wrong, ref) > 10 * ATOL
    outs = run_ranks(W.pp_worker, 2, timeout=600)
    params = {**outs[0]["params"], **outs[1]["params"]}
    assert params.keys() == ref.keys()
    d = _diff(params, ref)
    assert d <= ATOL, f"pipeline: params differ from the reference by {d:.3g}"


def test_fsdp_output_hidden_from_pytree_is_a_clear_error():
    """Without the check the first backward failed with "setStorage: sizes [32, 16] ... out of bounds for
    storage of size 0" (FSDP2 could not hook the pre-backward of an output it cannot see into)."""
    msg = run_ranks(W.hidden_output_worker, 1, timeout=300)[0]
    assert "FSDP cannot see" in msg and "ModelOutput" in msg, msg
