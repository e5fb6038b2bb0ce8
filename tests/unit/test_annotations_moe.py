"""EPL-style ``split`` around experts = expert parallel (issue [8] item 5): the strategy derived from the
annotations, single process. The 2-rank run against the reference is tests/distributed/test_annotations_moe.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torchloom
from tests.models import tiny_moe
from torchloom import Strategy, StrategyError
from torchloom.moe import MoE, MoEConfig
from torchloom.strategy.annotations import plan_from_annotations, strategy_from_annotations


def _split_experts(model, n=2):
    for layer in model.model.layers:
        torchloom.split(layer.mlp.experts, device_count=n)
    return model


class MoENet(nn.Module):
    """Embedding -> MoE block (torchloom.moe, with an nn.Linear-free router and SwiGLU shared experts) ->
    head; EPL's M6 form: ``replicate(N)`` around everything, ``split(N)`` around the MoE layer."""

    def __init__(self, n=2, experts=4, head_in_split=False, vocab=64, dim=16):
        super().__init__()
        with torchloom.replicate(n, name="body"):
            self.embed = nn.Embedding(vocab, dim)
            with torchloom.split(n, name="moe"):
                self.moe = MoE(MoEConfig(dim=dim, hidden_dim=24, num_experts=experts, num_shared_experts=1))
                if head_in_split:
                    self.head = nn.Linear(dim, vocab)
            if not head_in_split:
                self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(self.moe(self.embed(ids)))


def test_split_around_hf_experts_gives_expert_parallel_and_data_parallel_rest():
    for family, cls in (("mixtral", "MixtralExperts"), ("qwen2_moe", "Qwen2MoeExperts"),
                        ("qwen3_moe", "Qwen3MoeExperts")):
        model = _split_experts(tiny_moe(family))
        plan = plan_from_annotations(model)
        assert (plan.ep, plan.tp, plan.pp, plan.tp_plan) == (2, 1, 1, {}), family
        assert plan.experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert plan.experts_cls == [cls]
        s = strategy_from_annotations(model, 2)
        assert s == Strategy([("parallel_mode", {"dp": 2, "ep": 2}), ("expert_parallel", {"experts_cls": [cls]})])
        # dense layers see all dp ranks: dp = world / (pp x tp), ep carved out of it
        assert strategy_from_annotations(model, 4) == Strategy(
            [("parallel_mode", {"dp": 4, "ep": 2}), ("expert_parallel", {"experts_cls": [cls]})])


def test_split_around_the_moe_block_keeps_router_and_shared_experts_replicated():
    # Qwen2-MoE's block holds the router, the experts and a dense shared expert (gate/up/down Linears + gate):
    # the shape rule would split those tensor-parallel, but in the MoE block they stay data parallel (EPL M6)
    model = tiny_moe("qwen2_moe")
    for layer in model.model.layers:
        torchloom.split(layer.mlp, device_count=2)
    plan = plan_from_annotations(model)
    assert (plan.ep, plan.tp, plan.tp_plan) == (2, 1, {})
    assert strategy_from_annotations(model, 2) == Strategy(
        [("parallel_mode", {"dp": 2, "ep": 2}), ("expert_parallel", {"experts_cls": ["Qwen2MoeExperts"]})])


def test_context_manager_form_epl_m6_layout():
    net = MoENet()
    plan = plan_from_annotations(net)
    assert (plan.ep, plan.tp, plan.stages, plan.experts, plan.tp_plan) == (2, 1, ["body"], ["moe.experts"], {})
    assert strategy_from_annotations(net, 4) == Strategy(
        [("parallel_mode", {"dp": 4, "ep": 2}), ("expert_parallel", {"experts_cls": ["GroupedExperts"]})])


def test_scope_with_experts_and_dense_layers_outside_the_block():
    # the head is in the same split scope but outside the MoE block: tensor parallel (colwise_gather), experts
    # expert parallel; tp is a mesh factor, ep a divisor of dp, so 4 ranks give tp 2 x dp 2 with ep 2
    net = MoENet(head_in_split=True)
    plan = plan_from_annotations(net)
    assert (plan.ep, plan.tp, plan.tp_plan) == (2, 2, {"head": "colwise_gather"})
    s = strategy_from_annotations(net, 4)
    assert s == Strategy([("parallel_mode", {"dp": 2, "ep": 2}),
                          ("tensor_parallel", {"size": 2, "plan": {"head": "colwise_gather"}}),
                          ("expert_parallel", {"experts_cls": ["GroupedExperts"]}), "fsdp"])
    with pytest.raises(StrategyError, match=r"ep=2.*data-parallel degree is 1.*multiple of 4 processes.*"
                                            r"experts modules\s+alone"):
        strategy_from_annotations(net, 2)


