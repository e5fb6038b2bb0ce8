"""`loom train` in an output dir that holds a run (issue [11] item 3): a run of another model is refused before
anything is written (CLI and job), changes that keep the model still resume. No processes are launched."""
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from torchloom import cli
from torchloom.elastic import launcher
from torchloom.train.config import ConfigError, TrainConfig
from torchloom.train.run_dir import OutputDirInUse, check_output_dir, model_differences

MOE = ("model.moe.num_experts=8", "parallel.ep=2")


def _dense_run(out: Path, *overrides: str) -> dict[str, bytes]:
    """An output dir as a finished dense smoke run leaves it (config.yaml, metrics, a checkpoint, weights);
    returns every file's bytes."""
    cfg = TrainConfig.load("smoke", list(overrides), str(out))
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (out / "metrics.jsonl").write_text('{"type": "train", "step": 1, "loss": 7.5}\n')
    ckpt = out / "checkpoints" / "step_00000010"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("{}")
    (out / "model.safetensors").write_bytes(b"weights")
    return _files(out)


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_moe_config_on_a_dense_run_is_refused_naming_both_models(tmp_path):
    out = tmp_path / "runs" / "shakespeare"
    before = _dense_run(out)
    with pytest.raises(OutputDirInUse) as e:
        check_output_dir(TrainConfig.load("smoke", list(MOE), str(out)))
    msg = str(e.value)
    assert f"output dir {out} holds a run of another model: LlamaForCausalLM (hidden 64, 2 layers" in msg
    assert "this config builds MixtralForCausalLM (8 experts, top-2; hidden 64, 2 layers" in msg
    assert "model.moe.num_experts: 0 -> 8" in msg
    assert f"--output-dir {tmp_path / 'runs' / 'moe'}" in msg and "delete it first" in msg
    assert isinstance(e.value, ConfigError)  # `loom train` exits 2 on it
    assert _files(out) == before


@pytest.mark.parametrize("override", [
    "model.vocab_size=1024", "model.hidden_size=128", "model.num_layers=3", "model.num_kv_heads=4",
    "model.intermediate_size=256", "model.seq_len=32", "model.tie_embeddings=true", "model.rope_theta=500000.0",
    "data.eval_plays=[hamlet]",  # the tokenizer is trained on the other plays: other token ids
])
def test_every_model_defining_change_is_refused(tmp_path, override):
    out = tmp_path / "run"
    _dense_run(out)
    key = override.split("=")[0]
    with pytest.raises(OutputDirInUse, match=f"{key}: "):
        check_output_dir(TrainConfig.load("smoke", [override], str(out)))


def test_changes_that_keep_the_model_resume(tmp_path):
    out = tmp_path / "run"
    _dense_run(out)
    for overrides in (["train.steps=40", "train.lr=1e-3", "train.warmup=2", "train.seed=3"],
                      ["log.interval=5", "checkpoint.interval=3", "checkpoint.keep_last=5", "eval.interval=0"],
                      ["strategy=[fsdp]", "parallel.tp=2"], ["train.global_batch=16", "train.micro_batch=4"],
                      ["model.moe.top_k=1", "model.moe.aux_loss_weight=0.1"],  # dense: the moe keys build nothing
                      ["data.eval_plays=[tempest, hamlet]", "data.cache_dir=/elsewhere", "sample.max_new_tokens=0"]):
        check_output_dir(TrainConfig.load("smoke", overrides, str(out)))


def test_moe_runs_compare_their_expert_keys(tmp_path):
    out = tmp_path / "run"
    _dense_run(out, "model.moe.num_experts=4")
    check_output_dir(TrainConfig.load("smoke", ["model.moe.num_experts=4", "model.moe.aux_loss_weight=0.1",
                                                "parallel.ep=2"], str(out)))
    with pytest.raises(OutputDirInUse, match=r"model.moe.top_k: 2 -> 1"):
        check_output_dir(TrainConfig.load("smoke", ["model.moe.num_experts=4", "model.moe.top_k=1"], str(out)))
    with pytest.raises(OutputDirInUse, match=r"MixtralForCausalLM \(4 experts.*builds LlamaForCausalLM"):
        check_output_dir(TrainConfig.load("smoke", [], str(out)))


def test_a_dir_without_a_trained_run_is_not_refused(tmp_path):
    out = tmp_path / "run"
    _dense_run(out)
    for name in ("metrics.jsonl", "model.safetensors"):
        (out / name).unlink()
    (out / "checkpoints" / "step_00000010" / "COMPLETE").unlink()
    (out / "checkpoints" / "step_00000010").rmdir()
    check_output_dir(TrainConfig.load("smoke", list(MOE), str(out)))  # only a config.yaml: nothing to lose
    check_output_dir(TrainConfig.load("smoke", list(MOE), str(tmp_path / "new")))  # no dir at all


def test_saved_config_of_an_older_version_and_unreadable_ones(tmp_path):
    out = tmp_path / "run"
    _dense_run(out)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    del saved["model"]["moe"], saved["model"]["rope_theta"]  # keys an older torchloom did not write: defaults
    assert model_differences(saved, TrainConfig.load("smoke", [], str(out))) == []
    (out / "config.yaml").write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="(?s)cannot read .*config.yaml.*--output-dir"):
        check_output_dir(TrainConfig.load("smoke", [], str(out)))


def test_loom_train_refuses_before_launching(tmp_path, monkeypatch):
    """The README's MoE command after the quick start: exit 2 with the message, no process started, the dense
    run's files byte-identical."""
    out = tmp_path / "runs" / "shakespeare"
    before = _dense_run(out)
    launched = []
    monkeypatch.setattr(launcher, "run", lambda *a, **k: launched.append(a) or 0)
    monkeypatch.setattr(cli, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    r = CliRunner().invoke(cli.main, ["train", "smoke", "--output-dir", str(out), "--set", MOE[0], "--set", MOE[1]])
    assert r.exit_code == 2, r.output
    assert "holds a run of another model" in r.output and "--output-dir" in r.output and not launched
    assert _files(out) == before
    r = CliRunner().invoke(cli.main, ["train", "smoke", "--output-dir", str(out), "--set", "train.steps=40"])
    assert r.exit_code == 0 and len(launched) == 1, r.output  # the same model: launched, to resume


def test_the_job_refuses_before_writing(tmp_path, capsys):
    """`loom train --no-launch` (and every worker) checks it too, before the corpus or any file."""
    from torchloom.train.job import run_job

    out = tmp_path / "run"
    before = _dense_run(out)
    code = run_job(["smoke", "--output-dir", str(out), "--set", "watchdog.timeout_s=0", "--set", MOE[0]])
    assert code == 2
    err = capsys.readouterr().err
    assert "error: output dir" in err and "MixtralForCausalLM" in err and "Traceback" not in err
    assert _files(out) == before
