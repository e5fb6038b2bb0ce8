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
    ("train.steps=abc", "train.steps must be an integer"),
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
