"""`TrainConfig`: YAML files and --set overrides over the defaults, unknown keys and bad values rejected."""
import dataclasses

import pytest
import yaml

from torchloom.train.config import ConfigError, TrainConfig, packaged_configs, parse_override, read_yaml, resolve_config_path


def test_defaults_equal_packaged_default_yaml():
    # the YAML shipped as `default` is the source users read: it must say exactly what the code does
    assert TrainConfig.load("default") == TrainConfig()
    raw = read_yaml(resolve_config_path("default"))
    assert set(raw) == {f.name for f in dataclasses.fields(TrainConfig)}


def test_packaged_configs_resolve():
    assert {"default", "smoke"} <= set(packaged_configs())
    smoke = TrainConfig.load("smoke.yaml")
    assert smoke.model.hidden_size < TrainConfig().model.hidden_size
    assert smoke.train.steps <= 50


def test_yaml_overrides_only_what_it_names(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"model": {"hidden_size": 128, "num_heads": 2, "num_kv_heads": 1},
                                 "train": {"steps": 7, "lr": "3e-4"}, "strategy": ["fsdp"],
                                 "output_dir": "x/y"}))
    cfg = TrainConfig.load(p)
    d = TrainConfig()
    assert (cfg.model.hidden_size, cfg.model.num_heads, cfg.model.num_kv_heads) == (128, 2, 1)
    assert cfg.train.steps == 7 and cfg.train.lr == pytest.approx(3e-4)  # YAML 1.1 reads 3e-4 as a string
    assert cfg.strategy == ["fsdp"] and cfg.output_dir == "x/y"
    assert cfg.model.num_layers == d.model.num_layers and cfg.train.warmup == d.train.warmup
    assert cfg.eval == d.eval and cfg.checkpoint == d.checkpoint


def test_set_overrides_after_the_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  steps: 7\n")
    cfg = TrainConfig.load(p, ["train.steps=9", "strategy=[fsdp, amp]", "eval.batches=null",
                               "sample.prompt=ROMEO.", "checkpoint.keep_last=3"], output_dir="/tmp/o")
    assert cfg.train.steps == 9 and cfg.strategy == ["fsdp", "amp"] and cfg.eval.batches is None
    assert cfg.sample.prompt == "ROMEO." and cfg.checkpoint.keep_last == 3 and cfg.output_dir == "/tmp/o"
    assert parse_override("train.micro_batch=4") == ("train.micro_batch", 4)
    assert TrainConfig.load(None, ["train.lr=1e-3"]).train.lr == pytest.approx(1e-3)


@pytest.mark.parametrize("data,key", [
    ({"modle": {}}, "modle"),
    ({"model": {"hiden_size": 3}}, "model.hiden_size"),
    ({"train": {"stepz": 3}}, "train.stepz"),
])
def test_unknown_key_names_key_and_valid_keys(data, key):
    with pytest.raises(ConfigError) as ei:
        TrainConfig.from_dict(data)
    msg = str(ei.value)
    assert f"'{key}'" in msg and "Valid keys" in msg
    if key == "model.hiden_size":
        assert "hidden_size" in msg and "num_layers" in msg  # did-you-mean and the valid list


def test_unknown_key_from_set_and_file(tmp_path):
    with pytest.raises(ConfigError, match="'train.bogus'"):
        TrainConfig.load(None, ["train.bogus=1"])
    p = tmp_path / "c.yaml"
    p.write_text("eval:\n  every: 5\n")
    with pytest.raises(ConfigError, match=r"'eval\.every'.*interval"):
        TrainConfig.load(p)


