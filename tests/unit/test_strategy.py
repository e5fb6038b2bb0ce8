"""Strategy parsing, validation error paths, registry and file round-trips (single process)."""
import json
import re
from dataclasses import dataclass

import pytest
import torch

import torchloom
from torchloom import Method, Stage, Strategy, StrategyError, register_method
from torchloom.parallel.mesh import ParallelDims
from torchloom.strategy import unregister_method


def test_names_pairs_and_aliases():
    s = Strategy(["zero2", ("amp_native", {"dtype": torch.float16}), "checkpoint"])
    assert s.names == ["fsdp", "amp", "checkpoint"]
    assert s.config("fsdp").reshard_after_forward is False
    assert s.config("amp").dtype == "float16"  # torch dtype stored by name
    assert Strategy(["zero3"]).config("fsdp").reshard_after_forward is True


def test_atorch_style_list():
    class LlamaDecoderLayer(torch.nn.Module):
        pass

    s = Strategy([
        ("parallel_mode", ([("data", 4)], None)),
        ("fsdp", {"atorch_wrap_cls": (LlamaDecoderLayer,)}),
        ("checkpoint", (LlamaDecoderLayer,)),
        "amp_native",
    ])
    assert s.config("parallel_mode").dp == 4
    assert s.config("fsdp").wrap_cls == ["LlamaDecoderLayer"]
    assert s.config("checkpoint").wrap_cls == ["LlamaDecoderLayer"]
    assert s.config("amp").dtype == "bfloat16"


def test_unknown_method_suggests_closest():
    with pytest.raises(StrategyError, match=r"unknown strategy method 'fsdpp'.*Did you mean 'fsdp'"):
        Strategy(["fsdpp"])
    with pytest.raises(StrategyError, match=r"Did you mean 'checkpoint'"):
        Strategy(["chekpoint"])


def test_unknown_config_key_lists_valid_keys():
    with pytest.raises(StrategyError, match=r"no config key 'reshard'.*reshard_after_forward.*Valid keys: .*wrap_cls"):
        Strategy([("fsdp", {"reshard": True})])


def test_bad_value_type():
    with pytest.raises(StrategyError, match=r"'bucket_cap_mb' expects float, got 'big'"):
        Strategy([("ddp", {"bucket_cap_mb": "big"})])
    with pytest.raises(StrategyError, match=r"'dtype' expects one of"):
        Strategy([("amp", {"dtype": "int4"})])
    with pytest.raises(StrategyError, match=r"the 'float8' method"):  # FP8 is its own method, named with the fix
        Strategy([("amp", {"dtype": "fp8"})])
    with pytest.raises(StrategyError, match=r"expects bool"):
        Strategy([("fsdp", {"cpu_offload": 1})])


@pytest.mark.parametrize("pair,words", [
    (["ddp", "fsdp"], ["'ddp'", "'fsdp'", "gradient synchronisation"]),
    (["amp", "half"], ["'amp'", "'half'", "master"]),
    (["zero1", "fsdp"], ["'zero1'", "'fsdp'", "shards optimizer state"]),
    (["zero2", "ddp"], ["'fsdp'", "'ddp'"]),
])
def test_conflicting_pairs_name_both_and_why(pair, words):
    with pytest.raises(StrategyError) as e:
        Strategy(pair)
    for w in words:
        assert w in str(e.value)


def test_duplicate_and_alias_duplicate():
    with pytest.raises(StrategyError, match="listed twice"):
        Strategy(["fsdp", "zero3"])


def test_implied_methods():
    s = Strategy(["zero1"])
    assert s.names == ["zero1", "ddp"]
    assert s.entries[1].implied
    assert s.to_dict()["methods"] == [{"name": "zero1"}]  # implied ones are not saved


def test_requires_missing():
    @register_method
    class NeedsFsdp(Method):
        name = "needs_fsdp_test"
        requires = ("fsdp|ddp",)

    try:
        with pytest.raises(StrategyError, match=r"requires 'fsdp' or 'ddp'"):
            Strategy(["needs_fsdp_test"])
        assert Strategy(["needs_fsdp_test", "ddp"]).names == ["needs_fsdp_test", "ddp"]
    finally:
        unregister_method("needs_fsdp_test")


