"""`loom train` with `train.optimizer: agd` and `wsam` (docs/optim/): the smoke job on 2 processes trains,
its held-out loss falls, and the optimizer that ran is the one configured (WSAM: two passes per step, so
its loss differs from plain AdamW's on the same data)."""
import json

import pytest

from .test_train_cli import read_jsonl, smoke

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]


@pytest.mark.parametrize("optimizer, lr", [("agd", "3e-4"), ("wsam", "3e-3")])
def test_smoke_trains_with_optimizer(tmp_path, cache, optimizer, lr):
    out = tmp_path / optimizer
    proc = smoke(out, cache, "--nproc", "2", "--set", f"train.optimizer={optimizer}",
                 "--set", f"train.lr={lr}")
    assert proc.returncode == 0, proc.stdout[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.3, summary
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("type", "train") == "train" and "loss" in r]
    assert len(steps) == summary["steps"]
    cfg = (out / "config.yaml").read_text()
    assert f"optimizer: {optimizer}" in cfg
