"""Elastic restarts under fault injection, and a two-"node" launch over loopback.

A 12-step smoke job (checkpoint every 2 steps, sample ids logged) runs once uninterrupted. Then:

* the same job under ``loom train --max-restarts 4`` with three SIGKILLs of a random rank at random steps on
  attempts 0, 1 and 2 (``LOOM_FAULT_PLAN``, seeded): it must exit 0 after exactly 3 restarts (each logged
  with its cause), with bitwise the same losses, sample ids and final weights as the uninterrupted run;
* the same job started by two ``loom train --nnodes 2 --nproc 1`` launchers with a c10d rendezvous on
  127.0.0.1 (the code path of two hosts): bitwise the same result.
"""
import json
import random
import subprocess

import pytest

from ._elastic_util import (REPO, assert_same_training, free_port, loom_cmd, loom_env, train, SMOKE)

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

from .conftest import ELASTIC_STEPS as STEPS  # the shared reference run's length


def fault_plan(seed: int, kills: int = 3) -> tuple[str, list[tuple[int, int]]]:
    """``kills`` kills of a random rank (of 2) at random, increasing steps, one per attempt 0..kills-1.
    Increasing steps guarantee every attempt reaches its kill step (it resumes at or before the last one)."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(1, STEPS), kills))
    plan = [(rng.randrange(2), s) for s in steps]
    return ";".join(f"kill:rank={r},step={s},attempt={a}" for a, (r, s) in enumerate(plan)), plan


def test_fault_plan_is_valid():
    from torchloom.elastic.faults import Kill, parse_plan

    text, plan = fault_plan(0)
    assert parse_plan(text) == [Kill(r, s, a) for a, (r, s) in enumerate(plan)]


def test_random_rank_kills_resume_exactly(tmp_path, cache, reference):
    text, plan = fault_plan(seed=2026)
    out = tmp_path / "faulty"
    proc = train(out, cache, STEPS, "--max-restarts", "4", fault_plan=text)
    log = proc.stdout
    assert proc.returncode == 0, f"plan {text}\n" + log[-6000:]
    for attempt, (rank, step) in enumerate(plan):
        assert f"rank {rank} SIGKILLs itself after step {step} (attempt {attempt})" in log
        assert f"restart {attempt + 1}/4: worker group failed:" in log
    assert log.count("killed by SIGKILL (signal 9)") == 3, log[-6000:]
    assert "[loom] restarts: 3 (worker-group failures: 3)" in log

    assert_same_training(reference, out, STEPS)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 3
    g = summary["goodput"]
    assert g["restarts"] == 3 and len(g["recovery_s"]) == 3 and all(r > 0 for r in g["recovery_s"])
    assert 0 < g["effective_training_time"] < 1 and g["productive_s"] > 0
    assert set(g["lost_s"]) == {"startup_s", "restart_gap_s", "recompute_s", "checkpoint_stall_s", "other_s"}
    resumed = [e["resumed_step"] for e in map(json.loads, (out / "goodput.jsonl").read_text().splitlines())
               if e["event"] == "start"]
    # the kill comes before step s saves: each restart resumes from the newest checkpoint before s
    assert resumed == [0] + [2 * ((s - 1) // 2) for _, s in plan]


def test_two_launchers_over_loopback(tmp_path, cache, reference):
    out = tmp_path / "two_nodes"
    port = free_port()
    args = loom_cmd("train", "smoke", "--output-dir", str(out), "--set", f"data.cache_dir={cache}",
                    "--set", f"train.steps={STEPS}", *SMOKE, "--nnodes", "2", "--nproc", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "loopback2")
    env = loom_env(OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen(args, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for _ in range(2)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(nodes, logs):
        assert p.returncode == 0, log[-4000:]
    assert_same_training(reference, out, STEPS)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["restarts"] == 0
