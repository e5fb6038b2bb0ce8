"""`module_replace`: replaced models compute the same outputs and gradients, keep their Parameter objects
(ties, meta tensors) and state-dict keys; user pairs; errors.

Tolerances (fp32, CPU): fused RMSNorm is bit-identical to HF's; SDPA vs eager attention differs by
reduction order only, so outputs and gradients are compared with atol 1e-5 / rtol 1e-4 (measured max
differences are ~1e-6). bf16: one bf16 ulp (relative 2**-7), see docs/methods/module_replace.md.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchloom
from tests.models import tiny_llama, tiny_llama_config, token_batches
from torchloom import StrategyError
from torchloom.api import plan_dims
from torchloom.parallel.materialize import materialize_meta_model
from torchloom.replace import (FusedRMSNorm, register_module_replacement, replace_modules, replacement_names,
                               select_pairs, unregister_module_replacement)
from torchloom.replace.norms import hf_rms_rule

ATOL, RTOL = 1e-5, 1e-4


def _eager(model):
    model.set_attn_implementation("eager")
    return model


def _llama(**kw):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(attn_implementation="eager", **kw))


def _gpt2():
    from tests.models import tiny_gpt2

    return _eager(tiny_gpt2())


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return BertForMaskedLM(cfg)


def _t5():
    from tests.models import tiny_t5

    return _eager(tiny_t5())


def _inputs(name):
    ids = token_batches(3, seq=12)
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0  # padding exercises the attention mask path
    if name == "t5":
        return {"input_ids": ids, "attention_mask": mask, "labels": token_batches(3, seq=7, seed=5)}
    if name == "gpt2":
        return {"input_ids": ids, "labels": ids}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


@pytest.mark.parametrize("name,build,expected", [
    ("llama", _llama, {"sdpa": 1, "rms_norm": 5}),  # 2 layers x 2 norms + final norm
    ("gpt2", _gpt2, {"sdpa": 1}),
    ("bert", _bert, {"sdpa": 1}),
    ("t5", _t5, {"sdpa": 1, "rms_norm": 12}),  # T5LayerNorm: 2x2 encoder + 2x3 decoder + 2 final
])
def test_outputs_and_gradients_unchanged(name, build, expected):
    ref = build()
    model = copy.deepcopy(ref)
    keys = list(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    model, replaced = replace_modules(model, select_pairs())
    assert {k: len(v) for k, v in replaced.items()} == expected
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    assert model.config._attn_implementation == "sdpa"
    batch = _inputs(name)
    out_ref, out = ref(**batch), model(**batch)
    torch.testing.assert_close(out.logits, out_ref.logits, atol=ATOL, rtol=RTOL)
    out.loss.backward()
    out_ref.loss.backward()
    ref_grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n].grad, atol=ATOL, rtol=RTOL, msg=lambda m: f"{n}: {m}")


def test_tied_weights_and_meta_device():
    model = _llama(tie=True)
    emb = model.model.embed_tokens.weight
    norm_w = model.model.norm.weight
    model, _ = replace_modules(model, select_pairs())
    assert model.lm_head.weight is model.model.embed_tokens.weight is emb
    assert isinstance(model.model.norm, FusedRMSNorm) and model.model.norm.weight is norm_w
    assert model.model.norm.eps == model.config.rms_norm_eps

    with torch.device("meta"):
        meta = tiny_llama(tie=True)
    meta, replaced = replace_modules(meta, select_pairs(["rms_norm"]))
    assert len(replaced["rms_norm"]) == 5
    assert all(p.is_meta for p in meta.parameters())
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    materialize_meta_model(meta, torch.device("cpu"))  # HF init fills the replaced norms too
    assert torch.equal(meta.model.norm.weight, torch.ones(64))
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    assert torch.isfinite(meta(input_ids=token_batches(1)).logits).all()


def test_shared_module_replaced_everywhere():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(8)
    model = nn.Sequential(norm, nn.Linear(8, 8), norm)
    model, replaced = replace_modules(model, select_pairs(["rms_norm"]))
    assert len(replaced["rms_norm"]) == 1 and model[0] is model[2] and isinstance(model[0], FusedRMSNorm)


def test_rms_norm_matching_by_code():
    """Llama/T5 look-alikes are recognised; norms with other maths are not."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    assert hf_rms_rule(MistralRMSNorm) == hf_rms_rule(Qwen2RMSNorm) == "llama"
    assert hf_rms_rule(T5LayerNorm) == "t5"
    assert hf_rms_rule(GemmaRMSNorm) is None  # (1 + weight)
    assert hf_rms_rule(Olmo2RMSNorm) is None  # multiply in fp32, then cast
    model = nn.Sequential(GemmaRMSNorm(8), Olmo2RMSNorm(8), nn.LayerNorm(8))
    _, replaced = replace_modules(model, select_pairs())
    assert replaced == {}


