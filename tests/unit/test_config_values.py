"""One value coercer for method configs (strategy files/lists) and the training config (`loom train` YAML
and --set): the same annotation reads the same value the same way in both, with errors naming the key."""
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import pytest

from torchloom import Strategy, StrategyError
from torchloom.strategy.config import build_config
from torchloom.train.config import ConfigError, TrainConfig, _merge


@dataclass
class Sample:
    flag: bool = False
    count: int = 1
    rate: float = 0.5
    name: str = "a"
    mode: Literal["x", "y"] = "x"
    limit: Optional[int] = None
    size_or_auto: float | str = "auto"
    names: list[str] = field(default_factory=list)
    pair: tuple[int, int] = (1, 2)
    table: dict[str, int] = field(default_factory=dict)
    anything: Any = None


NO = object()  # the value is rejected
# (key, value, expected value or NO = rejected). Each is read through both configs.
CASES = [
    ("flag", True, True), ("flag", 1, NO), ("flag", "yes", NO),
    ("count", 3, 3), ("count", 2.0, 2), ("count", 2.5, NO), ("count", True, NO), ("count", "3", NO),
    ("rate", 3, 3.0), ("rate", "1e-4", 1e-4), ("rate", "fast", NO), ("rate", False, NO),
    ("name", "b", "b"), ("name", 3, NO),
    ("mode", "y", "y"), ("mode", "z", NO),
    ("limit", None, None), ("limit", 4, 4), ("limit", "4", NO),
    ("size_or_auto", 2, 2.0), ("size_or_auto", "1e3", "1e3"), ("size_or_auto", "auto", "auto"),
    ("names", ["a", "b"], ["a", "b"]), ("names", ("a",), ["a"]), ("names", ["a", 3], NO), ("names", "a", NO),
    ("pair", [3, 4], (3, 4)), ("pair", [3], NO),
    ("table", {"a": 1}, {"a": 1}), ("table", {"a": "b"}, NO), ("table", [1], NO),
    ("anything", object, object),
]


def _via_strategy(key, value):
    return getattr(build_config("sample", Sample, {key: value}), key)


def _via_train(key, value):
    obj = Sample()
    _merge(obj, {key: value}, "sec.")
    return getattr(obj, key)


@pytest.mark.parametrize("key, value, expected", CASES)
def test_both_configs_read_a_value_alike(key, value, expected):
    if expected is NO:
        with pytest.raises(StrategyError, match=rf"method 'sample': config key '{key}'(\[[^\]]+\])? expects "):
            _via_strategy(key, value)
        with pytest.raises(ConfigError, match=rf"sec\.{key}(\[[^\]]+\])? expects "):
            _via_train(key, value)
    else:
        got = (_via_strategy(key, value), _via_train(key, value))
        assert got == (expected, expected) and type(got[0]) is type(expected) is type(got[1]), got


def test_errors_name_the_item():
    with pytest.raises(ConfigError, match=r"data\.eval_plays\[1\] expects str, got 3 \(int\)"):
        TrainConfig.load(None, ["data.eval_plays=[hamlet, 3]"])
    with pytest.raises(StrategyError, match=r"config key 'wrap_cls'\[0\] expects str, got 1 \(int\)"):
        Strategy([("checkpoint", {"wrap_cls": [1]})])


def test_yaml_exponents_without_a_dot_are_numbers_in_strategy_files_too(tmp_path):
    """YAML 1.1 reads `1e4` as a string; `loom train` accepted it for floats, strategy files did not."""
    p = tmp_path / "s.yaml"
    p.write_text("version: 1\nmethods: [{amp: {dtype: float16, init_scale: 1e4}}, {checkpoint: {every_k: 2.0}}]\n")
    s = Strategy.load(p)
    assert s.config("amp").init_scale == 1e4 and s.config("checkpoint").every_k == 2
    assert TrainConfig.load(None, ["train.lr=1e-4"]).train.lr == 1e-4
