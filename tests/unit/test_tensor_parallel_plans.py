"""Tensor-parallel plans, style names, config parsing and the errors (single process, no process group).

The plans are checked entry by entry (they are the contract), against transformers' own
``config.base_model_tp_plan`` where it has one, and resolved against tiny real models so every pattern
matches a module. The distributed behaviour is in tests/distributed/test_tensor_parallel.py.
"""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.distributed._tp_workers import tiny_bert, tiny_mistral, tiny_mixtral
from tests.models import tiny_gpt2, tiny_llama, tiny_llama_config, tiny_t5
from torchloom import Strategy, StrategyError
from torchloom.api import plan_dims
from torchloom.methods.tensor_parallel import _check_patterns_matched, _check_sequence_plan
from torchloom.parallel.mesh import ParallelDims
from torchloom.parallel.tensor import STYLES, TPPlan, auto_plan, check_divisible, custom_plan, resolve_plan
from torchloom.parallel.tensor.apply import check_fsdp_compatible, name_matches

LLAMA_PLAN = {
    "model.embed_tokens": "vocab_embedding",
    "model.layers.*.self_attn": "sp_gather_input",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp": "sp_gather_input",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.layers.*.input_layernorm": "sequence_parallel",
    "model.layers.*.post_attention_layernorm": "sequence_parallel",
    "model.norm": "sequence_parallel",
    "lm_head": "lm_head",
}


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def _bert_classifier():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=128, num_labels=4))


# ----------------------------------------------------------------------------------------- plans
def test_llama_mistral_qwen2_plans_are_the_megatron_split():
    for build, family in ((tiny_llama, "llama"), (tiny_mistral, "mistral"), (_qwen2, "qwen2")):
        plan = auto_plan(build())
        assert plan.family == family
        assert plan.styles == LLAMA_PLAN
        assert plan.divisible == {"config.num_attention_heads (query heads)": 4,
                                  "config.num_key_value_heads (key/value heads)": 2, "config.vocab_size": 128,
                                  "config.intermediate_size": 128}
        assert plan.local_attrs == {}  # view(..., -1, head_dim): nothing to divide


def test_mixtral_plan_splits_experts_and_keeps_router_replicated():
    plan = auto_plan(tiny_mixtral())
    assert plan.styles["model.layers.*.mlp"] == "sp_gather_input_scatter_output"
    assert plan.styles["model.layers.*.mlp.experts"] == "moe_experts"
    assert not any(p.endswith("mlp.gate") for p in plan.styles)  # router: replicated
    assert {k: v for k, v in plan.styles.items() if "self_attn" in k} == \
        {k: v for k, v in LLAMA_PLAN.items() if "self_attn" in k}


@pytest.mark.parametrize("build", [tiny_llama, tiny_mistral, _qwen2, tiny_mixtral])
def test_plans_agree_with_transformers_base_model_tp_plan(build):
    """transformers' own plan names the same projections with the same column/row split (drift check)."""
    model = build()
    ours = auto_plan(model).styles
    hf = {"model." + k: v for k, v in model.config.base_model_tp_plan.items()}
    for pattern, style in hf.items():
        if style in ("colwise", "rowwise") and pattern in ours:
            assert ours[pattern] == style, pattern
    hf_linear = {p for p, s in hf.items()
                 if s in ("colwise", "rowwise") and not p.startswith("model.layers.*.mlp.experts")}
    assert hf_linear <= set(ours)


def test_gpt2_plan_fuses_qkv_divides_split_size_and_has_no_sp():
    plan = auto_plan(tiny_gpt2())
    assert plan.styles == {
        "transformer.wte": "vocab_embedding",
        "transformer.h.*.attn.c_attn": "fused_qkv",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "lm_head",
    }
    assert plan.local_attrs == {"transformer.h.*.attn": ("split_size", "num_heads")}
    assert plan.divisible["config.n_head (heads)"] == 4 and not plan.sequence_parallel


def test_bert_plans_masked_lm_head_and_classifier_replicated():
    mlm = auto_plan(tiny_bert())
    assert mlm.styles["cls.predictions.decoder"] == "lm_head"
    assert mlm.styles["bert.encoder.layer.*.attention.self.query"] == "colwise"
    assert mlm.styles["bert.encoder.layer.*.attention.output.dense"] == "rowwise"
    assert mlm.styles["bert.encoder.layer.*.output.dense"] == "rowwise"
    assert mlm.local_attrs == {"bert.encoder.layer.*.attention.self": ("num_attention_heads", "all_head_size")}
    cls = auto_plan(_bert_classifier())
    assert "lm_head" not in cls.styles.values() and not any("classifier" in k for k in cls.styles)


