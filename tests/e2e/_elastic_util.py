"""Helpers for the elastic-restart e2e tests: run `loom train smoke` (optionally with a fault plan) and read
its outputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from torchloom.testing.dist import free_port  # noqa: F401  (re-exported for the elastic tests)

REPO = Path(__file__).resolve().parents[2]

# A short smoke job: checkpoints every 2 steps, no evaluation or sample, sample ids logged.
SMOKE = ("--set", "eval.interval=0", "--set", "log.progress=false", "--set", "log.sample_ids=true",
         "--set", "sample.max_new_tokens=0", "--set", "checkpoint.interval=2", "--set", "checkpoint.keep_last=2")


def loom_env(fault_plan: str | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env.pop("OMP_NUM_THREADS", None)
    env.pop("LOOM_FAULT_PLAN", None)
    if fault_plan:
        env["LOOM_FAULT_PLAN"] = fault_plan
    return env


def loom_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torchloom.cli", *args]


def train(out: Path, cache: Path, steps: int, *extra: str, fault_plan: str | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess:
    """``loom train smoke`` into ``out`` for ``steps`` steps (2 processes unless ``extra`` says otherwise)."""
    cmd = loom_cmd("train", "smoke", "--output-dir", str(out), "--set", f"data.cache_dir={cache}",
                   "--set", f"train.steps={steps}", *SMOKE, *extra)
    return subprocess.run(cmd, cwd=REPO, env=loom_env(fault_plan), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=timeout)




def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_records(out: Path) -> list[dict]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if r["type"] == "train"]


def weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].dtype == wb[k].dtype and (wa[k] == wb[k]).all(), f"{k} differs"


def assert_same_training(ref: Path, out: Path, steps: int) -> None:
    """Same steps, losses, learning rates and sample ids (bitwise), no sample repeated, same final weights."""
    a, b = train_records(ref), train_records(out)
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    key = lambda r: (r["step"], r["loss"], r["lr"], r["sample_ids"])  # noqa: E731
    assert [key(r) for r in b] == [key(r) for r in a]
    flat = [i for r in b for ids in r["sample_ids"] for i in ids]
    assert len(flat) == len(set(flat)) == steps * 8  # global batch 8, less than one epoch: no repeats
    assert_same_weights(ref, out)
