"""Flash checkpoints (torchloom.checkpoint.flash) on 2 gloo ranks: non-blocking saves persisted by the
background savers, in-memory snapshots preferred on restart, a SIGKILLed trainer's snapshot persisted by
its saver, and on_busy='skip'."""
from __future__ import annotations

import pytest
import torch

from tests.distributed import _flash_workers as w
from torchloom.testing import run_ranks


@pytest.mark.parametrize("wrap", ["fsdp", "ddp"])
def test_flash_save_resumes_bitwise_from_memory_and_disk(tmp_path, wrap):
    r0, r1 = run_ranks(w.resume_rank, 2, str(tmp_path), wrap, timeout=240)
    for r in (r0, r1):
        assert r["saved2"] and r["saved3"]
        # the background save of step 2 is a complete checkpoint that torchloom.checkpoint.load reads
        assert r["complete"] == ["step_00000002"]
        assert r["disk"] == {"step": 2, "extra": {"note": "two"}, "cursor": 2}
        assert r["disk_equal"], "resume from the background-persisted checkpoint diverged"
        assert r["disk_losses"] == r["losses"]
        # the memory-only snapshot of step 3 is newer than the disk: it is preferred
        assert r["mem"] == {"source": "memory", "step": 3, "cursor": 3}
        assert r["mem_equal"], "resume from the in-memory snapshot diverged"
        assert r["mem_losses"] == r["losses"][1:]
        assert len(r["blocking_s"]) == 2


@pytest.mark.distributed
def test_flash_with_tensor_parallel(tmp_path):
    """4 ranks, dp_shard=2 x tp=2 (strided FSDP shards over tp, a different dp sub-mesh per tp rank) and
    pp=2 x tp=2 (a different tp sub-mesh per stage): the savers rebuild the DTensors on the world mesh
    without hanging; disk and memory restores are bitwise equal to the saved params and AdamW state
    (tolerance: none)."""
    strategies = [[("parallel_mode", {"dp_shard": 2, "tp": 2}), "tensor_parallel", "fsdp"],
                  [("parallel_mode", {"pp": 2, "tp": 2}), "pipeline_parallel", "tensor_parallel"]]
    for ranks in run_ranks(w.tp_ranks, 4, str(tmp_path), strategies, timeout=400):
        for r in ranks:
            assert r["mem"] == ("memory", 2) and r["mem_equal"]
            assert r["disk_step"] == 2 and r["disk_equal"] and r["n"] > 5


def test_saver_persists_snapshot_of_killed_trainer(tmp_path):
    with pytest.raises(RuntimeError, match="died"):
        run_ranks(w.killed_trainer_rank, 2, str(tmp_path), timeout=240)
    r0, r1 = run_ranks(w.after_kill_rank, 2, str(tmp_path), timeout=240)
    for r in (r0, r1):
        assert r["latest"] == "step_00000003", "the saver did not persist the killed trainer's snapshot"
        assert r["source"] == "memory" and r["step"] == 3 and r["mem_equal"]
        assert r["disk_step"] == 3 and r["disk_equal"]


def test_on_busy_skip(tmp_path):
    gate = tmp_path / "gate"
    r0, r1 = run_ranks(w.busy_rank, 2, str(tmp_path), str(gate), timeout=240,
                       env={"TORCHLOOM_FLASH_TEST_GATE": str(gate)})
    for r in (r0, r1):
        assert r["results"] == [True, False, True, True]
        assert r["skipped"] == 1
        assert r["complete"] == ["step_00000001", "step_00000004"]


def test_torn_snapshot_is_not_a_snapshot(tmp_path):
    from torchloom.checkpoint.shm import Slot, complete_steps

    s = Slot(tmp_path, 0)
    t = torch.arange(10, dtype=torch.float32)
    s.write([("a", t, None)], {"step": 5}, b"rng file bytes")
    assert complete_steps(tmp_path) == {5: 0}
    assert torch.equal(s.read_tensors(s.header())["a"], t)
    s.data_path.write_bytes(b"\0" * 8)  # truncated data: not a snapshot
    assert s.header() is None and complete_steps(tmp_path) == {}
    s.write([("a", t, None)], {"step": 6}, b"rng file bytes")
    s.header_path.unlink()  # a copy interrupted before its header was written
    assert complete_steps(tmp_path) == {}


