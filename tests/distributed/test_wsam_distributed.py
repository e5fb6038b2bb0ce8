"""WSAM through auto_accelerate + train_step on 2 gloo ranks against single-process references of the same
semantics (tiny HF Llama, 3 steps, global batch 8, base SGD + momentum, decoupled, gamma 0.8, rho 0.1).

- DDP: per-replica perturbation (first pass under ``no_sync``; each rank's e from its own half of the
  batch), g and g~ averaged. Reference: ``reference_wsam(replicas=2)``.
- FSDP: the sharded weights are one copy for all ranks, so the perturbation uses the averaged gradient.
  Reference: ``reference_wsam(replicas=1)`` (plain WSAM on the global batch).
- Tensor + sequence + loss parallel (tp=2, dp=1): one model replica; the same reference.

Tolerances: losses rtol 1e-5, parameters atol 2e-5 (fp32; only the reduction order differs, as in
test_methods_equivalence). The two references differ by far more than that (asserted), so the test tells
per-replica from averaged perturbation. DCP round trip: the resumed run matches bit for bit (atol 0).
"""
import pytest
import torch

from tests.distributed._wsam_workers import reference_wsam, train_wsam
from torchloom.testing import run_ranks

STEPS, GB = 3, 8


def _assert_close(out, ref, name):
    ref_losses, ref_params = ref
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                               msg=lambda m: f"{name} losses: {m}")
    assert set(out["params"]) == set(ref_params)
    for k, v in ref_params.items():
        torch.testing.assert_close(out["params"][k], v.float(), atol=2e-5, rtol=0, msg=lambda m: f"{name} {k}: {m}")


@pytest.mark.distributed
def test_wsam_ddp_and_fsdp_match_references_2ranks():
    cfgs = {
        "ddp_accum": dict(strategy=["ddp"], micro_batch=2),  # accumulation 2, per-replica perturbation
        "fsdp_clip": dict(strategy=["fsdp"], micro_batch=4, max_grad_norm=0.5, dcp=True),
        # DTensor parameters mixed with plain ones; loss parallel's context is entered in the replay too
        "tp_sp_lp": dict(strategy=[("parallel_mode", {"tp": 2}), "tensor_parallel", "sequence_parallel",
                                   "loss_parallel"], micro_batch=4),
    }
    outs = run_ranks(train_wsam, 2, [dict(steps=STEPS, global_batch=GB, **c) for c in cfgs.values()], timeout=400)
    per_replica = reference_wsam(STEPS, GB, replicas=2)
    averaged_clip = reference_wsam(STEPS, GB, replicas=1, max_grad_norm=0.5)
    averaged = reference_wsam(STEPS, GB, replicas=1)
    gap = max(float((per_replica[1][k] - averaged[1][k]).abs().max()) for k in averaged[1])
    assert gap > 1e-4, f"per-replica and averaged perturbation must be distinguishable (gap {gap})"

    by_name = dict(zip(cfgs, zip(outs[0], outs[1])))
    o0, o1 = by_name["ddp_accum"]
    assert o0["is_wsam"] and o0["accum"] == 2
    _assert_close(o0, per_replica, "ddp")
    o0f, o1f = by_name["fsdp_clip"]
    _assert_close(o0f, averaged_clip, "fsdp")
    _assert_close(by_name["tp_sp_lp"][0], averaged, "tp")
    for name, (a, b) in by_name.items():
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), f"{name}: {k} differs across ranks"
    assert o0f["dcp_max_diff"] == 0.0 and o1f["dcp_max_diff"] == 0.0
