"""The checkpoint commit protocol (single process): marker, torn checkpoints, retention, stale debris,
and errors that name the offending directory or file."""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from torchloom.checkpoint import CheckpointError, latest_complete, load, save
from torchloom.checkpoint import commit
from torchloom.checkpoint.state import capture_rng, read_metadata_safely, restore_rng


@pytest.fixture(autouse=True)
def _keep_rng():
    st = capture_rng()
    yield
    restore_rng(st)


def fake_checkpoint(root: Path, step: int, files: dict[str, bytes] | None = None, world_size: int = 1) -> Path:
    """Commit a directory holding ``files`` through the real protocol (local part)."""
    tmp = commit.tmp_dir(root, step)
    tmp.mkdir(parents=True)
    for rel, data in (files or {"a.bin": b"x" * 10, "sub/b.bin": b"y" * 3}).items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    return commit.publish(tmp, root, step=step, world_size=world_size)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def trained(steps: int = 1):
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(steps):
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


# ------------------------------------------------------------------------------------------ marker
def test_marker_lists_every_file_with_size(tmp_path):
    p = fake_checkpoint(tmp_path, 7, world_size=4)
    assert p == tmp_path / "step_00000007"
    raw = json.loads((p / "COMPLETE").read_text())
    assert raw["step"] == 7 and raw["world_size"] == 4 and raw["time"] > 0 and raw["time_iso"].endswith("Z")
    assert raw["files"] == {"a.bin": 10, "sub/b.bin": 3}
    assert commit.verify(p).files == {"a.bin": 10, "sub/b.bin": 3}
    assert not commit.tmp_dir(tmp_path, 7).exists()
    assert not [q for q in p.iterdir() if q.name.endswith(".part")]  # marker written via a temporary name


def test_latest_complete_picks_newest_complete(tmp_path):
    assert latest_complete(tmp_path / "nope") is None
    assert latest_complete(tmp_path) is None
    fake_checkpoint(tmp_path, 1)
    fake_checkpoint(tmp_path, 2)
    assert latest_complete(tmp_path) == tmp_path / "step_00000002"


@pytest.mark.parametrize("tear", ["no_marker", "truncated", "missing_file", "bad_marker", "grown", "tmp_only"])
def test_torn_checkpoint_is_never_chosen(tmp_path, tear):
    fake_checkpoint(tmp_path, 1)
    p = fake_checkpoint(tmp_path, 2)
    if tear == "no_marker":  # crash between the rename and the marker
        (p / "COMPLETE").unlink()
    elif tear == "truncated":
        (p / "a.bin").write_bytes(b"x" * 4)
    elif tear == "missing_file":
        (p / "sub" / "b.bin").unlink()
    elif tear == "bad_marker":
        (p / "COMPLETE").write_text('{"format": "torchloom.checkpoint.marker/1", "step": 2, "fil')
    elif tear == "grown":
        (p / "a.bin").write_bytes(b"x" * 11)
    elif tear == "tmp_only":  # crash before the rename: only a .tmp- dir with a (copied) marker
        os.replace(p, commit.tmp_dir(tmp_path, 2))
    assert latest_complete(tmp_path) == tmp_path / "step_00000001"
    assert not commit.is_complete(p)


def test_verify_errors_name_the_dir_or_file(tmp_path):
    p = fake_checkpoint(tmp_path, 3)
    (p / "a.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"a\.bin is truncated \(1 bytes, the COMPLETE marker records 10\)"):
        commit.verify(p)
    (p / "a.bin").unlink()
    with pytest.raises(CheckpointError, match=r"a\.bin listed in its COMPLETE marker is missing"):
        commit.verify(p)
    (p / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match=rf"{p}.*incomplete"):
        commit.verify(p)
    with pytest.raises(CheckpointError, match="no complete checkpoint under .*step_00000003"):
        commit.resolve(tmp_path)


def test_marker_step_must_match_dir_name(tmp_path):
    p = fake_checkpoint(tmp_path, 3)
    os.replace(p, tmp_path / "step_00000009")
    with pytest.raises(CheckpointError, match="name says step 9 but its COMPLETE marker says step 3"):
        commit.verify(tmp_path / "step_00000009")


# --------------------------------------------------------------------------------------- retention
def test_retention_keeps_last_n_and_never_the_newest_complete(tmp_path):
    for s in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, s)
    torn_old = tmp_path / "step_00000000"
    torn_old.mkdir()  # incomplete and older than the newest complete: debris
    newer_torn = fake_checkpoint(tmp_path, 5)
    (newer_torn / "COMPLETE").unlink()  # e.g. a save being committed right now: left alone
    deleted = commit.apply_retention(tmp_path, 2)
    assert sorted(p.name for p in deleted) == ["step_00000000", "step_00000001", "step_00000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004", "step_00000005"]
    commit.apply_retention(tmp_path, 1)
    assert latest_complete(tmp_path) == tmp_path / "step_00000004"  # newest complete survives keep_last=1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000005"]
    assert commit.apply_retention(tmp_path, None) == []
    with pytest.raises(CheckpointError, match="keep_last"):
        commit.apply_retention(tmp_path, 0)


