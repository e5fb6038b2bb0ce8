"""The `loom config` file: lookup order, validation on write and read, and what auto_accelerate(strategy=None)
takes from it (one process; the rank agreement check is in tests/distributed/test_notebook_launcher.py)."""
import dataclasses

import pytest
import torch

from torchloom import cli
from torchloom.elastic.launcher import LaunchOptions
from torchloom.strategy import Strategy
from torchloom.strategy import config_file as cf


@pytest.fixture
def home(tmp_path, monkeypatch):
    """No config anywhere: an empty working directory and cache, no TORCHLOOM_CONFIG_FILE."""
    for env in (cf.ENV_VAR, "TORCHLOOM_CACHE_DIR", "TORCHLOOM_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return tmp_path


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


GOOD = "config_version: 1\nstrategy: [fsdp]\nlaunch: {nproc: 2}\n"


def test_lookup_order(home, monkeypatch):
    assert cf.locate() is None and cf.find() is None
    user = write(home / "home/.cache/torchloom/default_config.yaml", GOOD)
    assert cf.locate() == (user, "user default")
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "xdg"))  # XDG moves the user default
    assert cf.locate() is None
    xdg = write(home / "xdg/torchloom/default_config.yaml", GOOD)
    assert cf.locate() == (xdg, "user default")
    monkeypatch.setenv("TORCHLOOM_CACHE", str(home / "tc"))  # TORCHLOOM_CACHE(_DIR) win over XDG, as for caches
    assert cf.default_path() == home / "tc/default_config.yaml"
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(home / "tcd"))
    assert cf.default_path() == home / "tcd/default_config.yaml"
    monkeypatch.delenv("TORCHLOOM_CACHE_DIR")
    monkeypatch.delenv("TORCHLOOM_CACHE")
    project = write(home / "work/torchloom.yaml", GOOD)  # the working directory's file wins over the user default
    assert cf.locate() == (project, "working directory")
    env = write(home / "elsewhere.yaml", GOOD)
    monkeypatch.setenv(cf.ENV_VAR, str(env))  # the variable wins over both
    assert cf.locate() == (env, "$TORCHLOOM_CONFIG_FILE")
    assert cf.locate(xdg) == (xdg, "--file")  # an explicit path wins over everything
    for off in ("none", "None", " NONE "):
        monkeypatch.setenv(cf.ENV_VAR, off)
        assert cf.locate() is None
    monkeypatch.setenv(cf.ENV_VAR, "")  # empty = unset
    assert cf.locate() == (project, "working directory")


def test_named_files_must_exist(home, monkeypatch):
    monkeypatch.setenv(cf.ENV_VAR, str(home / "missing.yaml"))
    with pytest.raises(cf.ConfigFileError, match=r"missing.yaml \(TORCHLOOM_CONFIG_FILE=.*\) does not exist"):
        cf.locate()
    with pytest.raises(cf.ConfigFileError, match="is a directory"):
        cf.locate(home)
    with pytest.raises(cf.ConfigFileError, match="no file to write"):
        monkeypatch.setenv(cf.ENV_VAR, "none")
        cf.write_target()


def test_round_trip_and_compact_form(home):
    cfg = cf.LoomConfig(strategy=Strategy(["fsdp", ("amp", {"dtype": "float16"}), "checkpoint"]),
                        launch={"nproc": 2, "nnodes": "1:2", "rdzv_endpoint": "node0:29400", "max_restarts": 3})
    path = cfg.save(home / "deep/dir/c.yaml")
    text = path.read_text()
    assert text.startswith("# torchloom config") and "TORCHLOOM_CONFIG_FILE=none" in text
    back = cf.load(path)
    assert back.strategy == cfg.strategy and back.launch == cfg.launch and back.path == path
    assert back.to_dict()["strategy"] == ["fsdp", {"amp": {"dtype": "float16"}}, "checkpoint"]


def test_yaml_base60_trap(home):
    """YAML 1.1 reads an unquoted 1:2 as the integer 62: the file loader keeps it a string."""
    path = write(home / "c.yaml", "config_version: 1\nlaunch:\n  nnodes: 1:2\n  master_port: 29500\n")
    assert cf.load(path).launch == {"nnodes": "1:2", "master_port": 29500}


