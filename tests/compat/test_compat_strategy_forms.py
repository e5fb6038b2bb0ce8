"""torchloom.compat.atorch: every ATorch strategy form, the strategy files, the restricted unpickler and the
one-process behaviour (one CPU process, tiny models)."""
from __future__ import annotations

import json
import os
import pickle
import sys
import types
import warnings

import pytest
import torch
from torch import nn

import torchloom.compat.atorch as atorch
from torchloom.compat.atorch.auto.accelerate import (
    DeviceContext,
    adjust_strategy,
    auto_accelerate,
    get_strategy,
    save_strategy,
)
from torchloom.compat.atorch.auto.strategy import Strategy
from torchloom.compat.atorch.data import data_to_device
from torchloom.compat.atorch.plain_loop import AmpNativeOptimizer
from torchloom.compat.atorch.strategy_io import StrategyPickleError, restricted_loads
from torchloom.compat.atorch.strategy_map import translate
from torchloom.errors import StrategyError


class Block(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Toy(nn.Module):
    """ATorch's ToyModel shape: (input, label) batches, linear + repeated blocks."""

    def __init__(self, n=3):
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.blocks = nn.ModuleList([Block() for _ in range(n)])

    def forward(self, inputs):
        x = self.linear(inputs[0])
        for b in self.blocks:
            x = b(x)
        return x


class ToyData(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(4, generator=g)


def loss_func(inputs, output):
    return nn.functional.mse_loss(output, inputs[1])


def run_train(res, device="cpu"):
    n = 0
    for batch in res.dataloader:
        batch = res.prepare_input(batch, device)
        res.optim.zero_grad()
        out = res.model(batch)
        loss = res.loss_func(batch, out)
        loss.backward()
        res.optim.step()
        n += 1
    return n


def accelerate(strategy, **kw):
    torch.manual_seed(0)
    model = kw.pop("model", None) or Toy()
    return auto_accelerate(model, torch.optim.SGD, ToyData(), loss_func=loss_func, optim_args={"lr": 0.1},
                           dataloader_args={"batch_size": 4}, load_strategy=strategy, **kw)


# -- call form and result -----------------------------------------------------------------------------
def test_triples_train_and_return_atorch_result():
    status, res, best = accelerate(Strategy([("parallel_mode", ([("data", 1)], None), False)]))
    assert status is True
    assert set(res._fields) == {"model", "optim", "dataloader", "loss_func", "prepare_input", "lr_scheduler", "args"}
    assert isinstance(res.optim, torch.optim.SGD) and res.prepare_input is data_to_device
    assert run_train(res) == 16 // 4
    assert best == Strategy([("parallel_mode", ([("data", 1)], None), False)])


def test_positional_order_is_atorchs():
    import inspect

    names = list(inspect.signature(auto_accelerate).parameters)
    assert names == ["model", "optim_func", "dataset", "loss_func", "prepare_input", "model_input_format",
                     "optim_args", "optim_param_func", "dataloader_args", "distributed_sampler_cls", "excluded",
                     "included", "load_strategy", "lr_scheduler_cls", "lr_scheduler_args", "finetune_strategy",
                     "save_strategy_to_file", "kargs"]


def test_only_model_gives_no_optim_dataloader_or_loss():
    status, res, best = auto_accelerate(Toy(), load_strategy=["parallel_mode"])
    assert status and res.optim is None and res.dataloader is None and res.loss_func is None
    assert res.prepare_input is data_to_device
    assert best == Strategy([("parallel_mode", ([("data", 1)], None), False)])


def test_sample_batch_and_batch_size_accepted():
    sample = [torch.ones(2, 8), torch.ones(2, 4)]
    status, res, _ = auto_accelerate(Toy(), optim_func=torch.optim.SGD, optim_args={"lr": 0.1}, loss_func=loss_func,
                                     load_strategy=["parallel_mode"], sample_batch=sample, batch_size=2)
    assert status and res.dataloader is None and res.optim is not None and res.loss_func is not None


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="sampel_batch"):
        accelerate(["parallel_mode"], sampel_batch=1)


def test_distributed_sampler_cls_is_refused():
    with pytest.raises(ValueError, match="distributed_sampler_cls"):
        accelerate(["parallel_mode"], distributed_sampler_cls=torch.utils.data.DistributedSampler)


def test_optim_param_func_groups():
    def groups(model):
        return [{"params": [p for n, p in model.named_parameters() if "bias" not in n], "weight_decay": 0.01},
                {"params": [p for n, p in model.named_parameters() if "bias" in n], "weight_decay": 0.0}]

    status, res, _ = accelerate(["parallel_mode"], optim_param_func=groups)
    assert status and [g["weight_decay"] for g in res.optim.param_groups] == [0.01, 0.0]
    assert run_train(res) == 4

    def generator_groups(model):  # ATorch's docstring form: parameters() generators, a per-group lr
        return [{"params": model.linear.parameters()}, {"params": model.blocks.parameters(), "lr": 1e-3}]

    status, res, _ = accelerate(["parallel_mode"], optim_param_func=generator_groups)
    assert [len(g["params"]) for g in res.optim.param_groups] == [2, 6]
    assert [g["lr"] for g in res.optim.param_groups] == [0.1, 1e-3]


def test_lr_scheduler_built_on_the_optimizer():
    status, res, _ = accelerate(["parallel_mode"], lr_scheduler_cls=torch.optim.lr_scheduler.StepLR,
                                lr_scheduler_args={"step_size": 1, "gamma": 0.5})
    assert res.lr_scheduler.optimizer is res.optim


def test_batch_size_is_total_and_shuffle_off_in_one_process():
    status, res, _ = accelerate(["parallel_mode"])
    first = next(iter(res.dataloader))
    assert first[0].shape == (4, 8)
    assert torch.equal(first[0][0], ToyData()[0][0])  # not shuffled: ATorch's DataLoader default in one process


# -- strategy forms -----------------------------------------------------------------------------------
def test_list_of_names_and_pairs():
    status, s = get_strategy(["parallel_mode", ("amp_native", {"dtype": "bf16"}), ("tensor_parallel", None)])
    assert status and s.opt_list == [("parallel_mode", None, None), ("amp_native", {"dtype": "bf16"}, False),
                                     ("tensor_parallel", None, True)]


def test_parallel_mode_data_degree_adjusted_to_world():
    s = Strategy([("parallel_mode", ([("data", 8)], None), False)])
    status, res, best = accelerate(s)
    assert status and best[0] == ("parallel_mode", ([("data", 1)], None), False)
    ok, adjusted = adjust_strategy(Strategy([("parallel_mode", ([("model", 2), ("data", 2)], None), False)]),
                                   DeviceContext(2, 8))
    assert ok and adjusted[0][1] == ([("model", 2), ("data", 8)], None)
    ok, _ = adjust_strategy(Strategy([("parallel_mode", ([("model", 2), ("data", 2)], None), False)]),
                            DeviceContext(1, 1))
    assert ok is False  # 2-way model parallel cannot fit one process
    ok, s = adjust_strategy(get_strategy(["parallel_mode", "amp_native"])[1], DeviceContext(10, 2), True)
    assert ok and s[0][1] == ([("data", 20)], None)


def test_parallel_mode_custom_rank_order_refused():
    with pytest.raises(StrategyError, match="rank order"):
        translate(Strategy([("parallel_mode", ([("data", 2)], [1, 0]), False)]), 2)


def test_parallel_mode_translation():
    t = translate(Strategy([("parallel_mode", ([("tensor", 2), ("data", 4)], None), False)]), 8)
    assert t.methods == [("parallel_mode", {"tensor": 2, "data": 4})]


def test_half_string_config_casts_parameters_and_inputs():
    status, res, _ = accelerate([("half", "bf16")])
    assert res.model.linear.weight.dtype == torch.bfloat16
    assert run_train(res) == 4
    batch = res.prepare_input([torch.ones(2, 8), torch.ones(2, 4), torch.ones(2, dtype=torch.long)], "cpu")
    assert [b.dtype for b in batch] == [torch.bfloat16, torch.bfloat16, torch.long]
    with pytest.raises(StrategyError, match="'fp16' or 'bf16'"):
        accelerate([("half", "tf32")])


def test_amp_native_default_is_fp16_with_loss_scaling():
    status, res, _ = accelerate(["amp_native"])
    assert isinstance(res.optim, AmpNativeOptimizer)
    scale = res.optim.grad_scaler.scale
    assert scale == 2.0**16
    batch = res.prepare_input(next(iter(res.dataloader)), "cpu")
    res.optim.zero_grad()
    loss = res.loss_func(batch, res.model(batch))
    loss.backward()
    # the gradient carries the scale; the loss value does not
    g_scaled = res.model.linear.weight.grad.clone()
    plain = loss_func(batch, res.model(batch))
    (g_ref,) = torch.autograd.grad(plain, res.model.linear.weight)
    assert torch.allclose(loss.detach(), plain.detach())
    assert torch.allclose(g_scaled, g_ref * scale, rtol=1e-3, atol=1e-6 * scale)
    before = res.model.linear.weight.detach().clone()
    res.optim.step()
    assert not res.optim.step_was_skipped
    after = res.model.linear.weight.detach()
    expected = before - 0.1 * g_scaled / scale
    assert torch.allclose(after, expected, atol=1e-6)


def test_amp_native_fp16_overflow_skips_the_step():
    status, res, _ = accelerate([("amp_native", {"dtype": torch.float16})])
    batch = res.prepare_input(next(iter(res.dataloader)), "cpu")
    res.optim.zero_grad()
    res.loss_func(batch, res.model(batch)).backward()
    res.model.linear.weight.grad[0, 0] = float("inf")
    before = res.model.linear.weight.detach().clone()
    res.optim.step()
    assert res.optim.step_was_skipped and torch.equal(res.model.linear.weight.detach(), before)
    assert res.optim.grad_scaler.scale == 2.0**15


def test_amp_native_bf16_no_scaling_and_skip_if_nonfinite():
    status, res, _ = accelerate([("amp_native", {"dtype": "bf16"})])
    assert isinstance(res.optim, torch.optim.SGD)
    status, res, _ = accelerate([("amp_native", {"dtype": "bf16", "skip_if_nonfinite": True})])
    assert isinstance(res.optim, AmpNativeOptimizer)
    batch = res.prepare_input(next(iter(res.dataloader)), "cpu")
    res.optim.zero_grad()
    loss = res.loss_func(batch, res.model(batch))
    loss.backward()
    g = res.model.linear.weight.grad.clone()
    before = res.model.linear.weight.detach().clone()
    res.optim.step()
    assert torch.allclose(res.model.linear.weight.detach(), before - 0.1 * g)  # unscaled (scale 1)
    res.optim.zero_grad()
    res.loss_func(batch, res.model(batch)).backward()
    res.model.linear.weight.grad[0, 0] = float("nan")
    before = res.model.linear.weight.detach().clone()
    res.optim.step()
    assert res.optim.step_was_skipped and torch.equal(res.model.linear.weight.detach(), before)


def test_amp_native_enabled_false_is_off():
    status, res, _ = accelerate([("amp_native", {"enabled": False, "dtype": "fp16"})])
    assert isinstance(res.optim, torch.optim.SGD)
    assert any("enabled=False" in n for n in res.args["notes"])


def test_amp_native_unknown_option_refused():
    with pytest.raises(StrategyError, match="amp_native.*'bogus'"):
        accelerate([("amp_native", {"bogus": 1})])


def _checkpointed(model):
    return [type(m).__name__ for m in model.modules() if "forward" in vars(m)]


def test_checkpoint_string_class_and_tuple_configs():
    for config in ("Block", Block, (Block,), ("Block",), {"wrap_class": Block, "no_reentrant": True}):
        status, res, _ = accelerate([("checkpoint", config)])
        assert _checkpointed(res.model).count("Block") == 3, config
        assert run_train(res) == 4


def test_checkpoint_max_checkpoint_module_num():
    status, res, _ = accelerate([("checkpoint", {"wrap_class": (Block,), "max_checkpoint_module_num": 2})])
    assert _checkpointed(res.model).count("Block") == 2
    assert run_train(res) == 4


def test_checkpoint_unsupported_option_refused():
    with pytest.raises(StrategyError, match="selective_offload"):
        accelerate([("checkpoint", {"wrap_class": Block, "selective_offload": {"num_layers": 1}})])


def test_fsdp_options_mapped_or_noted():
    cfg = {"limit_all_gathers": True, "forward_prefetch": True, "use_orig_params": True, "sync_module_states": True,
           "atorch_wrap_cls": (Block,), "atorch_size_based_min_num_params": 100, "wrap_trainable_outmost": True,
           "cpu_offload": False}
    t = translate(Strategy([("fsdp", cfg, False)]), 2)
    assert t.methods == [("fsdp", {"sync_module_states": True, "cpu_offload": False, "wrap_cls": ["Block"]})]
    noted = " ".join(t.notes)
    for key in ("limit_all_gathers", "forward_prefetch", "use_orig_params", "atorch_size_based_min_num_params",
                "wrap_trainable_outmost"):
        assert key in noted
    assert translate(Strategy([("zero2", None, False)]), 2).methods == [("fsdp", {"reshard_after_forward": False})]
    assert translate(Strategy([("fsdp", {"sharding_strategy": "SHARD_GRAD_OP"}, False)]), 2).methods == [
        ("fsdp", {"reshard_after_forward": False})]


def test_fsdp_ignored_cls_and_unknown_options_refused():
    with pytest.raises(StrategyError, match="atorch_ignored_cls"):
        translate(Strategy([("fsdp", {"atorch_ignored_cls": (Block,)}, False)]), 2)
    with pytest.raises(StrategyError, match="use_local_sgd"):
        translate(Strategy([("fsdp", {"use_local_sgd": True}, False)]), 2)
    with pytest.raises(StrategyError, match="HYBRID_SHARD"):
        translate(Strategy([("fsdp", {"sharding_strategy": "HYBRID_SHARD"}, False)]), 2)
    with pytest.raises(StrategyError, match="use_ds_zero"):
        translate(Strategy([("zero1", {"use_ds_zero": True}, False)]), 2)


def test_zero_and_auto_ddp_translation():
    assert translate(Strategy([("zero1", None, False)]), 2).methods == ["zero1"]
    assert translate(Strategy([("auto_ddp", None, False)]), 2).methods == ["ddp"]


def test_unsupported_method_names_the_alternative():
    with pytest.raises(StrategyError, match="fp8.*amp_native"):
        accelerate(["fp8"])
    with pytest.raises(StrategyError, match="unknown ATorch method 'bogus'"):
        accelerate(["bogus"])


# -- one process ----------------------------------------------------------------------------------------
def test_one_process_drops_distributed_only_methods():
    strategy = Strategy([("parallel_mode", None, False), ("fsdp", {"atorch_wrap_cls": (Block,)}, False),
                         ("zero1", None, False), ("amp_native", {"dtype": "bf16"}, False)])
    status, res, best = accelerate(strategy)
    assert status and best.opt_names() == ["parallel_mode", "amp_native"]
    assert any("ignored in non-distributed case" in n and "fsdp" in n for n in res.args["notes"])
    assert run_train(res) == 4
    kept = Strategy([("fsdp", {"cpu_offload": True}, False), ("tensor_parallel", None, True)])
    assert kept.remove_distributed_method() == ["tensor_parallel"] and kept.opt_names() == ["fsdp"]


def test_init_distributed_one_process():
    assert atorch.init_distributed("bogus") is False
    if not torch.cuda.is_available():
        assert atorch.init_distributed("nccl") is False
    already = torch.distributed.is_initialized()
    assert atorch.init_distributed("gloo") is True
    assert atorch.rank() == 0 and atorch.world_size() == 1 and atorch.local_rank() == 0
    if not already:
        atorch.reset_distributed()
        assert atorch.rank() is None and atorch.world_size() is None


# -- strategy files and the restricted unpickler --------------------------------------------------------
def test_save_writes_json_and_reads_back_equal(tmp_path):
    s = Strategy([("parallel_mode", ([("data", 2)], None), False), ("amp_native", {"dtype": torch.bfloat16}, False),
                  ("checkpoint", (nn.TransformerEncoderLayer,), False), ("half", "bf16", False)])
    path = tmp_path / "strategy.st"
    save_strategy(s, path)
    json.loads(path.read_text())  # JSON, whatever the name
    status, loaded = get_strategy(str(path))
    assert status and loaded == s
    status, _ = get_strategy(str(tmp_path / "missing.st"))
    assert status is False


def test_save_strategy_to_file(tmp_path):
    path = tmp_path / "best"
    status, _, best = accelerate(Strategy([("parallel_mode", ([("data", 4)], None), False)]),
                                 save_strategy_to_file=str(path))
    assert get_strategy(str(path)) == (True, best)


def test_non_torch_class_reads_back_as_its_name(tmp_path):
    save_strategy(Strategy([("checkpoint", (Block,), False)]), tmp_path / "s")
    assert get_strategy(str(tmp_path / "s"))[1].opt_list == [("checkpoint", ("Block",), False)]


def test_our_strategy_pickle_loads():
    s = Strategy([("parallel_mode", ([("data", 2)], None), False), ("amp_native", {"dtype": torch.float16}, False),
                  ("checkpoint", (nn.Linear,), False)])
    assert get_strategy(pickle.dumps(s)) == (True, s)


@pytest.fixture
def fake_atorch_strategy_class(monkeypatch):
    """A class named ``atorch.auto.strategy.Strategy`` (ATorch's own, same attributes) in sys.modules."""
    mods = {name: types.ModuleType(name) for name in ("atorch", "atorch.auto", "atorch.auto.strategy")}

    class ATorchStrategy:
        def __init__(self, opt_list=None):
            self.opt_list = [] if opt_list is None else opt_list

    ATorchStrategy.__module__ = "atorch.auto.strategy"
    ATorchStrategy.__qualname__ = ATorchStrategy.__name__ = "Strategy"
    mods["atorch.auto.strategy"].Strategy = ATorchStrategy
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return ATorchStrategy


def test_atorch_strategy_pickle_loads_as_ours(fake_atorch_strategy_class, tmp_path):
    opt_list = [("parallel_mode", ([("data", 2)], None), False), ("amp_native", {"dtype": torch.bfloat16}, False),
                ("checkpoint", {"wrap_class": (nn.TransformerDecoderLayer,), "no_reentrant": True}, False),
                ("fsdp", {"sync_module_states": True, "limit_all_gathers": True}, False)]
    for protocol in (2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL):
        data = pickle.dumps(fake_atorch_strategy_class(opt_list), protocol=protocol)
        status, s = get_strategy(data)
        assert status and type(s) is Strategy and s.opt_list == opt_list
    path = tmp_path / "atorch_strategy"  # ATorch's save_strategy: pickle bytes in a file
    path.write_bytes(data)
    status, s = get_strategy(str(path))
    assert status and s.opt_list == opt_list


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickle_with_another_class_is_refused(fake_atorch_strategy_class, tmp_path):
    data = pickle.dumps(fake_atorch_strategy_class([("half", _Evil(), False)]))
    with pytest.raises(StrategyPickleError, match=r"refused.*(posix|os|nt)\.system"):
        restricted_loads(data)
    path = tmp_path / "evil"
    path.write_bytes(data)
    status, s = get_strategy(str(path))  # ATorch's get_strategy convention: (False, None), reason logged
    assert status is False and s is None
    with pytest.raises(StrategyPickleError, match="_Evil|Block"):
        restricted_loads(pickle.dumps(fake_atorch_strategy_class([("checkpoint", (Block,), False)])))
    with pytest.raises(StrategyError, match="not an ATorch Strategy"):
        restricted_loads(pickle.dumps({"opt_list": []}))


def test_strategy_methods():
    s = Strategy()
    s.add_opt(("amp_native", None, None))
    s.add_opt(("tensor_parallel", None, None))
    s.add_opt(("parallel_mode", ([("data", 2)], None), None))
    s.set_tunable_value()
    assert s.opt_list == [("amp_native", None, False), ("tensor_parallel", None, True),
                          ("parallel_mode", ([("data", 2)], None), False)]
    assert s.is_tunable() and s.get_parallel_mode() == (True, ([("data", 2)], None))
    assert len(s.convert_strategy_to_easydl_format()) == 3
    assert s.remove_opt("tensor_parallel") and s.opt_names() == ["amp_native", "parallel_mode"]
    assert [name for name, _, _ in s] == ["amp_native", "parallel_mode"]
    assert "parallel_mode : [('data', 2)]" in str(s)


def test_checkpoint_class_absent_from_model_is_ignored_with_a_warning():
    with pytest.warns(UserWarning, match="do not occur in Toy; ignored as ATorch does: nothing is checkpointed"):
        status, res, _ = accelerate([("checkpoint", "ToyCustomModule")])
    assert status and _checkpointed(res.model) == []
    assert run_train(res) == 4


def test_finetune_strategy_resets_configs_to_defaults():
    s = Strategy([("parallel_mode", ([("data", 1)], None), False), ("amp_native", {"dtype": "bf16"}, False)])
    status, res, best = accelerate(s, finetune_strategy=True)
    assert best.opt_list == [("parallel_mode", ([("data", 1)], None), False), ("amp_native", None, False)]
    assert isinstance(res.optim, AmpNativeOptimizer)  # the default amp_native: fp16 with loss scaling
    assert any("finetune_strategy" in n for n in res.args["notes"])