def test_expert_and_tensor_parallel_scopes_with_different_degrees():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 16)
            with torchloom.split(4, name="experts"):
                self.moe = MoE(MoEConfig(dim=16, hidden_dim=8, num_experts=4))
            with torchloom.split(2, name="head"):
                self.head = nn.Linear(16, 64)

    plan = plan_from_annotations(Net())
    assert (plan.ep, plan.tp, plan.mixed, plan.tp_plan) == (4, 2, False, {"head": "colwise_gather"})
    s = strategy_from_annotations(Net(), 8)
    assert s.config("parallel_mode").dp == 4 and s.config("parallel_mode").ep == 4
    with pytest.raises(StrategyError, match=r"ep=4.*degree is 2.*multiple of 8 processes or lower the split's "
                                            r"device_count\.$"):
        strategy_from_annotations(Net(), 4)
    # a parallel_mode ep given in the base replaces the derived one
    assert strategy_from_annotations(Net(), 8, [("parallel_mode", {"ep": 2})]).config("parallel_mode").ep == 2


def test_whole_mixtral_decoder_layer_split():
    # attention: the built-in Mixtral plan (q/k/v colwise, o rowwise); the MoE block: experts over ep, router
    # replicated (before this change the experts got the tensor-parallel 'moe_experts' style instead)
    model = tiny_moe("mixtral")
    for layer in model.model.layers:
        torchloom.split(layer, device_count=2)
    plan = plan_from_annotations(model)
    assert plan.ep == 2 and plan.tp == 2
    assert plan.tp_plan == {f"model.layers.{i}.self_attn.{p}": ("rowwise" if p == "o_proj" else "colwise")
                            for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    s = strategy_from_annotations(model, 4)
    assert [e.name for e in s.entries if not e.implied] == ["parallel_mode", "tensor_parallel", "expert_parallel",
                                                            "fsdp"]
    assert s.config("parallel_mode").ep == 2 and s.config("parallel_mode").dp == 2


def test_merge_serialise_and_given_data_parallel_method(tmp_path):
    model = _split_experts(tiny_moe("mixtral"))
    s = strategy_from_annotations(model, 4, ["fsdp", ("amp", {"dtype": "bfloat16"})])
    assert s == Strategy([("parallel_mode", {"dp": 4, "ep": 2}), ("expert_parallel",
                                                                  {"experts_cls": ["MixtralExperts"]}),
                          "fsdp", ("amp", {"dtype": "bfloat16"})])
    s.save(tmp_path / "s.yaml")
    assert Strategy.load(tmp_path / "s.yaml") == s
    assert strategy_from_annotations(model, 4, s) == s  # a saved derived strategy merges to itself


def test_expert_split_errors():
    with pytest.raises(StrategyError, match=r"4 experts do not divide evenly over 3.*among \[2, 4\]"):
        plan_from_annotations(_split_experts(tiny_moe("mixtral"), 3))
    # ep carved out of dp: 4 experts over 4 ranks on 2 processes cannot be
    with pytest.raises(StrategyError, match=r"ep=4.*data-parallel degree is 2.*multiple of 4 processes"):
        strategy_from_annotations(_split_experts(tiny_moe("mixtral"), 4), 2)
    model = tiny_moe("mixtral")
    torchloom.split(model.model.layers[0].mlp.experts, device_count=2)
    torchloom.split(model.model.layers[1].mlp.experts, device_count=4)
    with pytest.raises(StrategyError, match="split scopes around experts have different device counts"):
        plan_from_annotations(model)
    model = tiny_moe("mixtral")
    torchloom.split(model.model.layers[0].mlp.experts, device_count=2)
    with pytest.raises(StrategyError, match=r"model.layers.1.mlp.experts of the same class is outside every split"):
        plan_from_annotations(model)
    with pytest.raises(StrategyError, match=r"replicate scope 'body' has device_count=3.*1 or 2 \(the split"):
        _bad_replicate()


def _bad_replicate():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            with torchloom.replicate(3, name="body"):
                self.embed = nn.Embedding(8, 16)
                with torchloom.split(2):
                    self.moe = MoE(MoEConfig(dim=16, hidden_dim=8, num_experts=2))

    plan_from_annotations(Net())


def test_annotations_leave_the_moe_model_unchanged():
    plain, annotated = tiny_moe("mixtral"), _split_experts(tiny_moe("mixtral"))
    ids = torch.randint(0, 128, (2, 8))
    torch.testing.assert_close(annotated(ids, labels=ids).loss, plain(ids, labels=ids).loss, rtol=0, atol=0)
    assert list(annotated.state_dict()) == list(plain.state_dict())
