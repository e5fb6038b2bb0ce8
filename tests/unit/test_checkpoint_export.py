"""Checkpoint state encoding and safetensors export (single process, no process group)."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from torchloom.checkpoint import CheckpointError, export_from_dcp, export_safetensors, load_safetensors, save
from torchloom.checkpoint.state import capture_rng, from_json, restore_rng, tied_groups, to_json


@pytest.fixture(autouse=True)
def _keep_rng():
    st = capture_rng()
    yield
    restore_rng(st)


class TiedLM(nn.Module):
    """Embedding and output projection share one weight (like ``tie_word_embeddings=True``)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([2.0]))

    def forward(self, ids):
        return self.head(self.blocks(self.embed(ids)) * self.scale)


def test_json_codec_roundtrip():
    state = {
        "t": (1, 2.5, None),
        3: "int key",
        "f": [float("inf"), -float("inf")],
        "nan": float("nan"),
        "np": np.float32(1.5),
        "x": torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16),
        "b": torch.tensor([True, False]),
        "nested": {"__loom__": 1},
    }
    back = from_json(json.loads(json.dumps(to_json(state), allow_nan=False)))
    assert back["t"] == (1, 2.5, None) and back[3] == "int key" and back["f"] == [math.inf, -math.inf]
    assert math.isnan(back["nan"]) and back["np"] == 1.5 and back["nested"] == {"__loom__": 1}
    assert back["x"].dtype == torch.bfloat16 and torch.equal(back["x"], state["x"])
    assert torch.equal(back["b"], state["b"])
    with pytest.raises(CheckpointError, match=r"extra\['k'\]\[1\] holds a builtins.object"):
        to_json({"k": [1, object()]}, "extra")


def test_rng_state_is_weights_only_and_roundtrips(tmp_path):
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    torch.save(capture_rng(), tmp_path / "rng.pt")
    expected = (torch.rand(3), random.random(), np.random.rand())
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1] and np.random.rand() == expected[2]


def test_export_strips_wrapper_prefixes_and_loads_strictly(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = TiedLM(seed=0)
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    wrapped = torch.compile(model)  # OptimizedModule: keys gain "_orig_mod."
    assert any("_orig_mod." in k for k in wrapped.state_dict())
    # (CheckpointWrapper already hides its prefix from state_dict(), not from named_parameters().)
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())
    path = export_safetensors(wrapped, tmp_path / "m.safetensors")
    with safe_open(str(path), framework="pt") as f:
        keys = sorted(f.keys())
        meta = f.metadata()
    assert keys == ["blocks.0.bias", "blocks.0.weight", "blocks.1.bias", "blocks.1.weight", "embed.weight", "scale"]
    assert json.loads(meta["torchloom.tied"]) == {"head.weight": "embed.weight"} and meta["format"] == "pt"

    plain = TiedLM(seed=5)
    res = load_safetensors(plain, path, strict=True)
    assert not res.missing_keys and not res.unexpected_keys
    assert plain.head.weight is plain.embed.weight  # the tie still holds
    ref = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in model.state_dict().items()}
    for k, v in plain.state_dict().items():
        assert torch.equal(v, ref[k]), k
    # ...and into a wrapped model too (keys are mapped back to the wrapper's names).
    again = torch.compile(TiedLM(seed=6))
    load_safetensors(again, path, strict=True)
    assert torch.equal(again._orig_mod.blocks[0].weight, ref["blocks.0.weight"])


def test_load_hf_style_file_without_tie_metadata(tmp_path):
    src = TiedLM(seed=1)
    sd = {k: v.clone() for k, v in src.state_dict().items() if k != "head.weight"}
    save_file(sd, str(tmp_path / "hf.safetensors"), metadata={"format": "pt"})
    dst = TiedLM(seed=2)
    load_safetensors(dst, tmp_path / "hf.safetensors", strict=True)
    assert torch.equal(dst.head.weight, src.embed.weight)


def test_load_safetensors_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(CheckpointError, match=r"safetensors file .*bad\.safetensors is corrupt"):
        load_safetensors(TiedLM(), bad)
    with pytest.raises(CheckpointError, match=r"missing\.safetensors is missing"):
        load_safetensors(TiedLM(), tmp_path / "missing.safetensors")
    save_file({"embed.weight": torch.zeros(16, 8)}, str(tmp_path / "partial.safetensors"))
    with pytest.raises(CheckpointError, match=r"cannot load safetensors file .*partial\.safetensors"):
        load_safetensors(TiedLM(), tmp_path / "partial.safetensors", strict=True)


def test_export_from_dcp_offline(tmp_path):
    model = TiedLM(seed=3)
    assert tied_groups(model) == [["embed.weight", "head.weight"]]
    ckpt = save(tmp_path / "ckpts", step=4, model=model)
    out = export_from_dcp(tmp_path / "ckpts", tmp_path / "out.safetensors")  # root -> newest complete
    plain = TiedLM(seed=4)
    load_safetensors(plain, out, strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(plain.state_dict()[k], v), k
    with safe_open(str(out), framework="pt") as f:
        assert "head.weight" not in f.keys()
    (ckpt / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        export_from_dcp(ckpt, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    # A bare DCP directory from another tool is accepted on request (no tie info: both keys kept).
    (ckpt / "trainer_state.json").unlink()
    export_from_dcp(ckpt, tmp_path / "bare.safetensors", require_marker=False)
    with safe_open(str(tmp_path / "bare.safetensors"), framework="pt") as f:
        assert "head.weight" in f.keys()
