"""Built-in model presets and ``resolve_model`` (torchloom.cost.presets): the published configs give the
published parameter counts, models are only ever built on the meta device, and bad specs are named."""
from __future__ import annotations

import json

import pytest
import torch

from torchloom.cost.presets import ModelSpecError, known_models, resolve_model

# Parameter counts of the published checkpoints (sum of the safetensors shapes on the Hugging Face model pages);
# a wrong hidden/intermediate/head/vocab number in a preset moves these by >= 0.1%.
PUBLISHED_PARAMS = {
    "llama3-8b": 8_030_261_248,
    "llama3.1-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "mixtral-8x7b": 46_702_792_704,
}


def _llama_params(v, h, inter, layers, heads, kv):
    hd = h // heads
    block = h * h * 2 + 2 * h * kv * hd + 3 * h * inter + 2 * h  # q, o; k, v; gate/up/down; two norms
    return 2 * v * h + layers * block + h  # embedding + untied head, blocks, final norm


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_counts_match_the_published_checkpoints(name):
    spec = resolve_model(name)
    model = spec.meta_model()
    assert all(p.is_meta for p in model.parameters())  # shapes only: a 405B model costs no memory
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[name]
    assert spec.source.startswith("https://huggingface.co/")
    assert spec.default_seq_len() == 8192


def test_llama_presets_agree_with_the_hand_formula():
    c = resolve_model("llama3-70b").hf_config
    assert _llama_params(c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                         c.num_attention_heads, c.num_key_value_heads) == PUBLISHED_PARAMS["llama3-70b"]


def test_default_is_the_loom_train_jobs_model():
    from torchloom.train.config import TrainConfig, _meta_model

    spec = resolve_model("default")
    mc = TrainConfig.load("default").model
    assert spec.seq_len == mc.seq_len == 128
    c = spec.hf_config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size, c.vocab_size) == (
        mc.hidden_size, mc.num_layers, mc.num_heads, mc.intermediate_size, mc.vocab_size)
    want = sum(p.numel() for p in _meta_model(mc, 0).parameters())
    assert sum(p.numel() for p in spec.meta_model().parameters()) == want


def test_config_json_file_and_directory(tmp_path):
    from tests.models import tiny_llama_config

    d = tiny_llama_config(layers=3).to_dict()
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(d))
    for given in (tmp_path / "m" / "config.json", tmp_path / "m"):
        spec = resolve_model(str(given))
        assert spec.name == "m" and spec.hf_config.num_hidden_layers == 3
        assert spec.default_seq_len() == 256  # max_position_embeddings, below the cap
        assert any("sequence length 256 assumed" in n for n in spec.notes)


def test_config_json_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ModelSpecError, match="cannot read the model config"):
        resolve_model(str(bad))
    no_type = tmp_path / "no_type.json"
    no_type.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ModelSpecError, match="no 'model_type'"):
        resolve_model(str(no_type))
    with pytest.raises(ModelSpecError, match="no file .*missing.json"):
        resolve_model(str(tmp_path / "missing.json"))


def test_factory_import_path_is_called_on_meta():
    spec = resolve_model("tests.models:tiny_llama")
    model = spec.meta_model()
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(ModelSpecError, match="pass --seq-len"):
        spec.default_seq_len()
    with pytest.raises(ModelSpecError, match="has no 'nope'"):
        resolve_model("tests.models:nope")
    with pytest.raises(ModelSpecError, match="cannot import 'no_such_pkg_xyz.mod'"):
        resolve_model("no_such_pkg_xyz.mod:fn")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ModelSpecError) as e:
        resolve_model("mixtral8x7b")
    msg = str(e.value)
    assert "Did you mean 'mixtral-8x7b'" in msg
    for name in known_models():
        assert name in msg
    assert set(known_models()) >= {"llama3-8b", "llama3-70b", "llama3.1-405b", "mixtral-8x7b", "default"}


def test_resolving_allocates_nothing():
    before = torch.empty(0).untyped_storage  # noqa: F841 - just make sure torch is initialised
    import resource

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    resolve_model("llama3.1-405b").meta_model()
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    assert grown_kib < 1024 * 1024  # < 1 GiB; the real model would need 1.6 TB in fp32
