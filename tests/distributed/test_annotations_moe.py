"""EPL-style ``split`` around experts, and ATorch's ``("expert", N)`` degree, train like the one-process
reference (issue [8] item 5), on 2 gloo ranks in one launch:

* a tiny HF Mixtral (4 experts, top-2, 2 layers) with every layer's experts in a ``split(2)`` scope, through
  ``torchloom.auto_accelerate(strategy=None)``: the derived strategy is parallel_mode(dp=2, ep=2) +
  expert_parallel (ep carved out of dp: the dense layers stay data parallel over both ranks);
* the same model through ``torchloom.compat.atorch.auto_accelerate`` with
  ``parallel_mode ([("data", 2), ("expert", 2)], None)`` in ATorch's plain loop.

Reference (``_ep_workers.reference``): one process runs each rank's micro-batches in turn and accumulates
``loss / (dp * accum)`` (the load-balancing loss is per micro-batch, as the model computes it), SGD with
momentum. Tolerances: losses rtol 1e-5, parameters atol 2e-5 (reduction order only). A wrong run is far
outside them, and the test measures it: the untrained parameters, and expert gradients scaled by 2 (experts
averaged over edp instead of dp), each must differ from the reference by more than 10 x the tolerance.
"""
import pytest
import torch

from tests.distributed._annotation_moe_workers import run_all
from tests.distributed._ep_workers import build, reference
from torchloom.testing import run_ranks

STEPS, GB, MICRO = 3, 4, 1
LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-5


def _assert_close(out, ref, what):
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0,
                               msg=lambda m: f"{what} losses: {m}")
    assert out["params"].keys() == ref["params"].keys(), what
    for k, v in ref["params"].items():
        torch.testing.assert_close(out["params"][k], v, atol=PARAM_ATOL, rtol=0, msg=lambda m: f"{what} {k}: {m}")


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


@pytest.mark.distributed
def test_split_experts_and_atorch_expert_degree_match_reference_on_2_ranks():
    outs = run_ranks(run_all, 2, STEPS, GB, MICRO, timeout=600)
    ref = reference("mixtral", STEPS, GB, 2, MICRO)  # 2 micro-batches of 1 per rank, accumulated
    ref_atorch = reference("mixtral", STEPS, GB, 2, GB // 2)  # ATorch's loop: one micro-batch of 2 per rank

    # the wrong runs are far from the reference (so the tolerances can tell)
    untrained = {k: v.detach().float() for k, v in build("mixtral").state_dict().items()}
    assert _max_diff(untrained, ref["params"]) > 10 * PARAM_ATOL
    assert _max_diff(reference("mixtral", STEPS, GB, 2, MICRO, expert_grad_scale=2.0)["params"],
                     ref["params"]) > 10 * PARAM_ATOL

    for r, o in enumerate(outs):
        ann = o["annotated"]
        assert ann["strategy"]["methods"][:2] == [
            {"name": "parallel_mode", "config": {"dp": 2, "ep": 2}},
            {"name": "expert_parallel", "config": {"experts_cls": ["MixtralExperts"]}}], ann["strategy"]
        assert (ann["mesh"]["ep"], ann["mesh"]["edp"], ann["mesh"]["tp"]) == (2, 1, 1)
        assert any(n.startswith("annotations: replicate/split scopes give") for n in ann["notes"])
        assert any(n.startswith("expert_parallel: 2 experts modules") for n in ann["notes"]), ann["notes"]
        _assert_close(ann, ref, f"annotated rank {r}")

        at = o["atorch"]
        assert at["best"][0][1] == ([("data", 2), ("expert", 2)], None)  # not "fitted" down to data 1
        assert [m["name"] for m in at["strategy"]["methods"]][:2] == ["parallel_mode", "expert_parallel"]
        assert at["groups"] == {"data": (2, r), "expert": (2, r), "expert_fsdp": (None, None)}  # edp = 1
        assert any("is expert parallelism over 2 of the 2 data-parallel ranks" in n for n in at["notes"])
        _assert_close(at, ref_atorch, f"atorch rank {r}")
