"""Tied parameters never load a silently picked value (issue [5] item 3): a state dict, safetensors file or
checkpoint holding two *different* values for names the model ties (one parameter) is an error naming
both keys; equal values load as before. Single process."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from torchloom.checkpoint import CheckpointError, export_from_dcp, load, load_safetensors, save
from torchloom.checkpoint.state import capture_rng, restore_rng


@pytest.fixture(autouse=True)
def _keep_rng():
    st = capture_rng()
    yield
    restore_rng(st)


class LM(nn.Module):
    def __init__(self, tie: bool, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        if tie:
            self.head.weight = self.embed.weight


def test_safetensors_with_two_values_for_a_tie_is_an_error(tmp_path):
    untied = LM(tie=False)
    assert not torch.equal(untied.embed.weight, untied.head.weight)
    path = tmp_path / "two.safetensors"
    save_file({k: v.contiguous() for k, v in untied.state_dict().items()}, str(path))
    with pytest.raises(CheckpointError, match=r"different values for 'embed\.weight' and 'head\.weight'"):
        load_safetensors(LM(tie=True, seed=1), path)
    same = tmp_path / "same.safetensors"
    w = untied.embed.weight.detach()
    save_file({"embed.weight": w.clone(), "head.weight": w.clone()}, str(same))
    model = LM(tie=True, seed=1)
    load_safetensors(model, same)
    assert torch.equal(model.embed.weight, w) and model.head.weight is model.embed.weight


def test_checkpoint_with_two_values_for_a_tie_is_an_error(tmp_path):
    untied = LM(tie=False)
    save(tmp_path / "ck", step=1, model=untied)
    with pytest.raises(CheckpointError, match=r"different values for 'embed\.weight' and 'head\.weight'"):
        load(tmp_path / "ck", model=LM(tie=True, seed=1))


def test_tied_checkpoint_roundtrips(tmp_path):
    tied = LM(tie=True)
    save(tmp_path / "ck", step=1, model=tied)
    model = LM(tie=True, seed=3)
    load(tmp_path / "ck", model=model)
    assert torch.equal(model.embed.weight, tied.embed.weight) and model.head.weight is model.embed.weight


def test_export_refuses_two_values_for_recorded_tie(tmp_path):
    p = save(tmp_path / "ck", step=1, model=LM(tie=False))
    ts = p / "trainer_state.json"  # a checkpoint that says the two names are tied, but holds two values
    doc = json.loads(ts.read_text())
    doc["tied_params"] = [["embed.weight", "head.weight"]]
    ts.write_text(json.dumps(doc))
    marker = json.loads((p / "COMPLETE").read_text())
    marker["files"]["trainer_state.json"] = ts.stat().st_size
    marker.pop("checksums", None)
    (p / "COMPLETE").write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=r"different values for 'embed\.weight' and 'head\.weight'"):
        export_from_dcp(p, tmp_path / "out.safetensors")
