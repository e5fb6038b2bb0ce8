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
    with pytest.raises(ValueError, match="overwrite must be True or False"):
        save_pretrained(model, tmp_path / "a", overwrite="yes")
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
    monkeypatch.undo()  # the save again: weights without a config are taken as its interrupted self
    save_pretrained(tiny_llama(1), d)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


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


def _files(d) -> dict[str, bytes]:
    """Every file under ``d`` (relative path -> bytes)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _lora(base_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    peft_model = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir),
                                LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    peft_model.peft_config["default"].base_model_name_or_path = str(base_dir)
    return peft_model


def _refused(model, d, match: str, monkeypatch, **kw) -> None:
    """``save_pretrained(model, d)`` is refused before anything is gathered, and ``d`` is left byte-equal."""
    before = _files(d)

    def no_gather(_model):
        raise AssertionError("gathered before refusing")

    monkeypatch.setattr(S, "gather_full_state", no_gather)
    with pytest.raises(CheckpointError, match=match) as e:
        save_pretrained(model, d, **kw)
    monkeypatch.undo()
    assert "overwrite=True" in str(e.value) and "nothing was written" in str(e.value)
    assert _files(d) == before
    assert not [p for p in d.parent.iterdir() if "torchloom-tmp" in p.name]


def test_an_adapter_over_a_full_model_and_a_full_model_over_an_adapter_are_refused(tmp_path, monkeypatch):
    """Both kinds in one folder: transformers applies the adapter on top of the full (maybe merged) model, and
    the earlier save's files would be deleted; refused, on every rank before gathering, naming what is there."""
    tiny_llama(0).save_pretrained(tmp_path / "base")
    peft_model = _lora(tmp_path / "base")
    full = tmp_path / "full"
    save_pretrained(tiny_llama(1), full)
    _refused(peft_model, full, r"holds a full model \(model_type 'llama', LlamaForCausalLM.*config.json.*"
                               r"model.safetensors.*this save writes a peft adapter", monkeypatch)
    adapter = tmp_path / "adapter"
    save_pretrained(peft_model, adapter)
    (adapter / "notes.txt").write_text("mine")
    _refused(peft_model, adapter, r"holds a peft adapter \(LORA.*adapter_config.json.*this save writes a full "
                                  r"model \(model_type 'llama'", monkeypatch, merge=True)
    _refused(tiny_llama(1), adapter, "holds a peft adapter", monkeypatch)


def test_a_model_of_another_type_is_refused_naming_both(tmp_path, monkeypatch):
    from tests.distributed._hf_save_workers import tokenizer
    from tests.models import tiny_gpt2

    d = tmp_path / "gpt2"
    tiny_gpt2(0).save_pretrained(d, max_shard_size="60KB")  # a downloaded model folder: shards, index, tokenizer
    tokenizer().save_pretrained(d)
    assert len(list(d.glob("model-*-of-*.safetensors"))) >= 2
    _refused(tiny_llama(0), d, r"holds a full model \(model_type 'gpt2', GPT2LMHeadModel.*model.safetensors.index"
                               r".json.*tokenizer.json.*this save writes a full model \(model_type 'llama', "
                               r"LlamaForCausalLM\)", monkeypatch)
    # the same model_type with another head is another model too
    from transformers import LlamaForSequenceClassification

    llama = tmp_path / "llama"
    save_pretrained(tiny_llama(0), llama)
    torch.manual_seed(0)
    _refused(LlamaForSequenceClassification(tiny_llama(0).config), llama,
             "LlamaForCausalLM.*LlamaForSequenceClassification", monkeypatch)


def test_overwrite_replaces_the_other_models_files_and_keeps_the_users(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.distributed._hf_save_workers import tokenizer
    from tests.models import tiny_gpt2

    d = tmp_path / "out"
    tiny_gpt2(0).save_pretrained(d, max_shard_size="60KB")
    tokenizer().save_pretrained(d)
    (d / "notes.txt").write_text("mine")
    (d / "runs").mkdir()
    (d / "runs" / "log.txt").write_text("mine too")
    model = tiny_llama(0)
    save_pretrained(model, d, overwrite=True)
    assert _files(d).keys() == {"config.json", "generation_config.json", "model.safetensors", "notes.txt",
                               "runs/log.txt"}  # the gpt2 tokenizer does not belong to the new model
    assert (d / "notes.txt").read_text() == "mine" and (d / "runs" / "log.txt").read_text() == "mine too"
    loaded = AutoModelForCausalLM.from_pretrained(d)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())
    # the same model again (no switch needed): its tokenizer stays when the re-save has none
    save_pretrained(model, d, tokenizer=tokenizer())
    save_pretrained(model, d)
    assert AutoTokenizer.from_pretrained(d)("w1 w2")["input_ids"] == [3, 4]