@pytest.mark.parametrize("text, message", [
    ("strategy: [fsdp]\n", "no config_version"),
    ("config_version: 2\n", "config_version 2 is not supported"),
    ("config_version: 1\nstratgy: [fsdp]\n", "unknown key 'stratgy'. Did you mean 'strategy'"),
    ("config_version: 1\nstrategy: [fsdpp]\n", "strategy: unknown strategy method 'fsdpp'. Did you mean 'fsdp'"),
    ("config_version: 1\nstrategy: [[amp, {dtyp: bf16}]]\n", "no config key 'dtyp'"),
    ("config_version: 1\nstrategy: [ddp, fsdp]\n", "cannot be combined"),
    ("config_version: 1\nstrategy: auto\n", "'auto' is not read from a config file"),
    ("config_version: 1\nstrategy: {fsdp: {}}\n", "expected a list of methods"),
    ("config_version: 1\nlaunch: {nprocs: 2}\n", "launch: unknown key 'nprocs'. Did you mean 'nproc'"),
    ("config_version: 1\nlaunch: {nproc: 0}\n", "launch: nproc must be a positive integer"),
    ("config_version: 1\nlaunch: {nnodes: 0}\n", "nnodes must be N or MIN:MAX"),
    ("config_version: 1\nlaunch: {master_port: x}\n", "master_port expects int"),
    ("config_version: 1\nlaunch: [nproc]\n", "launch must be a mapping"),
    ("- fsdp\n", "expected a mapping"),
    ("config_version: 1\nstrategy: [fsdp\n", "not valid YAML"),
])
def test_invalid_files_name_the_file_and_the_fix(home, text, message):
    path = write(home / "work/torchloom.yaml", text)
    with pytest.raises(cf.ConfigFileError, match=message) as e:
        cf.find()
    msg = str(e.value)
    assert f"config file {path} (./torchloom.yaml in the working directory)" in msg
    assert "TORCHLOOM_CONFIG_FILE=none" in msg and f"loom config --file {path}" in msg


def test_launch_keys_are_loom_runs():
    assert cf.launch_keys() == cli._LAUNCH_KEYS
    assert set(cf.launch_keys()) == {f.name for f in dataclasses.fields(LaunchOptions)} - {"extra"}
    assert cf.parse({"config_version": 1, "launch": {"nproc_per_node": "auto"}}).launch == {"nproc": "auto"}


# ------------------------------------------------------------------------------ auto_accelerate pickup
def _accelerate(strategy="unset"):
    import torchloom

    kw = {} if strategy == "unset" else {"strategy": strategy}
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return torchloom.auto_accelerate(model, torch.optim.SGD, optim_args={"lr": 0.1}, **kw)


def test_auto_accelerate_strategy_none_reads_the_file(home, monkeypatch, caplog):
    res = _accelerate()  # no file: today's behaviour, no note
    assert res.strategy == Strategy([]) and not any("strategy from" in n for n in res.notes)
    path = write(home / "work/torchloom.yaml", "config_version: 1\nstrategy: [[amp, {dtype: bfloat16}]]\n")
    with caplog.at_level("WARNING", logger="torchloom"):
        res = _accelerate()
    assert res.strategy == Strategy([("amp", {"dtype": "bfloat16"})]) and res.compute_dtype == torch.bfloat16
    assert res.notes[0].startswith(f"strategy from {path}: Strategy[amp]")
    assert any(f"strategy from {path}" in r.getMessage() for r in caplog.records)  # the log line, rank 0
    for explicit in ([], ["checkpoint"]):  # an explicit strategy never reads the file; [] is plain data parallel
        res = _accelerate(explicit)
        assert res.strategy == Strategy(explicit) and not any("strategy from" in n for n in res.notes)
    monkeypatch.setenv(cf.ENV_VAR, "none")
    assert _accelerate().strategy == Strategy([])


def test_auto_accelerate_invalid_file_raises(home):
    write(home / "work/torchloom.yaml", "config_version: 1\nstrategy: [fsdpp]\n")
    with pytest.raises(cf.ConfigFileError, match="fsdpp"):
        _accelerate()
    assert _accelerate([]).strategy == Strategy([])  # the per-call way out


def test_annotated_model_keeps_its_strategy(home, monkeypatch):
    write(home / "work/torchloom.yaml", "config_version: 1\nstrategy: [fsdp]\n")
    monkeypatch.setattr("torchloom.strategy.annotations.has_annotations", lambda model: True)
    strategy, note = cf.default_strategy(None, torch.nn.Linear(2, 2))
    assert strategy is None and "ignored" in note and "annotations" in note
