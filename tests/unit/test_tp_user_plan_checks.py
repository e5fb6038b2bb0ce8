"""Tensor parallelism with a user plan, the single-process parts: which head-count attributes are divided,
the divisibility error, which regions the probe runs and how it records their inputs, its comparison and
tolerances. The distributed behaviour is in tests/distributed/test_tp_user_plan.py."""
import pytest
import torch
from torch import nn

from tests.distributed._tp_user_plan_workers import build, plan
from tests.distributed._tp_workers import tiny_bert
from tests.models import tiny_gpt2, tiny_llama
from torchloom import Strategy, StrategyError
from torchloom.parallel.tensor import auto_plan, check_divisible, custom_plan, resolve_plan
from torchloom.parallel.tensor.heads import HEAD_COUNT_ATTRS, describe
from torchloom.parallel.tensor.probe import _difference, _record_reference, probe_regions, tolerance


def _resolved(model, styles=None):
    return resolve_plan(model, custom_plan(model, styles) if styles else auto_plan(model))


def test_head_attrs_of_custom_attention_are_found_on_the_parent_of_colwise_projections():
    r = _resolved(build(), plan())
    assert [(h.module, h.attr, h.value) for h in r.head_attrs] == [("blocks.0.attn", "n_heads", 4),
                                                                   ("blocks.1.attn", "n_heads", 4)]
    assert r.head_attrs[0].children == ("blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v")
    assert describe(r.head_attrs, 2) == "blocks.*.attn.n_heads 4 -> 2 (2 modules)"
    fused = _resolved(build(fused=True), plan(fused=True))
    assert [h.children for h in fused.head_attrs][0] == ("blocks.0.attn.qkv",)
    # counts torchloom cannot see are not guessed at (the probe catches those)
    assert _resolved(build(heads_in="closure"), plan()).head_attrs == []
    assert _resolved(build(heads_in="tuple"), plan()).head_attrs == []


def test_head_attrs_skip_bools_rowwise_parents_and_known_family_attributes():
    model = build()
    model.blocks[0].attn.num_heads = True  # a flag, not a count
    model.blocks[0].mlp.n_heads = 4        # the MLP's fc1 is colwise: its parent counts too
    model.blocks[0].n_heads = 4            # the block is no direct parent of a sharded projection
    r = _resolved(model, plan())
    assert {(h.module, h.attr) for h in r.head_attrs} == {("blocks.0.attn", "n_heads"), ("blocks.1.attn", "n_heads"),
                                                         ("blocks.0.mlp", "n_heads")}
    # GPT-2 with a user plan: its family divides num_heads/split_size already; nothing is divided twice
    gpt2_styles = {"transformer.h.*.attn.c_attn": "fused_qkv", "transformer.h.*.attn.c_proj": "rowwise"}
    assert _resolved(tiny_gpt2(), gpt2_styles).head_attrs == []
    # built-in plans never use the name-based rule
    assert _resolved(tiny_llama()).head_attrs == [] and _resolved(tiny_gpt2()).head_attrs == []
    assert {"n_heads", "num_heads", "n_head", "num_attention_heads", "num_key_value_heads", "n_kv_heads",
            "head_count"} <= set(HEAD_COUNT_ATTRS)


def test_indivisible_head_count_is_an_error_before_any_change():
    model = build(dim=48, n_heads=3)
    r = _resolved(model, plan())
    with pytest.raises(StrategyError) as e:
        check_divisible(model, r, 2)
    msg = str(e.value)
    assert "blocks.0.attn.n_heads = 3 (Attention) is not divisible by tp=2" in msg
    assert "blocks.0.attn.q" in msg and "e.g. 3" in msg
    blocks_only = {k: v for k, v in plan().items() if k.startswith("blocks")}  # (the vocabulary is 128)
    check_divisible(model, _resolved(model, blocks_only), 3)  # 48 features and 3 heads split over 3 ranks
    assert model.blocks[0].attn.n_heads == 3


def test_probe_regions_are_one_attention_and_one_mlp_per_kind():
    assert probe_regions(build(), _resolved(build(), plan()).targets) == ["blocks.0.attn", "blocks.0.mlp"]
    llama = tiny_llama()
    assert probe_regions(llama, _resolved(llama).targets) == ["model.layers.0.self_attn", "model.layers.0.mlp"]
    bert = tiny_bert()  # query/key/value meet their row-wise partner in the attention; the FFN in the layer
    assert probe_regions(bert, _resolved(bert).targets) == ["bert.encoder.layer.0.attention",
                                                            "bert.encoder.layer.0"]
    # a column-wise layer without a row-wise partner below the root has no region of its own
    lone = nn.Sequential(nn.Linear(4, 8))
    assert probe_regions(lone, {"0": "colwise"}) == []


def test_probe_records_hf_arguments_and_random_hidden_states():
    llama = tiny_llama()
    r = _resolved(llama)
    before = torch.random.get_rng_state()
    probe = _record_reference(llama, r.targets, probe_regions(llama, r.targets))
    assert torch.equal(torch.random.get_rng_state(), before)  # the global RNG (init, dropout) untouched
    assert [c.region for c in probe.cases] == ["model.layers.0.self_attn", "model.layers.0.mlp"]
    attn = probe.cases[0]
    assert "position_embeddings" in attn.kwargs and attn.kwargs["hidden_states"].shape == (2, 8, 64)
    assert "token ids" in attn.source and probe.unverified == {}
    assert llama.training  # eval only during the probe
    custom = build()
    probe = _record_reference(custom, _resolved(custom, plan()).targets, ["blocks.0.attn", "blocks.0.mlp"])
    x = probe.cases[0].args[0]
    assert x.shape == (2, 8, 64) and "random hidden states" in probe.cases[0].source
    torch.testing.assert_close(probe.cases[0].expected[0], custom.blocks[0].attn(x), rtol=0, atol=0)


def test_probe_reports_regions_it_cannot_call():
    class NeedsMask(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)

        def forward(self, x, mask):
            return self.b(self.a(x)) * mask

    model = nn.Sequential(NeedsMask())
    probe = _record_reference(model, {"0.a": "colwise", "0.b": "rowwise"}, ["0"])
    assert probe.cases == [] and "mask" in probe.unverified["0"]


def test_probe_difference_and_tolerances():
    e = [torch.tensor([1.0, -2.0])]
    assert _difference([torch.tensor([1.0, -2.0 + 2e-7])], e)[0] < 2e-7
    assert _difference([torch.tensor([1.0, -1.0])], e) == (0.5, None)
    diff, why = _difference([torch.ones(3)], e)
    assert diff == float("inf") and "shape (3,) instead of (2,)" in why
    assert "1 tensors instead of 2" in _difference(e, e + e)[1]
    assert tolerance(torch.float32) == 1e-4 and tolerance(torch.bfloat16) > tolerance(torch.float16) > 1e-4


def test_verify_option_parses_and_rejects_non_bools():
    cfg = Strategy.parse([("tensor_parallel", {"size": 2, "verify": False})]).config("tensor_parallel")
    assert cfg.verify is False
    assert Strategy.parse([("tensor_parallel", {"size": 2})]).config("tensor_parallel").verify is True
    with pytest.raises(StrategyError, match="verify"):
        Strategy.parse([("tensor_parallel", {"size": 2, "verify": "no"})])
