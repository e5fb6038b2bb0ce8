"""Annotated models (EPL-style ``replicate``/``split``) train like their single-process reference, and like
the same model given the equivalent hand-written strategy.

Tolerances: losses rtol 1e-5, parameters atol 2e-5 after 3 steps of SGD with momentum (the differences
come only from reduction order: pipeline micro-batch means, tensor-parallel partial sums, the
data-parallel mean). Annotated vs hand-written runs execute the same operations: compared exactly.
"""
import pytest
import torch

from tests.distributed._annotation_workers import CLASSIFIER_PLAN, reference_classifier, reference_seqnet, run_many
from tests.distributed._train_workers import reference_llama
from torchloom.testing import run_ranks

STEPS, GB = 3, 8


def _assert_close(out, ref, what):
    ref_losses, ref_params = ref
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                               msg=lambda m: f"{what} losses: {m}")
    for k, v in out["params"].items():
        torch.testing.assert_close(v, ref_params[k].float(), atol=2e-5, rtol=0, msg=lambda m: f"{what} {k}: {m}")


def _merged_params(rank_outs):
    """Union of the ranks' parameters (pipeline stages hold different ones); replicas must agree exactly."""
    out = {}
    for o in rank_outs:
        for k, v in o["params"].items():
            if k in out:
                assert torch.equal(out[k], v), f"{k} differs between ranks"
            out[k] = v
    return out


def _assert_identical(a_ranks, b_ranks, what):
    for a, b in zip(a_ranks, b_ranks):
        assert a["losses"] == b["losses"], what
        assert a["params"].keys() == b["params"].keys(), what
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), f"{what}: {k}"


@pytest.mark.distributed
def test_annotated_pipeline_and_split_on_4_ranks():
    """Two replicate stages on 4 ranks -> pp=2 with derived dp=2 (an HF Llama annotated with the function
    form, and an nn.Sequential annotated in its __init__); a replicate body + split head on 4 ranks -> tp=2
    with derived dp=2 (fsdp added: DDP cannot hold DTensor parameters)."""
    hand_pp = [("parallel_mode", {"dp": 2}), ("pipeline_parallel", {"size": 2, "split_points": ["model.layers.1"]})]
    cfgs = [
        ("llama", dict(annotated=True, steps=STEPS, global_batch=GB, micro=2)),
        ("llama", dict(annotated=False, steps=STEPS, global_batch=GB, micro=2, strategy=hand_pp)),
        # fsdp's start-up broadcast (parallel/buffers.py broadcast_module_states) cannot broadcast DTensor
        # parameters yet; every rank builds the same model from one seed, so the test skips it (and so
        # exercises the merge of a given strategy into the derived one)
        ("classifier", dict(annotated=True, steps=STEPS, global_batch=GB, micro=2,
                            strategy=[("fsdp", {"sync_module_states": False})])),
        ("seqnet", dict(steps=STEPS, global_batch=GB, micro=2)),
    ]
    outs = run_ranks(run_many, 4, cfgs, timeout=600)
    per_cfg = [[outs[r][i] for r in range(4)] for i in range(len(cfgs))]
    ann, hand, clf, seq = per_cfg
    assert ann[0]["strategy"]["methods"][:2] == [
        {"name": "parallel_mode", "config": {"dp": 2}},
        {"name": "pipeline_parallel", "config": {"size": 2, "split_points": ["model.layers.1"]}}]
    assert ann[0]["mesh"]["pp"] == 2 and ann[0]["mesh"]["dp_replicate"] * ann[0]["mesh"]["dp_shard"] == 2
    assert any(n.startswith("pipeline_parallel: ") and "into 2 stages" in n for n in ann[0]["notes"])
    assert ann[0]["params"].keys() != ann[2]["params"].keys(), "ranks 0 and 2 must hold different stages"
    ref = reference_llama(STEPS, GB)
    merged = _merged_params(ann)
    assert merged.keys() == ref[1].keys()
    for r in range(4):
        _assert_close({"losses": ann[r]["losses"], "params": ann[r]["params"]}, ref, f"pipeline rank {r}")
    _assert_identical(ann, hand, "annotated vs hand-written pipeline")

    assert [m["name"] for m in clf[0]["strategy"]["methods"]] == ["parallel_mode", "tensor_parallel", "fsdp"]
    assert clf[0]["mesh"]["tp"] == 2 and any(n.startswith("tensor_parallel: tp=2") for n in clf[0]["notes"])
    ref_clf = reference_classifier(STEPS, GB)
    for r in range(4):
        _assert_close(clf[r], ref_clf, f"tp+fsdp rank {r}")

    # nn.Sequential annotated with context managers: the split point is the first module of stage s1
    assert seq[0]["strategy"]["methods"][1] == {"name": "pipeline_parallel",
                                                "config": {"size": 2, "split_points": ["fc2"]}}
    ref_seq = reference_seqnet(STEPS, GB)
    assert _merged_params(seq).keys() == ref_seq[1].keys()
    for r in range(4):
        _assert_close(seq[r], ref_seq, f"sequential pipeline rank {r}")


