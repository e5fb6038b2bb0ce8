"""Regression tests for problems a new-user review found (each would otherwise train silently wrong or
fail with an unhelpful message)."""
import pytest
import torch

import torchloom
from torchloom import Strategy, StrategyError
from tests.models import tiny_llama_config


def test_meta_model_keeps_tied_weights_without_fsdp():
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        m = LlamaForCausalLM(tiny_llama_config(tie=True))
    res = torchloom.auto_accelerate(m, torch.optim.AdamW, loss_func=lambda b, o: o.loss, optim_args={"lr": 1e-3})
    assert res.model.lm_head.weight is res.model.model.embed_tokens.weight
    n_opt = sum(p.numel() for g in res.optimizer.param_groups for p in g["params"])
    assert n_opt == sum(p.numel() for p in res.model.parameters())  # the tied weight is counted once


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), "1.0", True])
def test_max_grad_norm_validated(bad):
    with pytest.raises((ValueError, TypeError), match="max_grad_norm"):
        torchloom.auto_accelerate(torch.nn.Linear(2, 2), torch.optim.SGD, optim_args={"lr": 0.1}, max_grad_norm=bad)


def test_optimizer_instance_and_seed_errors():
    m = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="not an optimizer instance"):
        torchloom.auto_accelerate(m, torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="seed must be an int"):
        torchloom.auto_accelerate(m, torch.optim.SGD, optim_args={"lr": 0.1}, seed=None)


def test_strategy_file_shape_errors(tmp_path):
    p = tmp_path / "a.yaml"
    p.write_text("version: 1\nmethods: fsdp\n")
    with pytest.raises(StrategyError, match="'methods' must be a list"):
        Strategy.load(p)
    p.write_text("version: '1'\nmethods: [fsdp]\n")
    with pytest.raises(StrategyError, match="'version' must be an integer"):
        Strategy.load(p)
    q = tmp_path / "S.YAML"
    q.write_text("version: 1\nmethods: [fsdp]\n")
    assert Strategy.parse(str(q)).names == ["fsdp"]


def test_input_format_loss_and_grad_errors():
    m = torch.nn.Linear(2, 1)
    x = torch.randn(4, 2)
    res = torchloom.auto_accelerate(m, torch.optim.SGD, optim_args={"lr": 0.1}, loss_func=lambda b, o: o.mean(),
                                    model_input_format="unpack_sequence")
    with pytest.raises(TypeError, match="unpack_sequence.*needs a list/tuple batch, got dict"):
        res.train_step({"x": x})
    res.train_step.model_input_format = None
    res.train_step.loss_func = lambda b, o: torch.tensor(1.0)
    with pytest.raises(RuntimeError, match="no grad_fn"):
        res.train_step(x)
    res.train_step.loss_func = None
    with pytest.raises(TypeError, match="no loss_func was given"):
        res.train_step(x)


def test_default_loss_is_the_model_output_loss():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(tiny_llama_config())
    res = torchloom.auto_accelerate(m, torch.optim.SGD, optim_args={"lr": 0.1}, model_input_format="unpack_dict")
    x = torch.randint(0, 128, (2, 8))
    assert torch.isfinite(res.train_step({"input_ids": x, "labels": x}))
    assert torch.isfinite(res.forward_loss({"input_ids": x, "labels": x}))


def test_odd_global_batch_message_says_dp():
    from torchloom.data import DataError, plan_batches

    with pytest.raises(DataError, match="no micro batch size can split it evenly"):
        plan_batches(7, 1, 2)