def test_user_registered_method_with_config_and_order():
    @dataclass
    class Cfg:
        scale: float = 1.0

    calls = []

    @register_method
    class Scale(Method):
        name = "scale_init_test"
        Config = Cfg
        stage = Stage.CAST
        conflicts = {"half": "test conflict"}

        def apply(self, ctx):
            calls.append(self.config.scale)

    try:
        s = Strategy([("scale_init_test", {"scale": 2.0}), "ddp"])
        assert [type(m).name for m in s.ordered()] == ["scale_init_test", "ddp"]
        with pytest.raises(StrategyError, match="test conflict"):
            Strategy(["scale_init_test", "half"])
        with pytest.raises(StrategyError, match="already registered"):
            register_method(Scale)
        res = torchloom.auto_accelerate(torch.nn.Linear(2, 2), torch.optim.SGD, strategy=s, optim_args={"lr": 0.1})
        assert calls == [2.0]
        assert "ddp" in res.strategy  # explicit ddp stays, even at world size 1
    finally:
        unregister_method("scale_init_test")


def test_application_order_is_by_stage():
    s = Strategy(["fsdp", "compile", "checkpoint", "amp", "half"][:4])
    assert [type(m).name for m in s.ordered()] == ["amp", "checkpoint", "compile", "fsdp"]


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_file_round_trip(tmp_path, suffix):
    s = Strategy([("parallel_mode", {"dp_replicate": 2, "dp_shard": -1}), "zero2",
                  ("amp", {"dtype": "float16", "init_scale": 1024.0}), ("checkpoint", {"every_k": 2})])
    path = s.save(tmp_path / f"s{suffix}")
    loaded = Strategy.load(path)
    assert loaded == s
    assert Strategy.parse(str(path)) == s
    assert loaded.to_dict()["version"] == 1


def test_file_errors(tmp_path):
    with pytest.raises(StrategyError, match="does not exist"):
        Strategy.load(tmp_path / "missing.yaml")
    p = tmp_path / "s.pkl"
    p.write_bytes(b"\x80\x04")
    with pytest.raises(StrategyError, match="pickle files are never loaded"):
        Strategy.load(p)
    p = tmp_path / "v2.json"
    p.write_text(json.dumps({"version": 2, "methods": []}))
    with pytest.raises(StrategyError, match="version 2 is not supported"):
        Strategy.load(p)
    p = tmp_path / "bad.yaml"
    p.write_text("methods: [fsdp\n")
    with pytest.raises(StrategyError, match="cannot parse"):
        Strategy.load(p)
    p = tmp_path / "typo.yaml"
    p.write_text("version: 1\nmethods: [{name: fsdp, config: {wrap_clss: [A]}}]\n")
    with pytest.raises(StrategyError, match="Did you mean 'wrap_cls'"):
        Strategy.load(p)


def test_auto_is_reported_clearly():
    with pytest.raises(StrategyError, match="strategy='auto'"):
        Strategy.parse("auto")


@pytest.mark.parametrize("dims,world,expected", [
    (dict(dp_shard=-1), 4, dict(dp_shard=4)),
    (dict(dp_replicate=2, dp_shard=-1), 4, dict(dp_replicate=2, dp_shard=2)),
    (dict(dp_replicate=2, dp_shard=1), 2, dict(dp_replicate=2, dp_shard=1)),
    (dict(tp=2, pp=2, dp_shard=-1), 8, dict(tp=2, pp=2, dp_shard=2)),
])
def test_mesh_resolution(dims, world, expected):
    r = ParallelDims(**dims).resolve(world)
    for k, v in expected.items():
        assert getattr(r, k) == v


@pytest.mark.parametrize("dims,world,msg", [
    (dict(dp_shard=-1, tp=-1), 4, "only one mesh dimension may be -1"),
    (dict(dp_shard=3, tp=-1), 4, "not divisible"),
    (dict(dp_shard=2, tp=2), 2, "multiply to 4 but the world size is 2"),
    (dict(dp_shard=0), 1, "invalid"),
])
def test_mesh_errors(dims, world, msg):
    with pytest.raises(StrategyError, match=msg):
        ParallelDims(**dims).resolve(world)