def test_base_model_without_head_uses_unprefixed_names():
    from transformers import LlamaModel

    plan = auto_plan(LlamaModel(tiny_llama_config()))
    assert plan.styles["embed_tokens"] == "vocab_embedding" and "lm_head" not in plan.styles


@pytest.mark.parametrize("build", [tiny_llama, tiny_mistral, _qwen2, tiny_mixtral, tiny_gpt2, tiny_bert,
                                   _bert_classifier])
def test_every_builtin_pattern_matches_and_tp2_divides(build):
    model = build()
    resolved = resolve_plan(model, auto_plan(model))
    assert resolved.matched == set(resolved.plan.styles)
    check_divisible(model, resolved, 2)
    n_layers = 2
    per_layer = {"colwise", "rowwise", "fused_qkv", "moe_experts"}
    assert sum(s in per_layer for s in resolved.targets.values()) >= 2 * n_layers


def test_patterns_match_one_dotted_component_per_star():
    assert name_matches("model.layers.0.mlp", "model.layers.*.mlp")
    assert not name_matches("model.layers.0.mlp.experts", "model.layers.*.mlp")
    assert not name_matches("bert.encoder.layer.0.attention.output.dense", "bert.encoder.layer.*.output.dense")


# ----------------------------------------------------------------------------------------- errors
def test_unknown_family_lists_supported_and_shows_a_plan():
    with pytest.raises(StrategyError, match=r"no built-in plan for T5ForConditionalGeneration.*model_type 't5'.*"
                                            r"bert, gpt2, llama, mistral, mixtral, qwen2.*'plan'"):
        auto_plan(tiny_t5())
    with pytest.raises(StrategyError, match="no built-in plan for Sequential"):
        auto_plan(nn.Sequential(nn.Linear(4, 4)))


def test_unknown_style_name_suggests_the_closest():
    with pytest.raises(StrategyError, match=r"unknown style 'colwsie'.*Did you mean 'colwise'.*Valid styles"):
        Strategy([("tensor_parallel", {"size": 2, "plan": {"layers.*.q": "colwsie"}})])
    with pytest.raises(StrategyError, match=r"unknown style 'vocab_embed'.*Did you mean 'vocab_embedding'"):
        custom_plan(tiny_llama(), {"model.embed_tokens": "vocab_embed"})


def test_config_parsing_and_degree():
    s = Strategy([("tensor_parallel", {"size": 2, "plan": {"model.layers.*.mlp.up_proj": "colwise"}})])
    assert s.config("tensor_parallel").plan == {"model.layers.*.mlp.up_proj": "colwise"}
    assert plan_dims([("tensor_parallel", {"size": 2})], 4) == ParallelDims(dp_replicate=2, tp=2)
    assert plan_dims([("parallel_mode", {"dp_shard": 2, "tp": 2}), "tensor_parallel", "fsdp"], 4).tp == 2
    assert plan_dims([("parallel_mode", {"tp": 2}), ("tensor_parallel", {"size": 2})], 2).tp == 2
    with pytest.raises(StrategyError, match=r"size=4 but parallel_mode sets tp=2"):
        plan_dims([("parallel_mode", {"tp": 2}), ("tensor_parallel", {"size": 4})], 4)
    with pytest.raises(StrategyError, match="tensor_parallel needs a degree"):
        plan_dims(["tensor_parallel"], 2)
    with pytest.raises(StrategyError, match="plan must be 'auto' or a mapping"):
        Strategy([("tensor_parallel", {"plan": "megatron"})])
    with pytest.raises(StrategyError, match="size must be >= 1"):
        Strategy([("tensor_parallel", {"size": 0})])
    with pytest.raises(StrategyError, match="expects"):
        Strategy([("tensor_parallel", {"size": "2"})])


def test_sequence_and_loss_parallel_require_tensor_parallel():
    for name in ("sequence_parallel", "loss_parallel"):
        with pytest.raises(StrategyError, match=f"method '{name}' requires 'tensor_parallel'"):
            Strategy([name])


def test_ddp_with_tensor_parallel_recommends_fsdp():
    with pytest.raises(StrategyError, match=r"'tensor_parallel' and 'ddp' cannot be combined.*Use fsdp"):
        Strategy([("parallel_mode", {"dp": 2, "tp": 2}), "tensor_parallel", "ddp"])
    with pytest.raises(StrategyError, match="'zero1' requires 'ddp'"):  # its implied ddp conflicts: not added
        Strategy([("tensor_parallel", {"size": 2}), "zero1"])


def _llama(**over):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2)
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **over}))