def _llama_split_plan(split: str) -> dict[str, str]:
    """The built-in Llama plan's entries for the split modules of both layers (q/k/v and gate/up
    column-wise, o and down row-wise)."""
    mlp = {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
    attn = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
            "self_attn.o_proj": "rowwise"}
    per_layer = mlp if split == "mlp" else {**attn, **mlp}
    return {f"model.layers.{i}.{k}": v for i in range(2) for k, v in per_layer.items()}


@pytest.mark.distributed
def test_split_classifier_head_and_llama_on_2_ranks():
    """replicate(1) body + split(2) MLP/head on 2 ranks -> tp=2, dp=1; same as the hand-written plan.
    An HF Llama with every MLP, or every whole decoder layer, in a split(2) scope -> tp=2 with the built-in
    Llama plan restricted to those modules (heads divided correctly), trained like the 1-process reference."""
    hand = [("parallel_mode", {"dp": 1}), ("tensor_parallel", {"size": 2, "plan": CLASSIFIER_PLAN})]
    cfgs = [
        ("classifier", dict(annotated=True, steps=STEPS, global_batch=GB, micro=4)),
        ("classifier", dict(annotated=False, steps=STEPS, global_batch=GB, micro=4, strategy=hand)),
        ("llama", dict(annotated=True, split="mlp", steps=STEPS, global_batch=GB, micro=4)),
        ("llama", dict(annotated=True, split="layers", steps=STEPS, global_batch=GB, micro=4)),
    ]
    outs = run_ranks(run_many, 2, cfgs, timeout=600)
    ann, plain = [outs[0][0], outs[1][0]], [outs[0][1], outs[1][1]]
    assert ann[0]["strategy"] == {"version": 1, "methods": [
        {"name": "parallel_mode", "config": {"dp": 1}},
        {"name": "tensor_parallel", "config": {"size": 2, "plan": CLASSIFIER_PLAN}}]}
    assert ann[0]["mesh"]["tp"] == 2 and any(n.startswith("tensor_parallel: tp=2") for n in ann[0]["notes"])
    ref = reference_classifier(STEPS, GB)
    for r in range(2):
        _assert_close(ann[r], ref, f"tp rank {r}")
    _assert_identical(ann, plain, "annotated vs hand-written tensor parallel")

    ref_llama = reference_llama(STEPS, GB)
    for i, split in ((2, "mlp"), (3, "layers")):
        runs = [outs[0][i], outs[1][i]]
        assert runs[0]["strategy"]["methods"] == [
            {"name": "parallel_mode", "config": {"dp": 1}},
            {"name": "tensor_parallel", "config": {"size": 2, "plan": _llama_split_plan(split)}}], split
        assert runs[0]["mesh"]["tp"] == 2
        for r in range(2):
            assert runs[r]["params"].keys() == ref_llama[1].keys()
            _assert_close(runs[r], ref_llama, f"llama split={split} rank {r}")
