"""`loom train` runs the replica check (train.check_replicas_every, docs/train.md) on its real recipe
(AdamW, SumLoss, clipping, evaluation) without a false positive: 2 gloo processes, the check after every
step. A divergence would stop the job with ReplicaDivergenceError (exit code != 0)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]


def test_loom_train_checks_replicas_every_step(tmp_path, cache):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torchloom.cli", "train", "smoke", "--output-dir", str(tmp_path / "out"),
         "--set", f"data.cache_dir={cache}", "--set", "train.steps=4", "--set", "train.check_replicas_every=1",
         "--set", "eval.interval=0", "--set", "checkpoint.interval=0", "--set", "sample.max_new_tokens=0"],
        cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "replica check: parameters compared across data-parallel replicas after step 1 and every 1 steps" \
        in proc.stdout, proc.stdout[-4000:]
    assert "ReplicaDivergenceError" not in proc.stdout
