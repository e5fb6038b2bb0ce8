"""C18 — torn checkpoint [KempnerInstitute/KempnerForge 102].

Async (flash) save on 2 ranks; the writer (rank 0's saver process) is killed after its first shard of
step 4 landed. Expected: the trainers get a clear error; the torn save is never a checkpoint (no
``COMPLETE`` marker, still under its ``.tmp-`` name); retention (``keep_last=1``) did not delete the last
complete checkpoint (step 2); a restart with auto-resume (on another node: no in-memory snapshot) picks
step 2 on every rank, bitwise equal to an uninterrupted run at step 2; the next save commits and only
then retires step 2.
"""
from __future__ import annotations

import pytest

from tests.distributed import _flash_workers as w
from torchloom.checkpoint import commit
from torchloom.testing import run_ranks


@pytest.fixture
def torn(tmp_path):
    env = {"TORCHLOOM_FLASH_TEST_KILL_SAVER_AT_STEP": "4"}
    return tmp_path, run_ranks(w.torn_rank, 2, str(tmp_path), timeout=240, env=env)


def test_c18_torn_async_save_falls_back_to_last_complete(torn):
    tmp, (r0, r1) = torn
    assert r0["error"] and "died while persisting step 4" in r0["error"]
    assert r1["error"] and "step 4" in r1["error"]
    root = tmp / "ckpt"
    # the shard of rank 0 landed in the temporary directory; nothing was committed
    assert (root / ".tmp-step_00000004").is_dir()
    assert any(p.name.endswith(".distcp") for p in (root / ".tmp-step_00000004").iterdir())
    assert not (root / "step_00000004").exists()
    assert commit.latest_complete(root) == root / "step_00000002"

    a, b = run_ranks(w.torn_resume_rank, 2, str(tmp), timeout=240)
    for r in (a, b):
        assert r["source"] == "disk" and r["step"] == 2
        assert r["paths"] == [str(root / "step_00000002")] * 2, "ranks disagree on the checkpoint"
        assert r["equal"], "resumed state differs from the uninterrupted run at step 2"
        assert "step_00000002" in r["entries_before"]
        assert r["complete_after"] == ["step_00000004"]
