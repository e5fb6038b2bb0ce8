"""Trackers (issue [10] item 4): every back end writes what was logged, read back with the back end's own reader.

Values are python ints/floats and 0-dim tensors chosen exactly representable in float32 (TensorBoard stores
float32), so every read-back compares with ``==``.
"""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

import torchloom.main_process as mp
from tests.distributed._main_process_workers import Recorder  # the custom tracker both tests use
from torchloom.tracking import Tracker, read_metrics, start_trackers

LOGS = [({"loss": torch.tensor(1.5), "tokens": 32, "lr": 0.25}, 0),
        ({"loss": torch.tensor(0.75, dtype=torch.float64), "tokens": 64}, 3)]
CONFIG = {"lr": 0.25, "model": {"layers": 2}, "name": "tiny"}


def _log_all(group):
    for values, step in LOGS:
        group.log(values, step)
    group.finish()


def test_jsonl_lines_and_config(tmp_path):
    g = start_trackers("proj", config=CONFIG, logging_dir=tmp_path)
    _log_all(g)
    recs = read_metrics(tmp_path / "proj" / "metrics.jsonl")
    assert recs == [{"step": 0, "loss": 1.5, "tokens": 32, "lr": 0.25}, {"step": 3, "loss": 0.75, "tokens": 64}]
    assert type(recs[0]["tokens"]) is int
    assert json.loads((tmp_path / "proj" / "config.json").read_text()) == CONFIG


