"""`loom train` resume when the newest checkpoint is corrupt: it falls back to the previous complete one.

The smoke config (2 gloo processes) with a checkpoint every 5 steps is stopped after 15 steps
(checkpoints 10 and 15 kept). The newest checkpoint's ``trainer_state.json`` is then damaged without
changing its size (so the ``COMPLETE`` marker's size check still passes). ``loom ckpt verify`` names the
file; re-running the same command resumes from step 10 (logging why step 15 was skipped) and finishes
all 20 steps, with every step recorded once.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]


def loom(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run([sys.executable, "-m", "torchloom.cli", *args], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)


def test_corrupt_newest_checkpoint_resumes_from_the_previous_one(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    args = ["train", "smoke", "--output-dir", str(out), "--set", f"data.cache_dir={cache}",
            "--set", "log.progress=false", "--set", "checkpoint.interval=5"]
    first = loom(*args, "--max-steps-this-run", "15")
    assert first.returncode == 0, first.stdout[-4000:]
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000010", "step_00000015"]

    ts = ckpts / "step_00000015" / "trainer_state.json"
    ts.write_bytes(b"#" + ts.read_bytes()[1:])
    check = loom("ckpt", "verify", str(out))
    assert check.returncode == 0, check.stdout
    assert (f"FAILED  step_00000015: checkpoint {ckpts / 'step_00000015'} is corrupt: file {ts} does not match "
            f"its checksum") in check.stdout
    assert f"a resume from {ckpts} loads {ckpts / 'step_00000010'}" in check.stdout

    second = loom(*args)
    assert second.returncode == 0, second.stdout[-4000:]
    assert f"skipped 1 unusable checkpoint(s) (step_00000015: checkpoint file {ts} is corrupt" in second.stdout
    assert "resumed from step 10" in second.stdout
    train = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in train if r["type"] == "train"] == list(range(1, 21))
    assert json.loads((out / "summary.json").read_text())["resumed_from"] == 10
