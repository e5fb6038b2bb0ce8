"""Checkpoint tools agree with resume (issue [5] item 7), single process, tiny model.

Same-size corruption (bytes changed, size kept) of any checkpoint file: ``loom ckpt verify`` says FAILED
naming the file, ``load(root)`` falls back to the previous checkpoint with a warning naming the file, and
``loom ckpt export ROOT`` exports the checkpoint resume loads (not the corrupt newest one). Markers written
before checksums were recorded still load (sizes checked); verify says so; corruption found while loading
such a checkpoint also falls back.
"""
from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner
from safetensors.torch import load_file

from torchloom import cli
from torchloom.checkpoint import CheckpointError, check, load, save
from torchloom.checkpoint.commit import CorruptCheckpointError
from torchloom.checkpoint.state import capture_rng, restore_rng


@pytest.fixture(autouse=True)
def _keep_rng():
    st = capture_rng()
    yield
    restore_rng(st)


def _net():
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


@pytest.fixture
def root(tmp_path):
    """Checkpoints of steps 1-3 of a trained net (AdamW); ``weights[step]`` are the saved parameters."""
    torch.manual_seed(0)
    m = _net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    weights = {}
    for step in (1, 2, 3):
        m(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        save(tmp_path / "checkpoints", step=step, model=m, optimizer=opt)
        weights[step] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return tmp_path / "checkpoints", weights


def _flip_middle(path):
    """Change bytes in the middle of ``path``, keeping its size (a silent bit rot / bad copy)."""
    data = bytearray(path.read_bytes())
    i = len(data) // 2
    data[i:i + 4] = bytes(b ^ 0x5A for b in data[i:i + 4])
    path.write_bytes(bytes(data))


def _drop_checksums(ckpt):
    marker = ckpt / "COMPLETE"
    raw = json.loads(marker.read_text())
    raw.pop("checksums", None)
    marker.write_text(json.dumps(raw))


def run(*args):
    return CliRunner().invoke(cli.main, ["ckpt", *map(str, args)])


def test_marker_records_a_checksum_of_every_file(root):
    r, _w = root
    raw = json.loads((r / "step_00000003" / "COMPLETE").read_text())
    assert set(raw["checksums"]) == set(raw["files"]) and "rng/rank0.pt" in raw["checksums"]
    assert all(v.startswith("sha256:") and len(v) == 7 + 64 for v in raw["checksums"].values())


@pytest.mark.parametrize("victim", ["rng/rank0.pt", "__0_0.distcp"])
def test_same_size_corruption_fails_verify_and_resume_falls_back(root, victim, caplog):
    r, weights = root
    bad = r / "step_00000003" / victim
    _flip_middle(bad)
    out = run("verify", r)
    lines = out.output.splitlines()
    assert out.exit_code == 0, out.output
    assert lines[2].startswith("FAILED  step_00000003:") and f"{bad} does not match its checksum" in lines[2]
    assert lines[3] == f"a resume from {r} loads {r / 'step_00000002'}"
    with pytest.raises(CorruptCheckpointError, match="does not match its checksum"):
        check(r / "step_00000003")

    m = _net()
    with caplog.at_level(logging.WARNING, logger="torchloom.checkpoint"):
        info = load(r, model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=0.5))
    assert info["step"] == 2
    assert any(str(bad) in rec.getMessage() and "skipped 1 unusable" in rec.getMessage() for rec in caplog.records)
    for k, v in weights[2].items():
        assert torch.equal(m.state_dict()[k], v), k
    with pytest.raises(CorruptCheckpointError, match="does not match its checksum"):
        load(r / "step_00000003", model=_net())  # a checkpoint named explicitly is not replaced


def test_export_takes_the_checkpoint_resume_loads(root, tmp_path):
    r, weights = root
    _flip_middle(r / "step_00000003" / "rng" / "rank0.pt")
    out = run("export", tmp_path, tmp_path / "model.safetensors")  # the output dir holding checkpoints/
    assert out.exit_code == 0, out.output
    assert "Traceback" not in out.output
    sd = load_file(str(tmp_path / "model.safetensors"))
    assert sd.keys() == weights[2].keys() and all(torch.equal(sd[k], weights[2][k]) for k in sd)


def test_export_of_a_root_without_usable_checkpoint_is_one_line(root, tmp_path):
    r, _w = root
    for step in (1, 2, 3):
        _flip_middle(r / f"step_{step:08d}" / ".metadata")
    out = run("export", r, tmp_path / "model.safetensors")
    assert out.exit_code == 1 and "Traceback" not in out.output
    assert out.output.startswith(f"error: no complete checkpoint under {r}") and out.output.count("\n") == 1


def test_old_marker_without_checksums_loads_and_verify_says_so(root):
    r, weights = root
    _drop_checksums(r / "step_00000003")
    out = run("verify", r / "step_00000003")
    assert out.exit_code == 0 and "no checksums recorded" in out.output, out.output
    m = _net()
    assert load(r, model=m)["step"] == 3
    for k, v in weights[3].items():
        assert torch.equal(m.state_dict()[k], v), k


def test_corruption_found_while_loading_falls_back(root, caplog):
    """An old marker cannot catch same-size corruption before loading: the load itself finds it (an RNG
    file that is not a torch file) and resume moves on to the previous checkpoint, naming the file."""
    r, _w = root
    _drop_checksums(r / "step_00000003")
    rng = r / "step_00000003" / "rng" / "rank0.pt"
    rng.write_bytes(b"\0" * rng.stat().st_size)
    with caplog.at_level(logging.WARNING, logger="torchloom.checkpoint"):
        info = load(r, model=_net())
    assert info["step"] == 2
    assert any(str(rng) in rec.getMessage() for rec in caplog.records)


def test_strict_mismatch_is_not_skipped(root):
    """Only unusable checkpoints are skipped: a model that does not match stops the resume."""
    r, _w = root
    with pytest.raises(CheckpointError, match="does not match the model") as e:
        load(r, model=nn.Linear(3, 3))
    assert not isinstance(e.value, CorruptCheckpointError)