def _loom_train(out, cache, *extra):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run([sys.executable, "-m", "torchloom.cli", "train", "smoke", "--output-dir", str(out),
                           "--set", f"data.cache_dir={cache}", "--set", "log.progress=false",
                           "--set", "sample.max_new_tokens=0", "--set", "checkpoint.blocking=false",
                           "--set", "checkpoint.memory_interval=4", *extra],
                          cwd=repo, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)


@pytest.mark.e2e
def test_loom_train_with_flash_checkpoints_resumes_exactly(tmp_path):
    """`loom train` with checkpoint.blocking=false: an uninterrupted run, and a run stopped after 13 steps
    and re-run, which resumes from the in-memory snapshot of step 12 (newer than the disk's step 10) and
    ends with bitwise the same weights and losses."""
    import json

    from safetensors.torch import load_file

    cache = tmp_path / "cache"
    full = _loom_train(tmp_path / "full", cache)
    assert full.returncode == 0, full.stdout[-4000:]
    assert "flash checkpoint step 10: training blocked" in full.stdout
    assert "in-memory snapshot step 12: training blocked" in full.stdout
    ckpts = sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir())
    assert ckpts == ["step_00000010", "step_00000020"], ckpts
    first = _loom_train(tmp_path / "cut", cache, "--max-steps-this-run", "13", "--set",
                        "checkpoint.save_on_stop=false")  # stopped like a crash: the snapshot of 12 is the newest
    assert first.returncode == 0, first.stdout[-4000:]
    again = _loom_train(tmp_path / "cut", cache)
    assert again.returncode == 0, again.stdout[-4000:]
    assert "resumed from step 12" in again.stdout, again.stdout[-3000:]
    a = load_file(tmp_path / "full" / "model.safetensors")
    b = load_file(tmp_path / "cut" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def losses(out):
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        return [(r["step"], r["loss"]) for r in recs if r["type"] == "train"]

    assert losses(tmp_path / "full") == losses(tmp_path / "cut")


def test_config_and_argument_errors(tmp_path):
    from torchloom.checkpoint import CheckpointError, FlashCheckpointer
    from torchloom.train.config import ConfigError, TrainConfig

    cfg = TrainConfig.load("smoke", ["checkpoint.blocking=false", "checkpoint.memory_interval=5",
                                     "checkpoint.on_busy=skip"], str(tmp_path / "out"))
    assert (cfg.checkpoint.blocking, cfg.checkpoint.memory_interval, cfg.checkpoint.on_busy) == (False, 5, "skip")
    with pytest.raises(ConfigError, match="on_busy"):
        TrainConfig.load("smoke", ["checkpoint.on_busy=later"], str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="memory_interval"):
        TrainConfig.load("smoke", ["checkpoint.memory_interval=-1"], str(tmp_path / "out"))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="on_busy must be one of"):
        FlashCheckpointer(tmp_path, model=model, on_busy="later")
    with pytest.raises(CheckpointError, match="keep_last"):
        FlashCheckpointer(tmp_path, model=model, keep_last=0)


@pytest.mark.e2e
def test_elastic_restart_resumes_from_the_killed_runs_memory_snapshot(tmp_path):
    """`loom train` (2 ranks, restart budget 2) with flash checkpoints: disk every 4 steps, memory every
    step; rank 1 is SIGKILLed after step 7 (before its step-7 snapshot). The savers persist the newest
    snapshot both ranks hold (step 6) and the restarted ranks resume from step 6 (not the disk's step 4),
    ending bitwise equal to an uninterrupted run (losses, sample ids, weights)."""
    from tests.e2e._elastic_util import assert_same_training, train

    steps = 10
    ref = train(tmp_path / "ref", tmp_path / "cache", steps)
    assert ref.returncode == 0, ref.stdout[-4000:]
    flash_args = ("--set", "checkpoint.blocking=false", "--set", "checkpoint.memory_interval=1",
                  "--set", "checkpoint.interval=4", "--max-restarts", "2")
    proc = train(tmp_path / "flash", tmp_path / "cache", steps, *flash_args, fault_plan="kill:rank=1,step=7,attempt=0")
    log = proc.stdout
    assert proc.returncode == 0, log[-6000:]
    assert "rank 1 SIGKILLs itself after step 7 (attempt 0)" in log
    assert "persisting the in-memory snapshot of step 6" in log, log[-6000:]
    assert "resumed from step 6" in log, log[-6000:]
    assert_same_training(tmp_path / "ref", tmp_path / "flash", steps)
