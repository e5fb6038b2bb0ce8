"""The data-parallel readers with expert parameters (issue [8] item 1), on 4 gloo ranks: dp=4, ep=2, edp=2.

Experts are placed by hand on ``mesh["ep"]`` (``_expert_group_workers._ExpertShard``, stage 22) and the toy
experts compute only this rank's experts, so every parameter's gradient must be (sum of the dp ranks' own
gradients) / dp: for dense parameters that is DDP's/FSDP's dp mean, for experts the sum over edp / dp. The
single-process reference runs each rank's micro-batch with the experts that rank holds (two SGD steps: a
plain ``backward(); optimizer.step()`` loop with the loss scaled by 2**10 and the gradients unscaled by
``DynamicLossScaler.unscale_``, then ``train_step`` with clipping at ``MAX_NORM``).

Tolerances: fp32, differences only from the order of sums (observed ~1e-8): gradients and parameters atol
1e-6, the clipped step's global norm rtol 1e-5. Wrong runs, asserted > 10x away: expert gradients averaged
over edp instead of divided by dp (2x), an untrained run, experts broadcast over dp (rank 0's shard on every
rank), the reducer running twice in a step (experts 1/dp of the right gradient); a gradient the unscaling
missed would be 1024x off.

Rank 3's experts receive no tokens (case C05's situation for the readers): its expert gradients are None,
it must not hang, and it counts as zero in the reduction.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed import _expert_group_workers as W
from torchloom.testing import run_ranks

ATOL = 1e-6
NORM_RTOL = 1e-5
DP, EP, DROP = 4, 2, 3


@pytest.fixture(scope="module")
def runs():
    return run_ranks(W.ddp_and_fsdp, DP, DROP, timeout=900)


@pytest.fixture(scope="module")
def ref():
    return W.reference(DP, EP, DROP)


@pytest.fixture(scope="module")
def ref_e2():
    return W.reference(DP, EP, DROP, experts=2)


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _experts(d: dict) -> dict:
    return {k: v for k, v in d.items() if ".experts." in k}


def test_wrong_runs_are_far(ref):
    edp_mean = W.reference(DP, EP, DROP, expert_scale=2.0)
    twice = W.reference(DP, EP, DROP, expert_scale=1.0 / DP)
    for name, wrong in (("edp mean", edp_mean), ("reduced twice", twice)):
        assert _diff(_experts(wrong["grads1"]), _experts(ref["grads1"])) > 10 * ATOL, name
        assert _diff(wrong["params2"], ref["params2"]) > 10 * ATOL, name
    assert _diff(ref["params1"], W.effective_model(EP).state_dict()) > 10 * ATOL  # untrained
    assert ref["norm2"] > W.MAX_NORM  # the second step really clips


@pytest.mark.parametrize("method", ["ddp", "fsdp", "fsdp_e2", "hsdp", "fsdp_wrap_experts"])
def test_expert_and_dense_gradients(runs, ref, ref_e2, method):
    """fsdp_e2: 2 experts, so edp x ep = 4 > E and FSDP shards the experts on dim 1 (torchtitan's rule);
    hsdp: dense parameters on the 2-D (dp_replicate=2, dp_shard=2) mesh, experts on edp; fsdp_wrap_experts:
    the experts class named in wrap_cls (it stays one unit, on edp)."""
    experts = 2 if method == "fsdp_e2" else W.E
    ref = ref_e2 if method == "fsdp_e2" else ref
    start = W.effective_model(EP, experts).state_dict()
    for rank, out in enumerate(runs):
        got = out[method]
        assert got["groups"] == 2, "the record is attached to the returned model"
        # broadcasts: dense from rank 0, experts over edp only (ep shard e from rank e)
        d = _diff(got["start"], {k: v for k, v in start.items()})
        assert d <= ATOL, f"{method} rank {rank}: start differs from the broadcast model by {d:.3g}"
        assert got["found_inf"] is False
        d = _diff(got["grads1"], ref["grads1"])
        assert d <= ATOL, f"{method} rank {rank}: gradients differ from (sum over ranks)/dp by {d:.3g}"
        d = _diff(got["params1"], ref["params1"])
        assert d <= ATOL, f"{method} rank {rank}: parameters after the plain-loop step differ by {d:.3g}"
        assert got["norm2"] == pytest.approx(ref["norm2"], rel=NORM_RTOL), f"{method} rank {rank}: global norm"
        d = _diff(got["params2"], ref["params2"])
        assert d <= ATOL, f"{method} rank {rank}: parameters after the clipped train_step differ by {d:.3g}"


def test_fsdp_expert_placements_and_meta_materialisation(runs):
    for out in runs:
        assert all("Shard(dim=0)" in p and "_StridedShard" in p for p in out["fsdp"]["placements"].values()), \
            out["fsdp"]["placements"]
        assert all(p.startswith("(Shard(dim=1)") for p in out["fsdp_e2"]["placements"].values()), \
            out["fsdp_e2"]["placements"]
        # a meta-device model with expert DTensors materialises to the plain build's values (bitwise on CPU)
        plain = W.build(0).state_dict()
        d = _diff(out["fsdp_meta"]["start"], plain)
        assert d == 0.0, f"meta materialisation differs from the plain build by {d:.3g}"


def test_ddp_experts_differ_across_ep_and_match_across_edp(runs):
    local = [out["ddp"]["local_w0"] for out in runs]  # rank = edp_index * ep + ep_index
    assert torch.equal(local[0], local[2]) and torch.equal(local[1], local[3])  # edp peers
    assert not torch.allclose(local[0], local[1])  # ep peers hold different experts


def test_zero1_refuses_experts(runs):
    for out in runs:
        msg = out["zero1"]
        assert msg is not None and "zero1" in msg and "fsdp" in msg and "ep" in msg, msg
