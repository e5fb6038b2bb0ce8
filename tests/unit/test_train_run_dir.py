"""`loom train` in an output dir that holds a run (issue [11] item 3): a run of another model is refused before
anything is written (CLI and job), changes that keep the model still resume. No processes are launched."""
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from torchloom import cli
from torchloom.elastic import launcher
from torchloom.train.config import ConfigError, TrainConfig
from torchloom.train.run_dir import (RESUME_KEYS, OutputDirInUse, ResumeSettingChanged, check_output_dir,
                                     model_differences)

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
    for overrides in (["train.steps=40", "train.lr=1e-3", "train.warmup=2"],
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
    monkeypatch.setenv("TORCHLOOM_TRAIN_CLAIMED", "")  # the launch below sets it for its workers: restored after
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


# ------------------------------------------------------------------------- resume-defining settings
def _complete_checkpoint(out: Path, step: int = 10, seed: int = 0) -> Path:
    """A complete checkpoint (valid COMPLETE marker) whose data position was saved with ``seed``."""
    import json

    from torchloom.checkpoint import commit

    ckpt = out / "checkpoints" / f"step_{step:08d}"
    if ckpt.exists():
        import shutil

        shutil.rmtree(ckpt)
    ckpt.mkdir(parents=True)
    state = {"kind": "map", "epoch": 0, "consumed": step * 8, "seed": seed, "num_samples": 500,
             "global_batch_size": 8}
    from torchloom.checkpoint.trainer_state import TRAINER_STATE_FORMAT

    (ckpt / "trainer_state.json").write_text(json.dumps({"format": TRAINER_STATE_FORMAT, "step": step,
                                                         "dataloader": state}))
    commit.write_marker(ckpt, step=step, world_size=2)
    assert commit.latest_complete(out / "checkpoints") == ckpt
    return ckpt


def test_a_seed_change_is_refused_while_a_checkpoint_exists(tmp_path):
    """The seed fixes the data order the checkpoint's data position counts in: the workers would fail (or mix
    orders); refused before launch, naming the key, why, and the three ways on."""
    out = tmp_path / "run"
    _dense_run(out)
    ckpt = _complete_checkpoint(out)
    before = _files(out)
    with pytest.raises(ResumeSettingChanged) as e:
        check_output_dir(TrainConfig.load("smoke", ["train.seed=1"], str(out)))
    msg = str(e.value)
    assert f"output dir {out} holds a checkpoint ({ckpt}) of a run with another train.seed (train.seed: 0 -> 1)" in msg
    assert RESUME_KEYS["train.seed"] in msg and "Keep --set train.seed=0 to resume that run" in msg
    assert "--output-dir" in msg and f"delete {out / 'checkpoints'}" in msg
    assert isinstance(e.value, ConfigError) and _files(out) == before
    check_output_dir(TrainConfig.load("smoke", ["train.seed=0", "train.global_batch=16"], str(out)))  # resumes


def test_a_seed_change_without_a_checkpoint_starts_over(tmp_path):
    out = tmp_path / "run"
    _dense_run(out)  # its checkpoint is torn (no valid marker): a run starts from step 0
    check_output_dir(TrainConfig.load("smoke", ["train.seed=1"], str(out)))


def test_the_seed_is_read_from_the_checkpoint(tmp_path):
    """A config.yaml rewritten with seed 1 by a run that then failed to resume (an older torchloom) does not
    decide: the checkpoint's data position was saved with seed 0."""
    out = tmp_path / "run"
    _dense_run(out, "train.seed=1")
    _complete_checkpoint(out, seed=0)
    check_output_dir(TrainConfig.load("smoke", [], str(out)))
    with pytest.raises(ResumeSettingChanged, match=r"train.seed: 0 -> 1"):
        check_output_dir(TrainConfig.load("smoke", ["train.seed=1"], str(out)))
    (out / "config.yaml").unlink()  # no config.yaml at all: the checkpoint still says
    with pytest.raises(ResumeSettingChanged, match=r"train.seed: 0 -> 1"):
        check_output_dir(TrainConfig.load("smoke", ["train.seed=1"], str(out)))
    check_output_dir(TrainConfig.load("smoke", ["model.hidden_size=128"], str(out)))  # nothing else compared


def test_loom_train_refuses_a_seed_change_before_launching(tmp_path, monkeypatch):
    from torchloom.train import run_lock

    out = tmp_path / "run"
    _dense_run(out)
    _complete_checkpoint(out)
    before = _files(out)
    launched = []
    monkeypatch.setattr(launcher, "run", lambda *a, **k: launched.append(a) or 0)
    monkeypatch.setattr(cli, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setenv(run_lock.CLAIMED_ENV, "")
    r = CliRunner().invoke(cli.main, ["train", "smoke", "--output-dir", str(out), "--set", "train.seed=1"])
    assert r.exit_code == 2 and not launched, r.output
    assert "train.seed: 0 -> 1" in r.output and _files(out) == before



def test_a_batch_layout_the_data_position_misses_is_refused_before_launch(tmp_path, monkeypatch):
    """A changed global/micro batch resumes under the alignment rule (docs/data.md) and is refused before launch
    when the saved position (40 samples: step 5 x 8) is not a multiple of ranks x micro batch."""
    from torchloom.train import run_lock
    from torchloom.train.run_dir import check_resume_layout

    out = tmp_path / "run"
    _dense_run(out)
    ckpt = _complete_checkpoint(out, step=5)
    for ok in (["train.global_batch=24", "train.micro_batch=2"], ["train.global_batch=16"], []):
        check_resume_layout(TrainConfig.load("smoke", ok, str(out)), 2)  # 2 ranks x micro 2 divides 40
    with pytest.raises(ResumeSettingChanged) as e:
        check_resume_layout(TrainConfig.load("smoke", ["train.global_batch=24", "train.micro_batch=6"], str(out)), 2)
    msg = str(e.value)
    assert f"cannot resume the data position of {ckpt} with this batch layout (2 processes: data-parallel 2 x " \
           "micro batch 6, global batch 24)" in msg
    assert "consumed 40 samples" in msg and "--set train.micro_batch=N" in msg and "train.global_batch (8)" in msg
    check_resume_layout(TrainConfig.load("smoke", ["train.global_batch=24", "train.micro_batch=6",
                                                   "checkpoint.blocking=false"], str(out)), 2)  # flash: the workers

    before = _files(out)
    launched = []
    monkeypatch.setattr(launcher, "run", lambda *a, **k: launched.append(a) or 0)
    monkeypatch.setattr(cli, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setenv(run_lock.CLAIMED_ENV, "")
    r = CliRunner().invoke(cli.main, ["train", "smoke", "--output-dir", str(out), "--set", "train.global_batch=24",
                                      "--set", "train.micro_batch=6"])
    assert r.exit_code == 2 and not launched and "consumed 40 samples" in r.output, r.output
    assert _files(out) == before


def test_a_dir_holding_a_hf_model_or_run_files_without_config_yaml_is_refused_before_anything(tmp_path):
    """No config.yaml, so no run of ours: a Hugging Face model there would be refused only by the final export,
    after every step trained (the fresh-user pass: exit 1 at the end, the same on every re-run); run files there
    (metrics, checkpoints) would be written over. Refused up front, nothing changed; an empty dir or one holding
    only the user's other files is fine."""
    import json

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (hf / "model.safetensors").write_bytes(b"weights")
    (hf / "notes.txt").write_text("mine")
    before = _files(hf)
    with pytest.raises(OutputDirInUse) as e:
        check_output_dir(TrainConfig.load("smoke", [], str(hf)))
    msg = str(e.value)
    assert f"output dir {hf} holds a full model (model_type 'gpt2', GPT2LMHeadModel)" in msg
    assert "config.json, model.safetensors" in msg and "no config.yaml of a loom train run" in msg
    assert f"--output-dir {tmp_path / 'hf-2'}" in msg and "Nothing in" in msg
    assert _files(hf) == before

    run = tmp_path / "copied"  # a finished run's dir, its config.yaml and checkpoints deleted
    _dense_run(run)
    (run / "config.yaml").unlink()
    import shutil

    shutil.rmtree(run / "checkpoints")
    with pytest.raises(OutputDirInUse, match=r"holds a full model \(no config.json beside the weights.*\(model."
                                             r"safetensors\) and files of a run \(metrics.jsonl\) but no config.yaml"):
        check_output_dir(TrainConfig.load("smoke", [], str(run)))

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    check_output_dir(TrainConfig.load("smoke", [], str(mine)))  # nothing a run writes: fine
    check_output_dir(TrainConfig.load("smoke", [], str(tmp_path / "absent")))