def test_parallel_mode_dim_aliases_and_errors():
    assert Strategy([("parallel_mode", {"tensor": 2, "data": -1})]).config("parallel_mode").tp == 2
    with pytest.raises(StrategyError, match="unknown dimension 'tensr'.*Did you mean 'tensor'"):
        Strategy([("parallel_mode", ([("tensr", 2)], None))])


def test_single_process_auto_accelerate_and_plain_loop():
    """World size 1: no strategy, a plain user loop works on the returned model/optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ref.load_state_dict(model.state_dict())
    res = torchloom.auto_accelerate(model, torch.optim.SGD, optim_args={"lr": 0.1},
                                    loss_func=lambda b, o: torch.nn.functional.mse_loss(o, b[1]),
                                    model_input_format=None, prepare_input=lambda b, d: b)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(res.model(x), y)
        loss.backward()
        res.optimizer.step()
        res.optimizer.zero_grad()
        rl = torch.nn.functional.mse_loss(ref(x), y)
        rl.backward()
        ropt.step()
        ropt.zero_grad()
        assert loss.item() == rl.item()
    # train_step: model(batch) for model_input_format=None; a non-scalar loss is a clear TypeError
    res2 = torchloom.auto_accelerate(ref, torch.optim.SGD, optim_args={"lr": 0.1},
                                     loss_func=lambda b, o: torch.nn.functional.mse_loss(o, y))
    before = res2.train_step(x)
    assert res2.train_step(x) < before
    res2.train_step.loss_func = lambda b, o: o
    with pytest.raises(TypeError, match="scalar tensor"):
        res2.train_step(x)


def test_bad_arguments():
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="model_input_format='dict'"):
        torchloom.auto_accelerate(m, torch.optim.SGD, model_input_format="dict", optim_args={"lr": 1})
    with pytest.raises(TypeError, match="could not build the optimizer"):
        torchloom.auto_accelerate(m, torch.optim.SGD, optim_args={"lrr": 1})
    for p in m.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        torchloom.auto_accelerate(m, torch.optim.SGD, optim_args={"lr": 1})


def test_values_checked_when_parsed():
    with pytest.raises(StrategyError, match="every_k must be >= 1"):
        Strategy([("checkpoint", {"every_k": 0})])
    with pytest.raises(StrategyError, match="either 'dp'"):
        Strategy([("parallel_mode", {"dp": 2, "dp_shard": 2})])
    with pytest.raises(StrategyError, match="reduce_dtype"):
        Strategy([("fsdp", {"reduce_dtype": "fp32"})])


def test_unused_mesh_dimension_is_an_error():
    from torchloom.api import plan_dims

    # a 4-rank mesh, planned without launching 4 ranks: nothing parallelises tp
    with pytest.raises(StrategyError, match="tp=2 but no method in the strategy parallelises"):
        plan_dims([("parallel_mode", {"tp": 2}), "fsdp"], 4)
    assert plan_dims(["fsdp"], 4).dp_shard == 4
    assert plan_dims([("parallel_mode", {"dp_replicate": 2}), "fsdp"], 4).dp_shard == 2


def test_loss_func_kinds_cannot_mix_and_batch_errors():
    from torchloom import SumLoss
    from torchloom.data import DataError

    m = torch.nn.Linear(2, 1)
    x = torch.randn(4, 2)
    res = torchloom.auto_accelerate(m, torch.optim.SGD, optim_args={"lr": 0.1},
                                    loss_func=lambda b, o: SumLoss(o.sum(), 4))
    res.train_step(x)
    res.train_step.loss_func = lambda b, o: o.mean()
    with pytest.raises(TypeError, match="SumLoss every time or never"):
        res.train_step(x)
    with pytest.raises(DataError, match="global batch size must be a positive int, got 0"):
        torchloom.auto_accelerate(m, torch.optim.SGD, optim_args={"lr": 0.1}, dataloader_args={"batch_size": 0})


def test_train_step_state_round_trip_and_mid_window_error():
    res = torchloom.auto_accelerate(torch.nn.Linear(2, 1), torch.optim.SGD, optim_args={"lr": 0.1},
                                    loss_func=lambda b, o: o.mean(), dataloader_args={"batch_size": 4,
                                                                                      "micro_batch_size": 2})
    ts = res.train_step
    assert ts.grad_accum_steps == 2
    x = torch.randn(2, 2)
    for _ in range(4):
        ts(x)
    state = ts.state_dict()
    assert state["optimizer_steps"] == 2 and state["micro_step"] == 4
    ts.optimizer_steps = ts.micro_step = 0
    ts.load_state_dict(state)
    assert (ts.optimizer_steps, ts.micro_step) == (2, 4)
    ts(x)
    with pytest.raises(ValueError, match="inside an accumulation window"):
        ts.load_state_dict(ts.state_dict())


# ------------------------------------------------------------------------ every wrong input: StrategyError
def _pickle_bytes() -> bytes:
    import pickle

    return pickle.dumps({"version": 1, "methods": ["fsdp"]})


@pytest.mark.parametrize("value, words", [
    (5, ["int", "list of methods"]),
    (2.5, ["float", "list of methods"]),
    (b"fsdp", ["bytes", "list of methods"]),
    ({"fsdp", "amp"}, ["set", "order"]),
    (object(), ["object", "list of methods"]),
])
def test_wrong_type_names_the_type_and_the_accepted_forms(value, words):
    with pytest.raises(StrategyError) as e:
        Strategy.parse(value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("name", ["s.pkl", "strategies/ddp", "run.toml", "S.PICKLE"])
def test_path_like_string_with_unknown_suffix_is_a_file_error(name):
    """A string with a dot or a slash cannot be a method name: it is reported as a file, not as
    "unknown strategy method 's.pkl'"."""
    with pytest.raises(StrategyError) as e:
        Strategy.parse(name)
    msg = str(e.value)
    assert f"'{name}'" in msg and ".json, .yaml or .yml" in msg and "unknown strategy method" not in msg, msg


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_undecodable_file_content_names_the_file(tmp_path, suffix):
    """Pickle bytes in a .json/.yaml file: a StrategyError naming the file, not a bare UnicodeDecodeError."""
    p = tmp_path / f"s{suffix}"
    p.write_bytes(_pickle_bytes())
    with pytest.raises(StrategyError, match=rf"strategy file '{re.escape(str(p))}'.*UTF-8.*pickle"):
        Strategy.parse(str(p))
    with pytest.raises(StrategyError, match="pickle"):
        Strategy.load(p)


def test_unreadable_files_name_the_file(tmp_path):
    d = tmp_path / "dir.yaml"
    d.mkdir()
    with pytest.raises(StrategyError, match=rf"cannot read strategy file '{re.escape(str(d))}'"):
        Strategy.parse(d)
    with pytest.raises(StrategyError, match=rf"'{re.escape(str(tmp_path / 'nope.json'))}' does not exist"):
        Strategy.parse(str(tmp_path / "nope.json"))
    p = tmp_path / "bad_method.yaml"
    p.write_text("version: 1\nmethods: [fsdpp]\n")
    with pytest.raises(StrategyError, match=rf"strategy file '{re.escape(str(p))}'.*unknown strategy method 'fsdpp'"):
        Strategy.load(p)


@pytest.mark.parametrize("value", ["fsdp", {"version": 1, "methods": []}, 5, {"fsdp"}])
def test_strategy_constructor_takes_only_lists(value):
    with pytest.raises(StrategyError, match=r"Strategy\(methods\) takes a list of methods.*Strategy\.parse"):
        Strategy(value)


def test_a_registered_name_with_a_dot_is_still_a_method():
    @register_method
    class Dotted(Method):
        name = "my.method"
        stage = Stage.COMPILE

    try:
        assert Strategy.parse("my.method").names == ["my.method"]
    finally:
        unregister_method("my.method")