def test_rms_norm_low_precision():
    """Same dtype bf16: within one bf16 ulp of HF (HF rounds twice, the fused kernel once). Mixed dtypes
    (bf16 input, fp32 weight, as under autocast): exactly HF's result and dtype, for both HF rules."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    torch.manual_seed(0)
    x = torch.randn(4, 16, 64)
    for cls in (LlamaRMSNorm, T5LayerNorm):
        hf = cls(64, eps=1e-6)
        with torch.no_grad():
            hf.weight.normal_()
        fused = FusedRMSNorm(hf.weight, hf.variance_epsilon, hf_rms_rule(cls))
        torch.testing.assert_close(fused(x), hf(x), atol=0, rtol=0)  # fp32: bit-identical
        xb = x.bfloat16()
        mixed_ref, mixed = hf(xb), fused(xb)
        assert mixed.dtype == mixed_ref.dtype and torch.equal(mixed, mixed_ref)
        hf_b = copy.deepcopy(hf).bfloat16()
        fused_b = FusedRMSNorm(hf_b.weight, hf_b.variance_epsilon, hf_rms_rule(cls))
        a, b = fused_b(xb).float(), hf_b(xb).float()
        assert ((a - b).abs() <= b.abs() * 2 ** -7 + 1e-6).all()


class SlowLinear(nn.Module):
    """A user layer with a faster equivalent (nn.Linear) for the registration test."""

    def __init__(self, i, o):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i))
        self.bias = nn.Parameter(torch.randn(o))

    def forward(self, x):
        return x @ self.weight.t() + self.bias


def _to_linear(old):
    new = nn.Linear(old.weight.shape[1], old.weight.shape[0], device="meta")
    new.weight, new.bias = old.weight, old.bias
    return new


def test_user_registered_pair_and_errors():
    register_module_replacement("SlowLinear", _to_linear, name="slow_linear")
    try:
        assert replacement_names()[:2] == ["sdpa", "rms_norm"] and "slow_linear" in replacement_names()
        torch.manual_seed(0)
        model = nn.Sequential(SlowLinear(4, 8), nn.ReLU(), SlowLinear(8, 2))
        ref = copy.deepcopy(model)
        model, replaced = replace_modules(model, select_pairs(exclude=["sdpa", "rms_norm"]))
        assert replaced == {"slow_linear": ["SlowLinear", "SlowLinear"]} and isinstance(model[0], nn.Linear)
        x = torch.randn(3, 4)
        torch.testing.assert_close(model(x), ref(x))
        with pytest.raises(StrategyError, match="already registered"):
            register_module_replacement(SlowLinear, _to_linear, name="slow_linear")
        register_module_replacement(SlowLinear, lambda m: nn.Linear(4, 8), name="slow_linear", override=True)
        with pytest.raises(StrategyError, match="without keeping its Parameter objects"):
            replace_modules(nn.Sequential(SlowLinear(4, 8)), select_pairs(["slow_linear"]))
    finally:
        unregister_module_replacement("slow_linear")
    with pytest.raises(StrategyError, match="Did you mean 'rms_norm'"):
        select_pairs(["rms_nrom"])
    with pytest.raises(StrategyError, match="unknown pair 'flash'"):
        plan_dims([("module_replace", {"exclude": ["flash"]})], 1)  # configure checks before any model change
    with pytest.raises(StrategyError, match="source must be a module class"):
        register_module_replacement(3, _to_linear)


def test_method_in_auto_accelerate_after_half():
    model = _llama()
    res = torchloom.auto_accelerate(model, torch.optim.SGD, loss_func=lambda b, o: o.loss, optim_args={"lr": 0.1},
                                    strategy=["module_replace", "half"], model_input_format="unpack_dict")
    norm = res.model.model.norm
    assert isinstance(norm, FusedRMSNorm) and norm.weight.dtype == torch.bfloat16
    assert "module_replace: sdpa x1 (LlamaForCausalLM); rms_norm x5 (LlamaRMSNorm)" in res.notes
    x = token_batches(2)
    assert torch.isfinite(res.train_step({"input_ids": x, "labels": x}))
