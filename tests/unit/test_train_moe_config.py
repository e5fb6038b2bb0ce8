"""The MoE variant of the reference job, without processes: config keys and checks, the model it builds, the
loss that adds the model's load-balancing loss exactly once, and the expert metrics helpers."""
import pytest
import torch

from torchloom.train.config import ConfigError, TrainConfig
from torchloom.train.job import CausalLMLoss, build_model, causal_lm_loss
from torchloom.train.metrics import active_params, expert_shares

SMALL = {"vocab_size": 300, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "intermediate_size": 48, "seq_len": 16}


def moe_cfg(**over):
    data = {"model": {**SMALL, "moe": {"num_experts": 4}}}
    for k, v in over.items():
        section, key = k.split("__")
        data.setdefault(section, {})[key] = v
    return TrainConfig.from_dict(data)


def test_moe_keys_and_ep_add_expert_parallel():
    cfg = TrainConfig.load("default", ["model.moe.num_experts=8", "parallel.ep=2"])
    assert cfg.model.is_moe and cfg.model.moe.top_k == 2 and cfg.model.moe.aux_loss_weight == 0.01
    assert cfg.full_strategy() == [{"parallel_mode": {"ep": 2}}, "expert_parallel", "ddp"]
    assert TrainConfig.load("default").full_strategy() == ["ddp"]  # dense default unchanged
    assert not TrainConfig.load("default").model.is_moe


@pytest.mark.parametrize("overrides, words", [
    (["parallel.ep=2"], ["parallel.ep=2", "model.moe.num_experts=0"]),
    (["model.moe.num_experts=6", "parallel.ep=4"], ["parallel.ep=4", "num_experts=6", "Valid parallel.ep: 1, 2, 3, 6"]),
    (["model.moe.num_experts=4", "model.moe.top_k=5"], ["model.moe.top_k=5", "num_experts=4"]),
    (["model.moe.num_experts=4", "parallel.pp=2"], ["parallel.pp=2", "aux_loss"]),
    (["model.moe.num_experts=4", "model.moe.aux_loss_weight=-1"], ["aux_loss_weight=-1"]),
    (["model.moe.experts=4"], ["model.moe.experts", "num_experts"]),
])
def test_invalid_moe_config_is_named(overrides, words):
    with pytest.raises(ConfigError) as e:
        TrainConfig.load("default", overrides)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_ep_must_divide_the_data_parallel_degree():
    cfg = TrainConfig.load("smoke", ["model.moe.num_experts=8", "parallel.ep=4"])
    cfg.check_fits(4)  # dp = 4
    with pytest.raises(ConfigError) as e:
        cfg.check_fits(2)
    msg = str(e.value)
    assert "parallel.ep=4" in msg and "dp=2" in msg and "Valid parallel.ep for 2 processes" in msg and "1, 2." in msg
    with pytest.raises(ConfigError, match="dp=3"):
        TrainConfig.load("smoke", ["model.moe.num_experts=8", "parallel.ep=2"]).check_fits(3)


def test_moe_model_has_the_dense_sizes_with_fused_experts():
    cfg = moe_cfg()
    dense = build_model(TrainConfig.from_dict({"model": SMALL}).model, 300, 0, 0)
    moe = build_model(cfg.model, 300, 0, 0)
    assert type(dense).__name__ == "LlamaForCausalLM" and type(moe).__name__ == "MixtralForCausalLM"
    assert moe.config.output_router_logits and moe.config.num_local_experts == 4
    assert moe.config.router_aux_loss_coef == 0.01 and moe.config.num_experts_per_tok == 2
    experts = moe.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (4, 2 * 48, 32) and tuple(experts.down_proj.shape) == (4, 32, 48)
    n_dense, n_moe = (sum(p.numel() for p in m.parameters()) for m in (dense, moe))
    mlp = 3 * 32 * 48  # one SwiGLU MLP: gate, up, down
    assert n_moe - n_dense == 2 * (3 * mlp + 4 * 32)  # per layer: 3 more experts and a 4 x 32 router
    # a token passes through top_k = 2 of the 4 experts: the dense count plus one expert and the router per layer
    assert active_params(moe, 2) == n_dense + 2 * (mlp + 4 * 32)
    assert active_params(dense, 2) == n_dense


def test_aux_loss_reaches_the_gradient_once_with_the_model_weight():
    """The job's loss = summed CE + w * aux * tokens; after dividing by the tokens the gradient is that of
    mean CE + w * aux, and HF's own output.loss (which also adds w * aux) is not used on top."""
    cfg = moe_cfg()
    model = build_model(cfg.model, 300, 0, 0)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    loss_func = CausalLMLoss(0.5)  # a large weight: a missing or doubled aux term changes the gradient a lot

    out = model(**batch)
    s = loss_func(batch, out)
    (s.total / s.count).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = model(**batch)
    ref = causal_lm_loss(batch, out)
    (ref.total / ref.count + 0.5 * out.aux_loss).backward()
    router = "model.layers.0.mlp.gate.weight"
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)
    model.zero_grad()
    ref = causal_lm_loss(batch, model(**batch))
    (ref.total / ref.count).backward()  # without the aux term the router gradient differs by far more
    assert (got[router] - model.get_parameter(router).grad).abs().max() > 1e-4
    (ce, aux), = loss_func.take()
    assert ce == pytest.approx(float(ref.total / ref.count), rel=1e-6) and aux == pytest.approx(float(out.aux_loss))
    with torch.no_grad():  # held-out loss: the cross-entropy only, nothing recorded
        s = loss_func(batch, model(**batch))
    assert float(s.total / s.count) == pytest.approx(ce, rel=1e-6) and loss_func.take() == []


def test_expert_shares():
    assert expert_shares(torch.tensor([[2, 2, 2, 2], [1, 3, 0, 4]])) == (0.0, 0.5)
    assert expert_shares(torch.zeros(2, 4)) == (None, None)
