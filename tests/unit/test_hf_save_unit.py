"""torchloom.hf.save_pretrained in one process: argument checks, the shard-size parser, and publishing into
an existing directory (stale shards go, markers come last, other files stay). The distributed round trips
are in tests/distributed/test_hf_save.py."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from tests.models import tiny_llama
from torchloom.errors import CheckpointError
from torchloom.hf import save as S
from torchloom.hf import save_pretrained


def test_importing_torchloom_hf_is_light():
    import subprocess
    import sys

    code = "import sys, torchloom.hf; print(any(m in sys.modules for m in ('peft', 'transformers')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("size, want", [(123, 123), ("5GB", 5 * 10**9), ("500MB", 5 * 10**8), (" 2kb ", 2000),
                                        ("1.5MB", 1_500_000)])
def test_shard_size_bytes_parses_like_huggingface_hub(size, want):
    assert S.shard_size_bytes(size) == want


@pytest.mark.parametrize("size", [0, -1, True, "5GiB", "GB", "5 G", 1.5, None])
def test_shard_size_bytes_refuses_bad_sizes(size):
    with pytest.raises(ValueError, match="max_shard_size"):
        S.shard_size_bytes(size)


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    model = tiny_llama(0)
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        save_pretrained(model, tmp_path / "a", safe_serialization=False)
    with pytest.raises(ValueError, match="not a peft.PeftModel"):
        save_pretrained(model, tmp_path / "a", merge=True)
    with pytest.raises(TypeError, match="save_pretrained"):
        save_pretrained(model, tmp_path / "a", tokenizer=object())
    with pytest.raises(TypeError, match="export_safetensors"):
        save_pretrained(nn.Linear(2, 2), tmp_path / "a")
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        save_pretrained(model, tmp_path / "file")


def test_compiled_model_saves_plain_names(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_llama(0, tie=True)
    save_pretrained(torch.compile(model), tmp_path / "m")  # not run: only the wrapper's names matter
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_existing_directory_keeps_other_files_and_loses_stale_shards(tmp_path):
    from transformers import AutoModelForCausalLM

    d = tmp_path / "out"
    model = tiny_llama(0)
    (tmp_path / ".out.torchloom-tmp-deadbeef").mkdir()  # a killed save's staging directory
    save_pretrained(model, d, max_shard_size="60KB")
    assert not (tmp_path / ".out.torchloom-tmp-deadbeef").exists()
    assert len(list(d.glob("model-*-of-*.safetensors"))) >= 2
    (d / "notes.txt").write_text("mine")
    (d / "checkpoints").mkdir()
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    save_pretrained(model, d)  # one shard now: the old shards and index would mix old weights in
    assert sorted(p.name for p in d.iterdir()) == ["checkpoints", "config.json", "generation_config.json",
                                                  "model.safetensors", "notes.txt"]
    loaded = AutoModelForCausalLM.from_pretrained(d)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert (d / "model.safetensors").stat().st_mode & 0o777 == 0o644  # readable by others, like config.json


def test_an_interrupted_publish_leaves_no_config(tmp_path, monkeypatch):
    d = tmp_path / "out"
    save_pretrained(tiny_llama(0), d)
    real = os.replace

    def crash(src, dst):
        if str(dst).endswith("model.safetensors"):
            raise OSError("disk full (simulated)")
        return real(src, dst)

    monkeypatch.setattr(S.os, "replace", crash)
    with pytest.raises(CheckpointError, match="disk full"):
        save_pretrained(tiny_llama(1), d)
    # the old weights are still there, but without config.json from_pretrained refuses the directory
    assert not (d / "config.json").exists() and (d / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if "torchloom-tmp" in p.name]  # staging removed


def test_names_that_do_not_match_the_plain_model_are_an_error_not_a_file(tmp_path):
    model = tiny_llama(0)
    sd = {("x." + k if "lm_head" in k else k): v for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"missing \['lm_head.weight'\].*unexpected \['x.lm_head.weight'\]"):
        S.fill(S.rebuild(type(model), model.config), sd, "test")


def test_tied_names_with_different_values_are_refused():
    model = tiny_llama(0, tie=True)
    sd = dict(model.state_dict())
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 1
    with pytest.raises(CheckpointError, match="different values"):
        S.fill(S.rebuild(type(model), model.config), sd, "test")


def test_config_json_names_the_plain_class_and_dtype(tmp_path):
    model = tiny_llama(0).to(torch.bfloat16)
    save_pretrained(model, tmp_path / "bf16")
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert model.config.architectures is None  # the live config is not changed


def test_a_save_of_one_kind_replaces_a_save_of_the_other(tmp_path):
    """Merged over adapter: the old adapter files would be loaded on top of the merged weights (logits off
    ~1e-3); adapter over merged: the old full model would be the base the adapter is applied to."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch.manual_seed(0)
    base_dir = tmp_path / "base"
    tiny_llama(0).save_pretrained(base_dir)
    peft_model = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir),
                                LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    peft_model.peft_config["default"].base_model_name_or_path = str(base_dir)
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = peft_model(x).logits
    d = tmp_path / "out"
    save_pretrained(peft_model, d)
    save_pretrained(peft_model, d, merge=True)
    assert not any(p.name.startswith("adapter_") for p in d.iterdir())
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(d)(x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # merged: float32 rounding only
    save_pretrained(peft_model, d)
    names = {p.name for p in d.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
    assert not names & {"config.json", "generation_config.json", "model.safetensors"}
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(d)(x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
