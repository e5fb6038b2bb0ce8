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


def test_torn_checkpoint_messages_fit_what_was_passed(root, caplog):
    """Scanning a root names a torn checkpoint without telling the user to pass the root they passed; naming the
    torn checkpoint itself points at its root only when that holds a complete one (issue [11] item 13)."""
    from torchloom.checkpoint import load

    torn = root / "step_00000003"
    (torn / "COMPLETE").unlink()
    out = verify(root)
    assert out.exit_code == 0, out.output
    assert (f"FAILED  step_00000003: checkpoint {torn} is incomplete: it has no COMPLETE marker (the save did not "
            "finish, or this is not a torchloom checkpoint)") in out.output
    assert "root instead" not in out.output and "pass the root" not in out.output, out.output
    m = nn.Linear(4, 2)
    with caplog.at_level("WARNING"):
        assert load(root, model=m)["step"] == 2
    assert "skipped 1 unusable" in caplog.text and "root instead" not in caplog.text

    out = verify(torn)
    assert out.exit_code == 1
    assert (f"The newest complete checkpoint under {root} is step_00000002: pass the root {root} instead of one "
            "checkpoint to load the newest usable one.") in out.output
    with pytest.raises(CheckpointError, match=rf"is incomplete.*pass the root {root} instead"):
        load(torn, model=m)
    for step in (1, 2):
        (root / f"step_{step:08d}" / "COMPLETE").unlink()
    out = verify(torn)  # the root holds nothing usable either: no pointer to it
    assert out.exit_code == 1 and "pass the root" not in out.output
    with pytest.raises(CheckpointError) as e:
        load(torn, model=m)
    assert "root instead" not in str(e.value) and "pass the root" not in str(e.value)
