"""`loom ckpt verify` and `torchloom.checkpoint.check` (single process, tiny model)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

from torchloom import cli
from torchloom.checkpoint import CheckpointError, check, save
from torchloom.checkpoint.state import capture_rng, restore_rng


@pytest.fixture(autouse=True)
def _keep_rng():
    st = capture_rng()
    yield
    restore_rng(st)


@pytest.fixture
def root(tmp_path):
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    for step in (1, 2, 3):
        save(tmp_path / "checkpoints", step=step, model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    return tmp_path / "checkpoints"


def verify(path):
    return CliRunner().invoke(cli.main, ["ckpt", "verify", str(path)])


def test_check_names_the_corrupt_file(root):
    p = root / "step_00000003"
    assert check(p).step == 3
    ts = p / "trainer_state.json"
    ts.write_bytes(b"X" + ts.read_bytes()[1:])  # same size: the checksum finds it
    with pytest.raises(CheckpointError, match=r"step_00000003/trainer_state\.json does not match its checksum"):
        check(p)
    raw = json.loads((p / "COMPLETE").read_text())
    del raw["checksums"]  # a marker of an older torchloom: only parsing finds it
    (p / "COMPLETE").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"step_00000003/trainer_state\.json is corrupt"):
        check(p)


def test_verify_one_checkpoint(root):
    out = verify(root / "step_00000002")
    assert out.exit_code == 0 and out.output.startswith("ok      step_00000002: step 2, saved by 1 rank(s)")
    (root / "step_00000002" / "COMPLETE").unlink()
    out = verify(root / "step_00000002")
    assert out.exit_code == 1 and "FAILED  step_00000002:" in out.output and "no COMPLETE marker" in out.output


def test_verify_root_lists_every_checkpoint_and_the_resume_choice(root, tmp_path):
    md = root / "step_00000003" / ".metadata"
    md.write_bytes(bytes(b ^ 0xFF for b in md.read_bytes()))
    for target in (root, tmp_path):  # the root, or the output dir holding checkpoints/
        out = verify(target)
        assert out.exit_code == 0, out.output
        lines = out.output.splitlines()
        assert lines[0].startswith("ok      step_00000001") and lines[1].startswith("ok      step_00000002")
        assert lines[2].startswith("FAILED  step_00000003:") and ".metadata does not match its checksum" in lines[2]
        assert lines[3] == f"a resume from {root} loads {root / 'step_00000002'}"


def test_verify_root_without_usable_checkpoint_fails(root):
    for step in (1, 2, 3):
        (root / f"step_{step:08d}" / "COMPLETE").unlink()
    out = verify(root)
    assert out.exit_code == 1 and f"no usable checkpoint under {root}" in out.output