def test_save_keep_last_deletes_only_after_commit(tmp_path):
    m, opt = trained()
    for s in (1, 2, 3):
        save(tmp_path, step=s, model=m, optimizer=opt, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    with pytest.raises(CheckpointError, match="keep_last"):
        save(tmp_path, step=4, model=m, keep_last=0)
    assert latest_complete(tmp_path) == tmp_path / "step_00000003"


def test_stale_tmp_cleanup(tmp_path):
    fake_checkpoint(tmp_path, 1)
    stale = commit.tmp_dir(tmp_path, 2)
    (stale / "rng").mkdir(parents=True)
    (stale / "rng" / "rank0.pt").write_bytes(b"partial")
    (tmp_path / ".tmp-delete-step_00000000-abcd").mkdir()
    keep = tmp_path / ".tmp-step_00000009"
    keep.mkdir()
    removed = commit.clean_stale_tmp(tmp_path, keep=[keep])
    assert sorted(p.name for p in removed) == [".tmp-delete-step_00000000-abcd", ".tmp-step_00000002"]
    assert keep.exists() and (tmp_path / "step_00000001").exists()
    # save() cleans debris of crashed saves before writing.
    m, _ = trained(0)
    save(tmp_path, step=3, model=m)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000003"]


def test_resaving_a_step_replaces_it(tmp_path):
    m, opt = trained()
    save(tmp_path, step=5, model=m, optimizer=opt, extra={"v": 1})
    save(tmp_path, step=5, model=m, optimizer=opt, extra={"v": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005"]
    assert load(tmp_path, model=net())["extra"] == {"v": 2}


# --------------------------------------------------------------------------- real saves, torn loads
def test_truncated_dcp_file_falls_back_and_is_named(tmp_path):
    m, opt = trained()
    save(tmp_path, step=1, model=m, optimizer=opt)
    m2, opt2 = trained(2)
    p2 = save(tmp_path, step=2, model=m2, optimizer=opt2)
    data = p2 / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    assert latest_complete(tmp_path) == tmp_path / "step_00000001"
    fresh = net()
    assert load(tmp_path, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))["step"] == 1
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is truncated"):
        load(p2, model=net())


def test_incomplete_dir_is_refused_by_name(tmp_path):
    m, _ = trained(0)
    p = save(tmp_path, step=1, model=m)
    (p / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match=rf"checkpoint {p} is incomplete"):
        load(p, model=net())
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load(tmp_path, model=net())


def _corrupt_same_size(path: Path, offset: int = 64) -> None:
    raw = bytearray(path.read_bytes())
    for i in range(offset, min(offset + 64, len(raw))):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_corrupt_files_of_the_same_size_are_named(tmp_path):
    m, opt = trained()
    p = save(tmp_path, step=1, model=m, optimizer=opt)
    for rel in ("__0_0.distcp", "trainer_state.json", "rng/rank0.pt", ".metadata"):
        backup = (p / rel).read_bytes()
        _corrupt_same_size(p / rel, offset=0 if rel != "__0_0.distcp" else 0)
        fresh = net()
        with pytest.raises(CheckpointError, match=rel.replace(".", r"\.")):
            load(p, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))
        (p / rel).write_bytes(backup)
    fresh = net()
    load(p, model=fresh)  # intact again
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), m.parameters()))


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_dcp_metadata_is_not_unpickled_blindly(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    md = tmp_path / ".metadata"
    md.write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointError, match=r"\.metadata is corrupt or unsafe.*refusing to unpickle (posix|os)\.system"):
        read_metadata_safely(md)
    assert not (tmp_path / "pwned").exists()


def test_bad_trainer_state_fails_before_writing(tmp_path):
    m, _ = trained(0)
    with pytest.raises(CheckpointError, match=r"extra\['fn'\] holds a builtins.function"):
        save(tmp_path, step=1, model=m, extra={"fn": lambda: 1})
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_load_strictness(tmp_path):
    m, _ = trained(0)
    p = save(tmp_path, step=1, model=m)
    fresh = net()
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load(p, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))
    with pytest.raises(CheckpointError, match="no lr_scheduler state"):
        opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
        load(p, model=fresh, lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    bigger = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"missing 2 keys \['3.bias', '3.weight'\]"):
        load(p, model=bigger)
    load(p, model=bigger, strict=False)
    assert torch.equal(bigger[0].weight, m[0].weight)


def test_saving_before_the_first_step_does_not_change_training(tmp_path):
    # get_state_dict() initialises empty optimizer state with a zero-lr step; save() must undo that.
    def run(with_save: bool):
        m = net()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        if with_save:
            save(tmp_path / "c", step=0, model=m, optimizer=opt)
            assert not opt.state
        torch.manual_seed(1)
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
        return [p.detach().clone() for p in m.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))
    fresh = net()
    opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    load(tmp_path / "c", model=fresh, optimizer=opt)
    assert not opt.state and opt.param_groups[0]["lr"] == 1e-2