def test_tensorboard_events_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    g = start_trackers("proj", config=CONFIG, log_with="tensorboard", logging_dir=tmp_path)
    _log_all(g)
    acc = EventAccumulator(str(tmp_path / "proj" / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 1.5), (3, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("tokens")] == [(0, 32.0), (3, 64.0)]
    assert [(e.step, e.value) for e in acc.Scalars("lr")] == [(0, 0.25)]


def test_mlflow_file_store_read_back(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the tracker allows the 3.x file store itself
    from mlflow.tracking import MlflowClient

    g = start_trackers("proj", config=CONFIG, log_with="mlflow", logging_dir=tmp_path)
    t = g.get("mlflow")
    assert t.tracking_uri == (tmp_path / "proj" / "mlruns").resolve().as_uri()
    _log_all(g)
    client = MlflowClient(t.tracking_uri)
    hist = sorted((m.step, m.value) for m in client.get_metric_history(t.run_id, "loss"))
    assert hist == [(0, 1.5), (3, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "tokens")] == [(0, 32.0), (3, 64.0)]
    run = client.get_run(t.run_id)
    assert run.data.params == {"lr": "0.25", "model.layers": "2", "name": "tiny"}
    assert run.info.status == "FINISHED" and client.get_experiment(t.experiment_id).name == "proj"


def test_wandb_offline_read_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    g = start_trackers("proj", config=CONFIG, log_with="wandb", logging_dir=tmp_path,
                       init_kwargs={"wandb": {"settings": {"x_disable_stats": True, "console": "off"}}})
    assert g.get("wandb").run.settings.mode == "offline"
    _log_all(g)
    runs = list((tmp_path / "proj" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # wandb's own reader of the offline transaction log (run-*.wandb), as JSON lines
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(runs[0])],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    recs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    hist = [r["history"] for r in recs if r["type"] == "history"]
    assert [h["step"]["num"] for h in hist] == [0, 3]
    assert [{k: v for k, v in h["item"].items() if not k.startswith("_")} for h in hist] == [
        {"loss": 1.5, "tokens": 32, "lr": 0.25}, {"loss": 0.75, "tokens": 64}]
    config = {k: v for r in recs if r["type"] == "config" for k, v in r["config"]["update"].items()}
    assert config == CONFIG


def test_wandb_refuses_a_lower_step():
    from torchloom.tracking import WandBTracker

    t = WandBTracker.__new__(WandBTracker)  # no wandb.init: only the step check
    t.last_step, t.run = 5, None
    with pytest.raises(ValueError, match="step 4 after step 5"):
        t.log({"x": 1}, 4)




def test_custom_tracker_and_list(tmp_path):
    rec = Recorder()
    g = start_trackers("proj", config=CONFIG, log_with=["jsonl", rec], logging_dir=tmp_path)
    _log_all(g)
    assert rec.config == CONFIG and rec.finished
    assert rec.calls == [({"loss": 1.5, "tokens": 32, "lr": 0.25}, 0), ({"loss": 0.75, "tokens": 64}, 3)]
    assert all(type(v) in (int, float) for values, _ in rec.calls for v in values.values())
    assert len(read_metrics(tmp_path / "proj" / "metrics.jsonl")) == 2
    with pytest.raises(RuntimeError, match="end_training"):
        g.log({"x": 1}, 4)


@pytest.mark.parametrize("value, match", [
    (torch.ones(2), r"'bad' is not a real scalar: a Tensor of shape \(2,\)"),
    (torch.ones(1), r"'bad' is not a real scalar: a Tensor of shape \(1,\)"),
    ("1.0", "'bad' is not a scalar number"),
    (None, "'bad' is not a scalar number"),
    (1 + 2j, "'bad' is not a scalar number"),
])
def test_non_scalars_are_refused_naming_the_key(tmp_path, value, match):
    g = start_trackers("proj", log_with=Recorder(), logging_dir=tmp_path)
    with pytest.raises(TypeError, match=match):
        g.log({"ok": 1.0, "bad": value}, 0)


@pytest.mark.parametrize("step, err", [(-1, ValueError), (True, TypeError), (1.0, TypeError), (None, TypeError),
                                       (torch.tensor(1.0), TypeError)])
def test_bad_steps(tmp_path, step, err):
    g = start_trackers("proj", log_with=Recorder(), logging_dir=tmp_path)
    with pytest.raises(err, match="step"):
        g.log({"x": 1.0}, step)


def test_integer_like_steps_and_numpy_values(tmp_path):
    np = pytest.importorskip("numpy")
    rec = Recorder()
    g = start_trackers("proj", log_with=rec, logging_dir=tmp_path)
    g.log({"a": np.float32(0.5), "b": np.int64(3), "c": True}, torch.tensor(7))
    g.log({"a": 1.0}, np.int64(8))
    assert rec.calls == [({"a": 0.5, "b": 3, "c": 1}, 7), ({"a": 1.0}, 8)]


@pytest.mark.parametrize("backend, module", [("tensorboard", "tensorboard"), ("mlflow", "mlflow"),
                                             ("wandb", "wandb")])
def test_missing_package_names_the_extra(tmp_path, monkeypatch, backend, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install torchloom\[hf\]") as e:
        start_trackers("proj", log_with=backend, logging_dir=tmp_path)
    assert repr(backend) in str(e.value)


def test_missing_package_is_found_before_any_tracker_is_built(tmp_path, monkeypatch):
    """Checked with find_spec on every rank first (no import): nothing is created when one back end is missing."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="'wandb' tracker needs the 'wandb' package"):
        start_trackers("proj", log_with=["jsonl", "wandb"], logging_dir=tmp_path)
    assert not (tmp_path / "proj").exists()
    with pytest.raises(TypeError, match="bogus"):  # a constructor's own error, as raised (one process)
        start_trackers("proj", log_with="jsonl", logging_dir=tmp_path, init_kwargs={"jsonl": {"bogus": 1}})


def test_jsonl_after_a_torn_last_line(tmp_path):
    """A run killed mid-write leaves a half line: reading skips it (warning); appending first cuts it off."""
    g = start_trackers("proj", logging_dir=tmp_path)
    g.log({"loss": 1.0}, 1)
    g.finish()
    path = tmp_path / "proj" / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 2, "lo')
    with pytest.warns(UserWarning, match="torn last line 2"):
        assert read_metrics(path) == [{"step": 1, "loss": 1.0}]
    with pytest.warns(UserWarning, match="dropped a torn last line"):
        g = start_trackers("proj", logging_dir=tmp_path)
    g.log({"loss": 0.5}, 2)
    g.finish()
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n'
    with open(path, "a") as f:  # a corrupt line *before* the last is an error naming it
        f.write('{"step": 3, "lo\n{"step": 4, "loss": 0.25}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 3: not a JSON record"):
        read_metrics(path)


def test_bad_choices(tmp_path):
    with pytest.raises(ValueError, match="Did you mean 'tensorboard'"):
        start_trackers("proj", log_with="tensorbord", logging_dir=tmp_path)
    with pytest.raises(ValueError, match="twice"):
        start_trackers("proj", log_with=["jsonl", "all"], logging_dir=tmp_path)
    with pytest.raises(TypeError, match="Tracker instances"):
        start_trackers("proj", log_with=[3], logging_dir=tmp_path)
    with pytest.raises(ValueError, match="does not choose"):
        start_trackers("proj", logging_dir=tmp_path, init_kwargs={"wandb": {}})
    with pytest.raises(ValueError, match="project_name"):
        start_trackers("a/b", logging_dir=tmp_path)


def _result():
    from torchloom.api import AccelerateResult

    return AccelerateResult(model=None, optimizer=None, dataloader=None, loss_func=None, lr_scheduler=None,
                            strategy=None, mesh=None, train_step=None)


def test_result_log_without_init_uses_default_jsonl_and_warns_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = _result()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res.log({"loss": torch.tensor(2.0)}, 1)
        res.log({"loss": 1.0}, 2)
    msgs = [str(x.message) for x in w if "init_trackers" in str(x.message)]
    assert len(msgs) == 1
    runs = list((tmp_path / "torchloom_logs").glob("run-*"))
    assert len(runs) == 1 and str(runs[0].resolve() / "metrics.jsonl") in msgs[0]
    res.end_training()
    assert read_metrics(runs[0] / "metrics.jsonl") == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}]
    with pytest.raises(RuntimeError, match="end_training"):
        res.log({"loss": 1.0}, 3)
    res.init_trackers("again", logging_dir=tmp_path / "L", config={"a": 1})
    with pytest.raises(RuntimeError, match="already|running"):
        res.init_trackers("again2", logging_dir=tmp_path / "L")
    res.log({"loss": 0.5}, 0)
    assert res.get_tracker("jsonl").path == tmp_path / "L" / "again" / "metrics.jsonl"
    res.end_training()
    assert read_metrics(tmp_path / "L" / "again" / "metrics.jsonl") == [{"step": 0, "loss": 0.5}]


def test_main_process_helpers_in_one_process(capsys):
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    assert mp.is_main_process() and mp.is_local_main_process()
    mp.print("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"
    with mp.main_process_first():
        pass
    mp.wait_for_everyone()
    x = torch.arange(5)
    assert mp.gather_for_metrics(x) is x  # one process, no loader: nothing to gather or drop
    ds = TensorDataset(torch.arange(5))
    dl = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=False))
    got = torch.cat([mp.gather_for_metrics(b, dl) for (b,) in dl])
    assert got.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(Exception, match="next batch"):
        mp.gather_for_metrics(torch.arange(3), dl)
