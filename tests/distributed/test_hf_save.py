"""torchloom.hf.save_pretrained on 2 gloo ranks: what every strategy writes loads with ``from_pretrained``
(no missing/unexpected keys) holding exactly the live weights, and gives bitwise-equal fp32 logits to a
plain model holding them. One launch covers fsdp, ddp, tensor_parallel, pipeline_parallel and a peft LoRA
model under fsdp (adapter and merged); see tests/distributed/_hf_save_workers.py.

Tolerances: exact (torch.equal) everywhere, except the merged LoRA model against peft's merge done in this
process: atol 1e-6 (the same ``W + scale * B @ A``, possibly summed in another order by another thread count).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.distributed import _hf_save_workers as W
from tests.models import tiny_llama
from torchloom.testing import run_ranks

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_save")
    return tmp, run_ranks(W.save_rank, 2, str(tmp), env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})


def _union(ranks: list[dict], tag: str) -> dict[str, torch.Tensor]:
    """Every rank's live tensors (pipeline ranks hold different stages; others hold equal copies)."""
    out: dict[str, torch.Tensor] = {}
    for r in ranks:
        for k, v in r[tag]["params"].items():
            assert k not in out or torch.equal(out[k], v), f"{tag}: {k} differs between ranks"
            out[k] = v
    return out


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def _reference(params: dict[str, torch.Tensor], tie: bool):
    model = tiny_llama(0, tie=tie)
    model.load_state_dict(params, strict=True)
    return model.eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.distributed
@pytest.mark.parametrize("tag", list(W.CASES))
def test_round_trip_through_from_pretrained_is_exact(saved, tag):
    tmp, ranks = saved
    assert [r[tag]["path"] for r in ranks] == [str(tmp / tag)] * 2  # every rank gets the path
    live = _union(ranks, tag)
    tie = W.CASES[tag][1]
    loaded = _load(tmp / tag)
    assert set(loaded.state_dict()) == set(live)
    for k, v in loaded.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, live[k]), k
    assert torch.equal(_logits(loaded), _logits(_reference(live, tie)))
    config = json.loads((tmp / tag / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32" and config["tie_word_embeddings"] is tie
    assert json.loads((tmp / tag / "generation_config.json").read_text())["max_new_tokens"] == 7
    if tie:  # stored once, under the name Hugging Face keeps; re-tied on load
        names = _weight_names(tmp / tag)
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert not [p for p in tmp.iterdir() if "torchloom-tmp" in p.name]  # the staging directories are gone


def _weight_names(path: Path) -> set[str]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.distributed
def test_fsdp_shards_index_and_tokenizer(saved):
    from transformers import AutoTokenizer

    tmp, ranks = saved
    d = tmp / "fsdp"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and not (d / "model.safetensors").exists()
    assert shards == sorted(p.name for p in d.glob("model-*-of-*.safetensors"))
    assert all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    total = 0
    for s in shards:
        assert os.path.getsize(d / s) <= 60_000 + 32 * 1024 or len(_keys(d / s)) == 1  # a big tensor: own shard
        with safe_open(str(d / s), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            total += sum(f.get_tensor(k).numel() * 4 for k in f.keys())
            assert {k for k, v in index["weight_map"].items() if v == s} == set(f.keys())
    assert index["metadata"]["total_size"] == total
    tok = AutoTokenizer.from_pretrained(d)
    assert tok("w1 w2 zz")["input_ids"] == W.tokenizer()("w1 w2 zz")["input_ids"] == [3, 4, 0]


def _keys(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


@pytest.mark.distributed
def test_res_model_save_pretrained_is_routed_or_refused(saved):
    tmp, ranks = saved
    for r in ranks:
        assert "torchloom.hf.save_pretrained" in r["fsdp"]["refused"] and "push_to_hub" in r["fsdp"]["refused"]
        assert any("goes through torchloom.hf.save_pretrained" in n for n in r["fsdp"]["notes"])
        assert not any("goes through" in n for n in r["ddp"]["notes"])  # unsharded: HF's own method works
    assert not (tmp / "refused").exists()
    live = _union(ranks, "fsdp")
    loaded = _load(tmp / "routed")
    assert all(torch.equal(v, live[k]) for k, v in loaded.state_dict().items())


@pytest.mark.distributed
def test_lora_under_fsdp_adapter_and_merged(saved):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp, ranks = saved
    lora = ranks[0]["lora"]
    assert "PeftModel" in lora["type"] and [r["lora"]["path"] for r in ranks] == [str(tmp / "lora")] * 2
    live = _union(ranks, "lora")
    assert all(torch.equal(v, live[k]) for k, v in lora["after"].items())  # merge did not touch the model
    ref = W.lora_model(0)
    ref.load_state_dict(live, strict=True)
    ref.eval()
    want = _logits(ref)
    for d in (tmp / "lora", tmp / "lora_routed"):
        assert sorted(p.name for p in d.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
        keys = _keys(d / "adapter_model.safetensors")
        assert keys and all(k.startswith("base_model.model.model.layers.") and ".lora_" in k and ".default" not in k
                            for k in keys), keys
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
        adapter = PeftModel.from_pretrained(tiny_llama(0, tie=True), d).eval()  # the frozen base: the init
        assert torch.equal(_logits(adapter), want)
    merged_dir = tmp / "merged"
    for r in ranks:  # the adapter over the merged model: every rank raised, nothing was written
        refused = r["lora"]["refused"]
        assert refused.startswith("CheckpointError: save_pretrained: "), refused
        assert "holds a full model (model_type 'llama', LlamaForCausalLM)" in refused and "overwrite=True" in refused
    assert sorted(p.name for p in merged_dir.iterdir()) == ["config.json", "generation_config.json",
                                                           "model.safetensors"]
    adapter_bytes = os.path.getsize(tmp / "lora" / "adapter_model.safetensors")
    assert adapter_bytes * 10 < os.path.getsize(merged_dir / "model.safetensors")
    merged, info = AutoModelForCausalLM.from_pretrained(merged_dir, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(merged).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(_logits(merged.eval()), _logits(ref.merge_and_unload()), rtol=0, atol=1e-6)