def test_a_save_of_one_kind_replaces_the_other_only_with_overwrite(tmp_path, monkeypatch):
    """Merged over adapter: the old adapter files would be loaded on top of the merged weights (logits off
    ~1e-3); adapter over merged: the old full model would be the base the adapter is applied to. Refused
    without overwrite=True; with it, the other kind's files are gone and each loads exactly."""
    from transformers import AutoModelForCausalLM

    base_dir = tmp_path / "base"
    tiny_llama(0).save_pretrained(base_dir)
    peft_model = _lora(base_dir)
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = peft_model(x).logits
    d = tmp_path / "out"
    save_pretrained(peft_model, d)
    save_pretrained(peft_model, d)  # the same adapter again: no switch needed
    _refused(peft_model, d, "holds a peft adapter", monkeypatch, merge=True)
    save_pretrained(peft_model, d, merge=True, overwrite=True)
    assert not any(p.name.startswith("adapter_") for p in d.iterdir())
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(d)(x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # merged: float32 rounding only
    save_pretrained(peft_model, d, merge=True)  # the same merged model again
    _refused(peft_model, d, "holds a full model", monkeypatch)
    save_pretrained(peft_model, d, overwrite=True)
    names = {p.name for p in d.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
    assert not names & {"config.json", "generation_config.json", "model.safetensors"}
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(d)(x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_an_adapter_for_another_base_is_refused(tmp_path, monkeypatch):
    tiny_llama(0).save_pretrained(tmp_path / "base")
    d = tmp_path / "out"
    save_pretrained(_lora(tmp_path / "base"), d)
    other = _lora(tmp_path / "base")
    other.peft_config["default"].base_model_name_or_path = "someone/else"
    _refused(other, d, f"base model '{tmp_path / 'base'}'.*base model 'someone/else'", monkeypatch)


def test_an_adapter_in_a_sub_folder_leaves_the_model_beside_it(tmp_path):
    """peft writes an adapter not named ``default`` into ``<dir>/<name>``: the full model in ``<dir>`` is not its
    file, and stays."""
    from peft import LoraConfig, get_peft_model

    d = tmp_path / "out"
    save_pretrained(tiny_llama(1), d)
    before = _files(d)
    peft_model = get_peft_model(tiny_llama(0), LoraConfig(r=2, target_modules=["q_proj"]), adapter_name="mine")
    save_pretrained(peft_model, d)
    after = _files(d)
    assert {k: v for k, v in after.items() if k in before} == before
    assert {"mine/adapter_config.json", "mine/adapter_model.safetensors"} <= after.keys()


# ------------------------------------------------------------------- the same model, field by field
def test_a_config_json_no_hugging_face_save_wrote_is_refused(tmp_path, monkeypatch):
    """The user's own config.json (no model_type) is not an earlier save of any model: refused for a full model
    and for an adapter (peft's save would delete it as the other kind's file), with overwrite=True too (it would
    replace a file no save wrote; the fresh-user pass lost one that way): the advice is to move it."""
    from peft import LoraConfig, get_peft_model

    d = tmp_path / "exp"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"lr": 0.1, "my": "experiment"}))
    (d / "notes.txt").write_text("mine")
    _refused(tiny_llama(0), d, r"holds a config.json that is not a Hugging Face model config \(no model_type; its "
                               r"keys: lr, my\): config.json; this save writes a full model", monkeypatch)
    _refused(get_peft_model(tiny_llama(0), LoraConfig(r=2, target_modules=["q_proj"])), d,
             "holds a config.json that is not a Hugging Face model config", monkeypatch)
    a = tmp_path / "adapter"
    a.mkdir()
    (a / "adapter_config.json").write_text(json.dumps({"rank": 8}))
    _refused(get_peft_model(tiny_llama(0), LoraConfig(r=2, target_modules=["q_proj"])), a,
             r"an adapter_config.json that is not a peft adapter config \(no peft_type", monkeypatch)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with pytest.raises(CheckpointError, match=r"never replaced \(overwrite=True neither\): nothing was written. Move "
                                              r"that file out of .*exp, or save into another directory"):
        save_pretrained(tiny_llama(0), d, overwrite=True)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64)
    return LlamaForCausalLM(LlamaConfig(**{**base, **kw}))