@pytest.mark.parametrize("cfg, tp, what", [
    (dict(), 3, r"num_attention_heads \(query heads\) = 4 is not divisible by tp=3"),
    (dict(), 4, r"num_key_value_heads \(key/value heads\) = 2 is not divisible by tp=4"),
    (dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=6), 4, r"num_attention_heads .* = 6"),
    (dict(vocab_size=129), 2, r"config.vocab_size = 129 is not divisible by tp=2.*divides it \(e.g. 3, 43\)"),
    (dict(num_key_value_heads=4, intermediate_size=130), 4, r"config.intermediate_size = 130 is not divisible"),
])
def test_dimensions_that_do_not_divide_name_the_field_and_the_fix(cfg, tp, what):
    model = _llama(**cfg)
    resolved = resolve_plan(model, auto_plan(model))
    with pytest.raises(StrategyError, match=what) as err:
        check_divisible(model, resolved, tp)
    assert "Use a tp degree that divides" in str(err.value)


def test_module_dimension_that_does_not_divide_names_the_module():
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(8, 6))
    resolved = resolve_plan(model, custom_plan(model, {"proj": "colwise"}))
    with pytest.raises(StrategyError, match=r"proj \('colwise'\) splits its output features = 6 over tp=4"):
        check_divisible(model, resolved, 4)
    gpt2 = tiny_gpt2()
    resolved = resolve_plan(gpt2, auto_plan(gpt2))
    with pytest.raises(StrategyError, match=r"n_head \(heads\) = 4 is not divisible by tp=8"):
        check_divisible(gpt2, resolved, 8)


def test_pattern_matching_nothing_is_an_error_naming_it():
    model = tiny_llama()
    plan = custom_plan(model, {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.attn.wq": "colwise"})
    ctx = SimpleNamespace(mesh=SimpleNamespace(dims=ParallelDims(tp=2)))
    with pytest.raises(StrategyError, match=r"pattern\(s\) \['model.layers.\*.attn.wq'\] match no module"):
        _check_patterns_matched(ctx, [model], [plan], [resolve_plan(model, plan)])


def test_overlapping_patterns_and_wrong_module_kinds_are_errors():
    model = tiny_llama()
    with pytest.raises(StrategyError, match=r"matches both plan patterns"):
        resolve_plan(model, custom_plan(model, {"model.layers.*.mlp.up_proj": "colwise",
                                                "model.layers.0.mlp.up_proj": "colwise"}))
    with pytest.raises(StrategyError, match=r"style 'colwise' cannot be applied to model.norm \(LlamaRMSNorm\)"):
        resolve_plan(model, custom_plan(model, {"model.norm": "colwise"}))
    with pytest.raises(StrategyError, match=r"'moe_experts' cannot be applied"):
        resolve_plan(model, custom_plan(model, {"model.layers.*.mlp": "moe_experts"}))


def test_sequence_parallel_needs_a_plan_that_has_it():
    with pytest.raises(StrategyError, match="built-in gpt2 plan has no sequence-parallel variant"):
        _check_sequence_plan([auto_plan(tiny_gpt2())])
    with pytest.raises(StrategyError, match="plan has no sequence-parallel entries"):
        _check_sequence_plan([TPPlan("custom", {"x": "colwise"})])
    _check_sequence_plan([auto_plan(tiny_llama())])


def test_fused_linear_with_fsdp_is_refused_conv1d_is_fine():
    model = nn.Sequential()
    model.add_module("qkv", nn.Linear(8, 24))
    with pytest.raises(StrategyError, match=r"qkv is an nn.Linear with 'fused_qkv'.*Drop fsdp"):
        check_fsdp_compatible(model, resolve_plan(model, custom_plan(model, {"qkv": "fused_qkv"})))
    gpt2 = tiny_gpt2()
    check_fsdp_compatible(gpt2, resolve_plan(gpt2, auto_plan(gpt2)))


def test_custom_plan_on_known_family_keeps_its_checks():
    plan = custom_plan(tiny_gpt2(), {"transformer.h.*.attn.c_attn": "fused_qkv"})
    assert plan.family == "custom" and plan.local_attrs == {"transformer.h.*.attn": ("split_size", "num_heads")}
    assert plan.divisible["config.n_head (heads)"] == 4


def test_every_style_is_documented():
    assert set(STYLES) == {"colwise", "rowwise", "colwise_gather", "lm_head", "vocab_embedding", "embedding_colwise",
                           "fused_qkv", "moe_experts", "sequence_parallel", "sp_gather_input",
                           "sp_gather_input_scatter_output"}
    assert all(len(s.doc) > 30 for s in STYLES.values())