@pytest.mark.parametrize("override,match", [
    ("train.steps=abc", "train.steps expects int"),
    ("train.steps=0", "train.steps=0 must be positive"),
    ("model.num_heads=3", "not divisible"),
    ("log.progress=3", "true or false"),
    ("strategy=[nosuchmethod]", "strategy"),
    ("data.eval_plays=[]", "eval_plays"),
    ("train", "section.key=value"),
])
def test_bad_values(override, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.load(None, [override])


def test_missing_file_lists_packaged_configs(tmp_path):
    with pytest.raises(ConfigError, match="smoke"):
        TrainConfig.load(tmp_path / "nope.yaml")


def test_not_a_mapping(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        TrainConfig.load(p)


def test_parallel_section_expands_to_methods():
    """`parallel: {tp: 2, pp: 2}` is a shorthand for parallel_mode + the tensor/pipeline methods."""
    cfg = TrainConfig.load(None, ["parallel.dp_replicate=2", "strategy=[fsdp]"])
    assert cfg.full_strategy() == [{"parallel_mode": {"dp_replicate": 2}}, "fsdp"]
    assert TrainConfig().full_strategy() == ["ddp"]  # nothing set: the strategy as written


@pytest.mark.parametrize("overrides, match", [
    (["parallel.tp=0"], "parallel.tp=0 must be a positive integer"),
    (["parallel.pp_microbatches=0"], "pp_microbatches"),
    (["parallel.sequence_parallel=true"], "set parallel.tp > 1"),
    (["parallel.dp_shard=2", "strategy=[{parallel_mode: {dp_shard: 2}}]"], "keep one of them"),
])
def test_parallel_section_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.load(None, overrides)


def test_tensor_parallel_swaps_ddp_for_replicating_fsdp():
    """DDP cannot hold DTensor parameters: with tp > 1 the default `[ddp]` becomes fsdp over the replicate
    dimension (dp_shard 1), i.e. DDP's semantics; pipeline parallelism alone keeps ddp."""
    from torchloom.api import plan_dims

    cfg = TrainConfig.load(None, ["parallel.tp=2", "parallel.pp=2"])
    assert cfg.ddp_swapped_for_fsdp()
    assert cfg.full_strategy() == [{"parallel_mode": {"pp": 2, "tp": 2, "dp_shard": 1}},
                                   {"pipeline_parallel": {"schedule": "1f1b", "num_microbatches": None}},
                                   "tensor_parallel", {"fsdp": {"reshard_after_forward": False}}]
    dims = plan_dims(cfg.full_strategy(), 8)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 2, 1, 2)

    pp_only = TrainConfig.load(None, ["parallel.pp=2"])
    assert not pp_only.ddp_swapped_for_fsdp() and pp_only.full_strategy()[-1] == "ddp"
    sharded = TrainConfig.load(None, ["parallel.tp=2", "parallel.dp_shard=2"])  # an explicit dp_shard is kept
    assert sharded.full_strategy() == [{"parallel_mode": {"dp_shard": 2, "tp": 2}}, "tensor_parallel",
                                       {"fsdp": {"reshard_after_forward": False}}]
    with pytest.raises(ConfigError, match="DistributedDataParallel cannot hold"):  # ddp with options: not swapped
        TrainConfig.load(None, ["parallel.tp=2", "strategy=[{ddp: {bucket_cap_mb: 10}}]"])


def test_flash_checkpoints_with_tensor_parallel_are_accepted():
    # flash checkpoints rebuild DTensors on the world mesh (tests/distributed/test_flash_checkpoint.py)
    cfg = TrainConfig.load(None, ["parallel.tp=2", "checkpoint.blocking=false"])
    assert cfg.checkpoint.blocking is False and cfg.parallel.tp == 2
    TrainConfig.load(None, ["parallel.pp=2", "checkpoint.blocking=false"])


@pytest.mark.parametrize("overrides, world, match", [
    (["parallel.tp=2", "parallel.pp=2"], 2, "world size 2 is not divisible"),
    (["parallel.tp=2", "parallel.pp=2", "train.global_batch=6"], 8, "does not split into 2 pipeline micro-batches"),
    (["parallel.pp=2", "parallel.pp_microbatches=4", "train.global_batch=4"], 4, "into 4 pipeline micro-batches"),
    (["train.global_batch=7"], 2, "not divisible by the data-parallel size 2"),
])
def test_check_fits_rejects_what_the_world_cannot_run(overrides, world, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.load(None, overrides).check_fits(world)


def test_check_fits_accepts_the_documented_layouts():
    TrainConfig.load(None, ["parallel.tp=2", "parallel.pp=2"]).check_fits(4)  # global 16 -> micro 16 / 2 mb
    TrainConfig.load("smoke", ["parallel.tp=2", "parallel.pp=2"]).check_fits(4)  # micro 2 -> 2 x 1
    TrainConfig().check_fits(2)


def test_optimizer_choice():
    """train.optimizer selects AdamW, AGD or WSAM(AdamW) with the same decay split (no decay on 1-D)."""
    import torch

    from torchloom.optim import AGD, WSAM
    from torchloom.train.job import adamw

    params = [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))]
    kw = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    agd = adamw(params, optimizer="agd", agd_delta=1e-14, **kw)
    assert isinstance(agd, AGD) and agd.param_groups[0]["delta"] == 1e-14
    assert [g["weight_decay"] for g in agd.param_groups] == [0.1, 0.0]
    wsam = adamw(params, optimizer="wsam", wsam_rho=0.1, wsam_gamma=0.8, **kw)
    assert isinstance(wsam, WSAM) and wsam.param_groups[0]["rho"] == 0.1
    assert [g["weight_decay"] for g in wsam.param_groups] == [0.1, 0.0]
    with pytest.raises(ConfigError, match="train.optimizer='sgd' is not one of"):
        TrainConfig.load(None, ["train.optimizer=sgd"])


def test_ddp_under_tensor_parallel_is_the_same_swap_as_auto_accelerate():
    """One rule for "DDP semantics under tensor parallelism" (torchloom.strategy.data_parallel): loom train's
    swap of a plain ddp and auto_accelerate's default data-parallel method are the same replicating,
    non-resharding fsdp. Before, loom train used a resharding fsdp, which zero-bubble pipelines refuse
    (the user had written ddp and was told to use fsdp with reshard_after_forward=False)."""
    from torchloom import Strategy
    from torchloom.strategy.data_parallel import replicating_data_parallel

    cfg = TrainConfig.load(None, ["parallel.tp=2"])
    swapped = Strategy.parse(cfg.full_strategy()).config("fsdp")
    name, spec = replicating_data_parallel(tensor_parallel=True)
    assert name == "fsdp" and Strategy.parse([spec]).config("fsdp") == swapped
    assert swapped.reshard_after_forward is False
    assert replicating_data_parallel(tensor_parallel=False) == ("ddp", "ddp")
    TrainConfig.load(None, ["parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule=zero_bubble"]).check_fits(4)