def test_the_same_type_and_class_with_another_architecture_is_refused(tmp_path, monkeypatch):
    """A sharded Llama of hidden size 64 and 3 layers (written by transformers itself, as a download is) is
    another model than a Llama of hidden size 32 and 2 layers, though model_type and class agree: refused,
    naming the differing fields; its shards stay."""
    d = tmp_path / "llama"
    tiny_llama(0, layers=3).save_pretrained(d, max_shard_size="60KB")
    shards = sorted(p.name for p in d.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2
    _refused(_llama(), d, r"holds a full model \(model_type 'llama', LlamaForCausalLM\).*another model \(.*"
                          r"hidden_size 64 there, 32 in this save; intermediate_size 128 there, 64 in this save; "
                          r".*num_hidden_layers 3 there, 2 in this save", monkeypatch)
    assert sorted(p.name for p in d.glob("model-*-of-*.safetensors")) == shards


def test_a_re_save_after_more_training_is_the_same_model(tmp_path, monkeypatch):
    """What legitimately changes between saves of one model (weights, the dtype, runtime and generation
    switches, dropout, the tokenizer's pad id, the label names) does not make it another model: no switch
    needed; a size that changes does."""
    d = tmp_path / "out"
    model = _llama()
    model.save_pretrained(d)  # transformers' own file first: the one a fine-tune starts from
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    model.config.use_cache = False
    model.config.pad_token_id = 0
    model.config.attention_dropout = 0.1
    model.config.output_hidden_states = True
    model.config.id2label = {0: "negative", 1: "positive"}
    save_pretrained(model.to(torch.bfloat16), d)
    assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
    _refused(_llama(rms_norm_eps=1e-3), d, r"another model \(rms_norm_eps 1e-06 there, 0.001 in this save\)",
             monkeypatch)  # a field that changes what the weights compute
    _refused(_llama(num_hidden_layers=3), d, r"another model \(num_hidden_layers 2 there, 3 in this save\)", monkeypatch)


def test_an_adapter_with_other_fields_is_refused_when_no_base_is_named(tmp_path, monkeypatch):
    """Two adapters with no base model named (both None) are told apart by their fields (r, target_modules,
    lora_alpha, ...); the same adapter saved again (inference_mode flipped, target_modules in another order)
    is not refused."""
    from peft import LoraConfig, get_peft_model

    def lora(**kw):
        m = get_peft_model(tiny_llama(0), LoraConfig(**{"r": 2, "target_modules": ["q_proj", "v_proj"], **kw}))
        m.peft_config["default"].base_model_name_or_path = None
        return m

    d = tmp_path / "adapter"
    save_pretrained(lora(), d)
    assert json.loads((d / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    again = lora(target_modules=["v_proj", "q_proj"])
    again.peft_config["default"].inference_mode = True
    save_pretrained(again, d)
    _refused(lora(r=4, lora_alpha=16), d, r"another model \(lora_alpha 8 there, 16 in this save; r 2 there, 4 in "
                                          r"this save\)", monkeypatch)
    _refused(lora(target_modules=["q_proj", "k_proj", "v_proj"]), d,
             r'target_modules \["q_proj", "v_proj"\] there, \["k_proj", "q_proj", "v_proj"\] in this save',
             monkeypatch)


def test_weights_without_a_config_are_another_model_unless_an_interrupted_save_names_them(tmp_path, monkeypatch):
    """model.safetensors with no config.json beside it (export_safetensors' output, or any file) cannot be told
    apart from another model's: refused (overwrite=True replaces it); the fresh-user pass lost one silently. An
    interrupted save leaves the config it was putting back (PENDING_FILE): a re-save of that model needs no
    switch, another model is refused, and a finished save leaves no pending file."""
    from torchloom.hf import save_target

    w = tmp_path / "weights"
    w.mkdir()
    (w / "model.safetensors").write_bytes(b"not even safetensors")
    _refused(tiny_llama(0), w, r"holds a full model \(no config.json beside the weights, and no interrupted save",
             monkeypatch)
    save_pretrained(tiny_llama(0), w, overwrite=True)
    assert json.loads((w / "config.json").read_text())["model_type"] == "llama"
    assert not (w / save_target.PENDING_FILE).exists()

    # an interrupted save: weights there, config.json removed, the pending file names it
    cut = tmp_path / "cut"
    save_pretrained(tiny_llama(0), cut)
    (cut / save_target.PENDING_FILE).write_text(json.dumps({"config.json": (cut / "config.json").read_text()}))
    (cut / "config.json").unlink()
    _refused(_llama(hidden_size=64), cut, r"another model \(intermediate_size 128 there", monkeypatch)  # not the one named
    save_pretrained(tiny_llama(0), cut)  # the same model: completes the save
    assert (cut / "config.json").is_file() and not (cut / save_target.PENDING_FILE).exists()


def test_a_users_tokenizer_files_are_not_replaced_by_a_save_with_tokenizer(tmp_path, monkeypatch):
    """A folder with tokenizer files but no model: they are no earlier save's, so save_pretrained(...,
    tokenizer=tok) refuses (overwrite=True replaces them); beside an earlier save of the same model they are its
    own and are rewritten."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text('{"mine": true}')
    with pytest.raises(CheckpointError, match=r"holds tokenizer files but no model: tokenizer.json; .*Pass "
                                              r"overwrite=True to replace them, save without tokenizer="):
        save_pretrained(tiny_llama(0), d, tokenizer=tok)
    assert (d / "tokenizer.json").read_text() == '{"mine": true}' and not (d / "config.json").exists()
    save_pretrained(tiny_llama(0), d)  # without the tokenizer: nothing of it is touched
    assert (d / "tokenizer.json").read_text() == '{"mine": true}'
    save_pretrained(tiny_llama(0), d, tokenizer=tok, overwrite=True)
    assert json.loads((d / "tokenizer.json").read_text()) != {"mine": True}
    save_pretrained(tiny_llama(0), d, tokenizer=tok)  # beside its own model now: a re-save
