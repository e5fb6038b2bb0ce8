"""torchloom.parallel.fit: the tensor/pipeline checks the methods run at apply time, asked of a meta-device
model before any process group exists (what `loom train` uses before launching)."""
import pytest
import torch

from torchloom import StrategyError
from torchloom.parallel.fit import check_model_fits, fitting_degrees

from ..models import tiny_gpt2, tiny_llama


def meta(build, **kw):
    with torch.device("meta"):
        return build(**kw)


def test_tensor_parallel_degrees_follow_the_plan():
    """tiny Llama: 4 query heads, 2 kv heads, MLP 128, vocab 128 -> tp must divide 2."""
    model, strategy = meta(tiny_llama), ["tensor_parallel", "fsdp"]
    with pytest.raises(StrategyError, match=r"num_key_value_heads .* = 2 is not divisible by tp=4"):
        check_model_fits(model, strategy, tp=4)
    assert fitting_degrees(lambda d: check_model_fits(model, strategy, tp=d), range(1, 9)) == [1, 2]
    gpt2 = meta(tiny_gpt2)  # GPT-2's plan: 4 heads, fused c_attn, vocab 128
    assert fitting_degrees(lambda d: check_model_fits(gpt2, strategy, tp=d), range(1, 9)) == [1, 2, 4]


def test_a_user_plan_is_checked_module_by_module():
    plan = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    with pytest.raises(StrategyError, match="not divisible by tp=3"):
        check_model_fits(meta(tiny_llama), [("tensor_parallel", {"plan": plan}), "fsdp"], tp=3)


def test_pipeline_needs_a_unit_per_stage():
    """tiny Llama with 2 layers: embedding, 2 blocks, norm, head = 5 units."""
    model = meta(tiny_llama)
    with pytest.raises(StrategyError, match="6 stages .* only 5 units"):
        check_model_fits(model, ["pipeline_parallel"], pp=6)
    check_model_fits(model, ["pipeline_parallel"], pp=5)
    interleaved = [("pipeline_parallel", {"schedule": "interleaved_1f1b"})]  # 2 stages per rank
    assert fitting_degrees(lambda d: check_model_fits(model, interleaved, pp=d), range(1, 9)) == [1, 2]
    with pytest.raises(StrategyError, match="split point 'model.layers.7'"):
        check_model_fits(model, [("pipeline_parallel", {"split_points": ["model.layers.7"]})], pp=2)
    # balance='profile' needs real weights to measure; before launching the split is checked by parameters
    check_model_fits(model, [("pipeline_parallel", {"balance": "profile"})], pp=2)


def test_nothing_to_check_without_the_method_or_at_degree_one():
    model = meta(tiny_llama)
    check_model_fits(model, ["fsdp"], tp=4, pp=8)  # no tensor/pipeline method: their checks do not apply
    check_model_fits(model, ["tensor_parallel", "pipeline_parallel", "fsdp"], tp=1, pp=1)
